"""Stop requests: SIGTERM / SIGUSR1 (preemption) and SIGINT (Ctrl-C) ask the run to stop after the
step in progress, with a checkpoint.

The handlers only note the request (:class:`StopRequest`); the loop carries it in the step's one
all-reduce, so every rank stops after the same step and saves (a collective) before it exits:

* SIGTERM, SIGUSR1 (a SLURM time limit or preemption, ``scancel --signal``): exit 75
  (:data:`~relax_gdn.errors.PREEMPTED_EXIT_CODE`): run the same command again, or requeue.
* SIGINT (Ctrl-C): exit 130 (:data:`~relax_gdn.errors.INTERRUPTED_EXIT_CODE`), not requeued. A
  second Ctrl-C stops the process at once, saving nothing, with one line. torchrun passes a
  terminal's Ctrl-C on to its workers, which have it from the terminal already: a SIGINT within
  :data:`SIGINT_ECHO_S` of the first is that echo, not a second Ctrl-C.

A request that arrives during a save lets the save finish (the checkpoint writer's helper process
ignores these signals: :mod:`relax_gdn.compat.write_results`); the run then stops without another
step.
"""

from __future__ import annotations

import os
import signal
import time

from relax_gdn.errors import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, record_exit_code

# torchrun's copy of a terminal's Ctrl-C reaches a worker milliseconds after the terminal's own;
# a person's second Ctrl-C comes after reading the first one's message
SIGINT_ECHO_S = 2.0
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """This process's stop signals, handled from construction until :meth:`restore` (through the
    Runtime, which owns signal handlers). ``rank``: only rank 0 prints; ``saves``: whether a stop
    saves a checkpoint (said in the Ctrl-C message)."""

    def __init__(self, runtime, *, rank: int, saves: bool):
        self.rank, self.saves = rank, saves
        self.preempted_by: str | None = None  # the first SIGTERM / SIGUSR1 seen, by name
        self.interrupted = False  # a Ctrl-C (SIGINT) was seen
        self.step: int | None = None  # the step in progress (for the messages); None: before step 1
        self._first_sigint: float | None = None
        self._runtime = runtime
        self._installed = [signum for signum in (*PREEMPTION_SIGNALS, signal.SIGINT)
                           if runtime.handle_signal(signum, self._handler(signum))]

    @property
    def exit_code(self) -> int:
        """75 when a preemption signal asked (a job script requeues it), else 130 (Ctrl-C)."""
        return PREEMPTED_EXIT_CODE if self.preempted_by is not None else INTERRUPTED_EXIT_CODE

    def _handler(self, signum: int):
        return self._on_interrupt if signum == signal.SIGINT else self._on_preempt

    def _on_preempt(self, signum, frame) -> None:
        if self.preempted_by is None:
            self.preempted_by = signal.Signals(signum).name

    def _on_interrupt(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first_sigint is None:
            self._first_sigint, self.interrupted = now, True
            where = f"step {self.step}" if self.step is not None else "the first step"
            self._say(f"Ctrl-C: stopping after {where}{', then saving a checkpoint' if self.saves else ''}; "
                      "press Ctrl-C again to stop at once without saving")
        elif now - self._first_sigint > SIGINT_ECHO_S:
            where = f"during step {self.step}" if self.step is not None else "before the first step"
            self._say(f"second Ctrl-C: stopped at once {where}, nothing saved since the last checkpoint "
                      "(checkpoint.resume=auto continues from it)")
            record_exit_code(INTERRUPTED_EXIT_CODE)
            os._exit(INTERRUPTED_EXIT_CODE)  # at once: no teardown that could wait on the other ranks

    def _say(self, text: str) -> None:
        # os.write, not logging or print: a handler can interrupt either halfway through a write
        if self.rank == 0:
            os.write(2, f"relax-gdn: {text}\n".encode())

    def restore(self) -> None:
        """Put back the handlers the signals had before."""
        for signum in self._installed:
            self._runtime.restore_signal(signum)
        self._installed = []
