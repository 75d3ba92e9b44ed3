"""The step watchdog: a run in which no step completes for ``train.hang_timeout_s`` ends with evidence.

Every rank runs a :class:`StepWatchdog` thread. The loop tells it each time a step (and a save)
completes; when nothing completes before the deadline, the rank writes the Python stacks of all
its threads (``faulthandler``) to ``<run dir>/hang/rank<r>.txt``, says so in one line and exits
with :data:`~relax_gdn.errors.HANG_EXIT_CODE` (124), which job scripts requeue. A collective
stuck on one rank holds every rank in that step, so every rank's deadline passes at about the
same time and each leaves its stacks: the stuck rank's show where it is stuck, the others' which
collective they wait in. The first rank to exit makes torchrun stop the others, so a rank that has
written its stacks waits (at most :func:`peer_grace_s`) for every rank's file before it exits.

``train.hang_timeout_s``: a number of seconds (counted from the start of step 1, so it covers
the first step's compilation), ``auto`` (:func:`auto_hang_timeout`: ten times the run's median
step time, at least 300 s, armed once :data:`AUTO_AFTER_STEPS` steps are timed) or null (no
watchdog). The deadline runs from the last step or save completed, so a step with its
evaluation and checkpoint must fit within it. ``train.collective_timeout_s`` (the process
groups' own timeout) is the backstop before the watchdog is armed.

A hand-written thread rather than nvidia-resiliency-ext: its hang detection needs its own
launcher (``ft_launcher``'s rank monitors) or its in-process restart wrapper (NCCL, GPUs); this
recipe runs under torchrun, on CPU too.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

from relax_gdn.errors import HANG_EXIT_CODE, record_exit_code

HANG_FLOOR_S = 300.0  # the least ``auto`` waits: a checkpoint save of the 9B fits in it
HANG_STEP_FACTOR = 10.0  # ``auto`` waits this many median steps
AUTO_AFTER_STEPS = 3  # ``auto`` is armed once this many steps are timed (the first ones compile and tune)
_STEP_WINDOW = 101  # the median of the most recent step times: a run whose steps slow down follows
_PEER_POLL_S = 0.05


def peer_grace_s(timeout_s: float) -> float:
    """How long a rank that fired waits for the other ranks' stacks: the ranks of a stuck step pass
    their deadlines apart by no more than the step's tail after its last collective (logging, a
    descheduled process), far less than one timeout; at least 10 s, at most 60 s."""
    return min(max(timeout_s, 10.0), 60.0)


def auto_hang_timeout(step_times_s: list[float] | deque) -> float | None:
    """``train.hang_timeout_s=auto``: max(HANG_STEP_FACTOR x the median step time, HANG_FLOOR_S),
    or None (not armed yet) before AUTO_AFTER_STEPS steps are timed."""
    if len(step_times_s) < AUTO_AFTER_STEPS:
        return None
    return max(HANG_STEP_FACTOR * statistics.median(step_times_s), HANG_FLOOR_S)


class StepWatchdog:
    """One rank's watchdog (module docstring). ``setting``: ``train.hang_timeout_s``; ``dump_dir``:
    where ``rank<r>.txt`` goes (None: stderr); ``world_size``: the ranks whose files it waits for."""

    def __init__(self, setting: float | str | None, *, rank: int, dump_dir: Path | None, world_size: int = 1):
        self.setting, self.rank, self.dump_dir, self.world_size = setting, rank, dump_dir, world_size
        self.last_step: int | None = None  # the last step completed
        self._step_times: deque = deque(maxlen=_STEP_WINDOW)
        self._deadline: float | None = None
        self._timeout: float | None = None
        self._closed = False
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.setting is not None

    def start(self) -> None:
        """Start watching (before step 1); an explicit timeout is armed from now."""
        if not self.enabled:
            return
        if self.setting != "auto":
            self._arm(float(self.setting))
        self._thread = threading.Thread(target=self._watch, name="relax_gdn-step-watchdog", daemon=True)
        self._thread.start()

    def progress(self, step: int | None = None, step_time_s: float | None = None) -> None:
        """A step (``step``, which took ``step_time_s``) or a save completed: the deadline moves."""
        if not self.enabled:
            return
        if step is not None:
            self.last_step = step
        if step_time_s is not None:
            self._step_times.append(step_time_s)
        timeout = float(self.setting) if self.setting != "auto" else auto_hang_timeout(self._step_times)
        if timeout is not None:
            self._arm(timeout)

    def _arm(self, timeout: float) -> None:
        with self._wake:
            self._timeout, self._deadline = timeout, time.monotonic() + timeout
            self._wake.notify()

    def close(self) -> None:
        """Stop watching (the run's end: the export and the last save's wait are not steps)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        with self._wake:
            while not self._closed:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._wake.wait(left)
            if self._closed:
                return
        self._fire()

    def _fire(self) -> None:
        last = f"step {self.last_step}" if self.last_step is not None else "none"
        head = (
            f"rank {self.rank}: no training step completed in {self._timeout:.0f} s "
            f"(train.hang_timeout_s={self.setting}; last step completed: {last})"
        )
        where = self._dump_stacks(head)
        record_exit_code(HANG_EXIT_CODE)
        os.write(2, f"relax-gdn: {head}; stacks in {where}; exiting with {HANG_EXIT_CODE} (hang)\n".encode())
        if not where.startswith("stderr"):
            self._wait_for_peers(peer_grace_s(self._timeout))
        os._exit(HANG_EXIT_CODE)  # the main thread is stuck: no cleanup can be waited for

    def _dump_stacks(self, head: str) -> str:
        """Every thread's stack into ``rank<r>.txt`` (whole or absent: written aside, then renamed),
        or stderr where it cannot be written; returns where."""
        if self.dump_dir is not None:
            path = self.dump_dir / f"rank{self.rank}.txt"
            partial = path.with_suffix(".partial")
            try:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
                with open(partial, "w", encoding="utf-8") as f:
                    f.write(f"{head}\nPython stacks of every thread:\n\n")
                    f.flush()
                    faulthandler.dump_traceback(f, all_threads=True)
                os.replace(partial, path)
                return str(path)
            except OSError as e:
                where = f"stderr ({path} cannot be written: {e.strerror})"
        else:
            where = "stderr"
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        return where

    def _wait_for_peers(self, grace_s: float) -> None:
        """Until every rank's file is there or ``grace_s`` passed: the first rank to exit ends the
        job (torchrun stops the others), and a peer whose deadline is a moment later would leave none."""
        assert self.dump_dir is not None
        files = [self.dump_dir / f"rank{r}.txt" for r in range(self.world_size)]
        end = time.monotonic() + grace_s
        while time.monotonic() < end and not all(f.exists() for f in files):
            time.sleep(_PEER_POLL_S)
