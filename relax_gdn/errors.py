"""The exception types for problems the user fixes (configuration, data, checkpoints, files), and
every exit code ``train.py`` and the command-line tools end with.

``train.py`` and the command-line tools print a :class:`RecipeError`'s message (no traceback) and
exit with :data:`USER_ERROR_EXIT_CODE`; anything else is a bug and keeps its traceback. Raise a
:class:`RecipeError` (or a subclass) with a message that names the key, file or value and says
what to change. A leaf module: it imports nothing of the project, so every layer can raise these.

Exit codes (docs/checkpoints.md has the table users read; each code is defined here once):

====  =========================================================================================
0     finished
1     a bug: an unexpected exception, with its traceback
2     :data:`USER_ERROR_EXIT_CODE`: a problem in what was given (config, data, checkpoint files)
3     :data:`DIVERGED_EXIT_CODE`: a non-finite loss or grad norm stopped the run
      (``train.on_nonfinite``); nothing was saved after the last finite step
75    :data:`PREEMPTED_EXIT_CODE`: SIGTERM / SIGUSR1 stopped the run after a checkpoint: requeue
124   :data:`HANG_EXIT_CODE`: no step completed within ``train.hang_timeout_s`` (stacks written
      to ``<run dir>/hang/``): requeue
130   :data:`INTERRUPTED_EXIT_CODE`: Ctrl-C (SIGINT) stopped the run (after a checkpoint, or at
      once on a second Ctrl-C): not requeued, the user asked for it
====  =========================================================================================
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

USER_ERROR_EXIT_CODE = 2  # the exit code of every RecipeError (argparse uses 2 for usage errors too)
DIVERGED_EXIT_CODE = 3  # train.on_nonfinite ended the run: retrying the same command diverges again
PREEMPTED_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL ("try again"): a requeued job resumes
HANG_EXIT_CODE = 124  # timeout(1)'s code for a command that ran out of time: a requeued job resumes
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
REQUEUE_EXIT_CODES = (PREEMPTED_EXIT_CODE, HANG_EXIT_CODE)  # what a job script or sweep requeues

SHOW_TRACEBACK_ENV = "HYDRA_FULL_ERROR"  # =1: a RecipeError keeps its traceback (Hydra's own switch)
# The file a job script names for the run's exit code: torchrun exits 1 whatever its workers'
# codes were, so slurm/train.sbatch reads the decision (requeue or not) from here.
EXIT_CODE_FILE_ENV = "RELAX_GDN_EXIT_CODE_FILE"
# How long ranks > 0 wait for rank 0 to report an error every rank hit; rank 0 says when it has
# (through torchrun's store), so the wait ends then. Only a rank 0 that did not hit the error
# (a file visible on some nodes only) lets it run out; the rank then reports the error itself.
QUIET_RANK_WAIT_S = 60.0
_REPORTED_KEY = "relax_gdn/user_error_reported"


class RecipeError(Exception):
    """A problem in what the user gave the recipe; the message names it and the fix."""

    # True where every rank of a torchrun job checks the same thing and fails the same way
    # (configuration, data files): rank 0 alone reports it.
    same_on_every_rank = False
    # Set on an error the ranks agreed on (relax_gdn.train.agreement): every rank raises it in the
    # same place and rank 0 reports it; ``found_on_rank`` names the rank that found it when the
    # others did not.
    agreed = False
    found_on_rank: int | None = None


class ConfigError(RecipeError, ValueError):
    """An impossible configuration; ``problems`` holds one message per broken rule."""

    same_on_every_rank = True

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            super().__init__(f"configuration problem: {self.problems[0]}")
        else:
            super().__init__(
                f"{len(self.problems)} configuration problems:\n"
                + "\n".join(f"  - {p}" for p in self.problems)
            )

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


def record_exit_code(code: int) -> None:
    """Write ``code`` into the file :data:`EXIT_CODE_FILE_ENV` names, when it names one (every rank
    writes what it exits with; the ranks of a run decide their code together)."""
    path = os.environ.get(EXIT_CODE_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"{code}\n")
    except OSError as e:  # the job script then decides from torchrun's status: say why it lacks ours
        print(f"warning: cannot write the exit code to {EXIT_CODE_FILE_ENV}={path} ({e})", file=sys.stderr)


def report_user_error(error: RecipeError, runtime=None) -> NoReturn:
    """Print ``error`` as one message on stderr and exit with :data:`USER_ERROR_EXIT_CODE`.

    Under torchrun only rank 0 speaks for an error every rank has (one every rank hits alike, or
    one the ranks agreed on); the others exit once rank 0 has reported it, so torchrun never stops
    rank 0 before it printed. torchrun stops a rank still waiting with SIGTERM once rank 0 has
    exited: with the process's ``runtime`` (:class:`relax_gdn.runtime.Runtime`) the rank then exits
    with the same code, quietly; without one it ends by the signal (which ``relax_gdn.launch``
    does not count against the workers' code). Other errors are printed by each rank that hits
    them, prefixed with its rank. ``HYDRA_FULL_ERROR=1`` re-raises instead, traceback included."""
    if os.environ.get(SHOW_TRACEBACK_ENV) == "1":
        raise error
    rank = int(os.environ.get("RANK", "0"))
    shared = error.same_on_every_rank or error.agreed
    record_exit_code(USER_ERROR_EXIT_CODE)
    if rank != 0 and shared:
        if runtime is not None:
            runtime.exit_quietly_on_sigterm(USER_ERROR_EXIT_CODE)
        if _wait_for_rank0_report():
            raise SystemExit(USER_ERROR_EXIT_CODE)
    origin = error.found_on_rank if error.agreed else rank
    prefix = f"[rank {origin}] " if origin else ""
    print(f"{prefix}error: {error}", file=sys.stderr, flush=True)
    if rank == 0 and shared:
        _announce_report()
    raise SystemExit(USER_ERROR_EXIT_CODE)


def _launcher_store(timeout_s: float):
    """A client of torchrun's own key-value store (its agent hosts it for the whole job, so it is
    there before and after the ranks' process group), or None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    try:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, ValueError):  # torch reports a store it cannot reach as RuntimeError
        return None


def _reported_key() -> str:
    # one key per attempt: torchrun restarts (--max-restarts) run the ranks again with the same store
    return f"{_REPORTED_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _announce_report() -> None:
    store = _launcher_store(10.0)
    if store is not None:
        store.set(_reported_key(), "1")


def _wait_for_rank0_report() -> bool:
    """True once rank 0 has reported the error (it says so in torchrun's store, ending the wait
    there and then); False without that store or when rank 0 does not within QUIET_RANK_WAIT_S."""
    store = _launcher_store(QUIET_RANK_WAIT_S)
    if store is None:
        return False
    try:
        store.wait([_reported_key()])
    except RuntimeError:  # torch's store timeout (DistStoreError is a RuntimeError)
        return False
    return True
