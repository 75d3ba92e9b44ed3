"""Stop requests: SIGTERM / SIGUSR1 (preemption) and SIGINT (Ctrl-C) ask the run to stop after the
step in progress, with a checkpoint.

The handlers note the request (:class:`StopRequest`; they run on the Runtime's signal thread as
the signal arrives); the loop carries it in the step's one all-reduce, so every rank stops after
the same step and saves (a collective) before it exits:

* SIGTERM, SIGUSR1 (a SLURM time limit or preemption, ``scancel --signal``): exit 75
  (:data:`~relax_gdn.errors.PREEMPTED_EXIT_CODE`): run the same command again, or requeue.
* SIGINT (Ctrl-C): exit 130 (:data:`~relax_gdn.errors.INTERRUPTED_EXIT_CODE`), not requeued. A
  second Ctrl-C stops the process at once, with one line that says what is saved and what is not.

Who counts the presses of Ctrl-C:

* one process: each SIGINT is one.
* under ``python -m relax_gdn.launch`` (:data:`relax_gdn.launch.LAUNCHED_ENV` set): the launcher.
  A terminal's Ctrl-C reaches the launcher and every worker, ``kill -INT`` of the launcher reaches
  it alone, so the launcher passes each press on: the first as SIGINT (a worker that has it from
  the terminal takes it once: a worker ignores SIGINTs after its first), the second as
  :data:`relax_gdn.launch.AT_ONCE_SIGNAL`.
* under a bare torchrun, which passes a terminal's Ctrl-C on to its workers a moment after the
  terminal did: a SIGINT within :data:`SIGINT_ECHO_S` of the first is that copy.

A request that arrives during a save lets the save finish (the checkpoint writer's helper process
ignores these signals: :mod:`relax_gdn.compat.write_results`); the run then stops without another
step.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from relax_gdn.errors import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, record_exit_code
from relax_gdn.launch import AT_ONCE_SIGNAL, LAUNCHED_ENV
from relax_gdn.train.checkpoint import read_latest

# a bare torchrun's copy of a terminal's Ctrl-C reaches a worker milliseconds after the terminal's
# own; a person's second Ctrl-C comes after reading the first one's message
SIGINT_ECHO_S = 2.0
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """This process's stop signals, handled from construction until :meth:`restore` (through the
    Runtime, which owns signal handlers). ``rank``: only rank 0 prints; ``checkpoints``: the
    directory a stop saves into (None: nothing is saved) and ``resume`` the run's
    ``checkpoint.resume``, for the lines that say what is saved and how to continue."""

    def __init__(self, runtime, *, rank: int, checkpoints: Path | None, resume: str | None = None):
        self.rank, self.checkpoints, self.resume = rank, checkpoints, resume
        self.preempted_by: str | None = None  # the first SIGTERM / SIGUSR1 seen, by name
        self.interrupted = False  # a Ctrl-C (SIGINT) was seen
        self.step: int | None = None  # the step in progress (for the messages); None: before step 1
        self._first_sigint: float | None = None
        self._launched = os.environ.get(LAUNCHED_ENV) == "1"
        self._echo_s = SIGINT_ECHO_S if "TORCHELASTIC_RUN_ID" in os.environ and not self._launched else 0.0
        self._runtime = runtime
        handlers = {signum: self._on_preempt for signum in PREEMPTION_SIGNALS}
        handlers[signal.SIGINT] = self._on_interrupt
        if self._launched:
            handlers[AT_ONCE_SIGNAL] = self._on_at_once
        # run as the signal arrives: a stop at once must not wait for a main thread inside a collective
        self._installed = [
            signum
            for signum, handler in handlers.items()
            if runtime.handle_signal(signum, handler, on_arrival=True)
        ]

    @property
    def exit_code(self) -> int:
        """75 when a preemption signal asked (a job script requeues it), else 130 (Ctrl-C)."""
        return PREEMPTED_EXIT_CODE if self.preempted_by is not None else INTERRUPTED_EXIT_CODE

    def _on_preempt(self, signum, frame) -> None:
        if self.preempted_by is None:
            self.preempted_by = signal.Signals(signum).name

    def _on_interrupt(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first_sigint is None:
            self._first_sigint, self.interrupted = now, True
            then = (
                ", then saving a checkpoint"
                if self.checkpoints is not None
                else " (nothing is saved: no checkpoint directory)"
            )
            self._say(
                f"Ctrl-C: stopping after the step in progress{then}; Ctrl-C again stops at once "
                "without saving it"
            )
        elif not self._launched and now - self._first_sigint > self._echo_s:
            self._on_at_once(signum, frame)

    def _on_at_once(self, signum, frame) -> None:
        self._say(
            f"second Ctrl-C: stopped at once {self._where()}; "
            + saved_state(self.checkpoints, self.step, self.resume)
        )
        record_exit_code(INTERRUPTED_EXIT_CODE)
        os._exit(INTERRUPTED_EXIT_CODE)  # at once: no teardown that could wait on the other ranks

    def _where(self) -> str:
        return f"during step {self.step}" if self.step is not None else "before the first step"

    def _say(self, text: str) -> None:
        # os.write, not logging or print: a handler can interrupt either halfway through a write
        if self.rank == 0:
            os.write(2, f"relax-gdn: {text}\n".encode())

    def restore(self) -> None:
        """Put back the handlers the signals had before."""
        for signum in self._installed:
            self._runtime.restore_signal(signum)
        self._installed = []


def saved_state(checkpoints: Path | None, step: int | None, resume: str | None) -> str:
    """What a run stopped at once has on disk, read from ``checkpoints`` (its checkpoint directory,
    None: it has none) as it is now: the checkpoint ``latest`` names and how to continue from it,
    then the steps it lacks and a save that was cut off (``step``: the step in progress)."""
    if checkpoints is None:
        return "nothing is saved (no run directory or checkpoint.dir)"
    latest = read_latest(checkpoints)
    saved_step = int(latest.name.removeprefix("step_")) if latest is not None else 0
    if latest is None:
        saved = "saved: no checkpoint, nothing to continue from"
    else:
        again = (
            "the same command continues from it"
            if resume == "auto"
            else f"checkpoint.resume={latest} continues from it"
        )
        saved = f"saved: checkpoint {latest} (step {saved_step}), {again}"
    lost = []
    if step is not None and step > saved_step:
        lost.append(f"step {step}" if step == saved_step + 1 else f"steps {saved_step + 1}-{step}")
    cut = sorted(p.name for p in checkpoints.glob(".step_*.partial")) if checkpoints.is_dir() else []
    if cut:
        lost.append(
            f"the checkpoint being written ({checkpoints / cut[-1]}, incomplete: never read, removed "
            "by the next save)"
        )
    return saved + (f"; not saved: {', '.join(lost)}" if lost else "")
