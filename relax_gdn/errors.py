"""The exception types for problems the user fixes (configuration, data, checkpoints, files).

``train.py`` and the command-line tools print the message (no traceback) and exit with
:data:`USER_ERROR_EXIT_CODE`; anything else is a bug and keeps its traceback. Raise a
:class:`RecipeError` (or a subclass) with a message that names the key, file or value and says
what to change. A leaf module: it imports nothing of the project, so every layer can raise these.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import NoReturn

USER_ERROR_EXIT_CODE = 2  # the exit code of every RecipeError (argparse uses 2 for usage errors too)
SHOW_TRACEBACK_ENV = "HYDRA_FULL_ERROR"  # =1: a RecipeError keeps its traceback (Hydra's own switch)
QUIET_RANK_WAIT_S = 60.0  # how long ranks > 0 leave an error every rank hits alike to rank 0


class RecipeError(Exception):
    """A problem in what the user gave the recipe; the message names it and the fix."""

    # True where every rank of a torchrun job checks the same thing and fails the same way
    # (configuration, data files): rank 0 alone reports it.
    same_on_every_rank = False


class ConfigError(RecipeError, ValueError):
    """An impossible configuration; ``problems`` holds one message per broken rule."""

    same_on_every_rank = True

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            super().__init__(f"configuration problem: {self.problems[0]}")
        else:
            super().__init__(f"{len(self.problems)} configuration problems:\n"
                             + "\n".join(f"  - {p}" for p in self.problems))

    def __reduce__(self):  # pickled whole (multiprocessing), not rebuilt from the message
        return type(self), (self.problems,)


class DataError(RecipeError, ValueError):
    """A data source that cannot be used as configured (missing, empty, wrong fields, too few
    samples); the message names the file and the ``data.*`` key to change."""

    same_on_every_rank = True


class MemoryFitError(RecipeError):
    """The memory model's refusal of a run that would not fit its GPU (before anything is built):
    ``estimate_gib`` (the per-GPU estimate by part, GiB), ``capacity_gib`` and ``fits`` (the
    settings the model says fit, as text); benchmarks report it and go on with the next variant."""

    same_on_every_rank = True

    def __init__(self, message: str, *, estimate_gib: dict[str, float], capacity_gib: float, fits: list[str]):
        super().__init__(message)
        self.estimate_gib, self.capacity_gib, self.fits = estimate_gib, capacity_gib, fits

    def __reduce__(self):
        return _memory_fit_error, (str(self), self.estimate_gib, self.capacity_gib, self.fits)


def _memory_fit_error(message, estimate_gib, capacity_gib, fits) -> MemoryFitError:
    return MemoryFitError(message, estimate_gib=estimate_gib, capacity_gib=capacity_gib, fits=fits)


def report_user_error(error: RecipeError) -> NoReturn:
    """Print ``error`` as one message on stderr and exit with :data:`USER_ERROR_EXIT_CODE`.

    Under torchrun only rank 0 speaks for an error every rank hits alike; other errors are printed
    by each rank that hits them, prefixed with its rank. ``HYDRA_FULL_ERROR=1`` re-raises instead,
    traceback included."""
    if os.environ.get(SHOW_TRACEBACK_ENV) == "1":
        raise error
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0 and error.same_on_every_rank:
        # Rank 0 reports it, and torchrun stops this rank (SIGTERM) once rank 0 exits: this rank
        # then exits with the same code, quietly. Exiting first would make torchrun stop rank 0
        # before it printed; a rank 0 that did not fail alike (a file visible on some nodes only)
        # leaves this rank to report after the wait.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _exit_quietly)
        time.sleep(QUIET_RANK_WAIT_S)
    prefix = f"[rank {rank}] " if rank else ""
    print(f"{prefix}error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(USER_ERROR_EXIT_CODE)


def _exit_quietly(signum, frame) -> NoReturn:
    raise SystemExit(USER_ERROR_EXIT_CODE)
