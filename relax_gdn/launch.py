"""``python -m relax_gdn.launch [torchrun options] train.py [overrides]``: torchrun, ending with the
exit code its workers agree on.

torchrun reports any failed worker as a failure of its own: exit code 1 and a ``ChildFailedError``
report of about 30 lines, whatever the workers exited with. The recipe's workers exit with codes
that mean something to the person or the job script (2: a problem to fix, printed once by rank 0;
75: stopped after a checkpoint, to be requeued). This runs torchrun itself
(``torch.distributed.run``: the same options, rendezvous, signal handling and worker management)
and, when every worker that failed exited with one and the same code of 2 or more (workers
torchrun stopped with SIGTERM after that first failure aside), exits with that code without
torchrun's report: the workers have said why. Any other failure (a traceback's exit 1, a worker
killed by a signal, workers that disagree) keeps torchrun's report and its exit code 1.

``make run`` and ``slurm/train.sbatch`` start their workers through it; a bare ``torchrun`` runs
the same workers and ends with torchrun's own report and exit code.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Iterable

# torchrun's log lines about a failed worker, restated by its report: held back until the launcher
# knows whether the exit was one the workers explained (dropped) or not (emitted as they were)
_TORCHRUN_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_CLOSING = "Sending process %s closing signal %s"
_FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"


def agreed_exit_code(exit_codes: Iterable[int]) -> int | None:
    """The failed workers' own exit code when they agree on one of 2 or more, workers stopped by
    torchrun's SIGTERM after the first failure aside; None when torchrun's report should stand."""
    own = {code for code in exit_codes if code != -signal.SIGTERM}
    if len(own) == 1 and (code := own.pop()) >= 2:
        return code
    return None


class _WorkerExitLines(logging.Filter):
    """Holds back torchrun's "closing signal" lines until its "failed (exitcode: N)" line says
    which exit they follow: both are dropped when N could be the workers' agreed code."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self.held: list[logging.LogRecord] = []
        self._releasing = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self._releasing:
            return True
        if record.msg == _CLOSING:
            self.held.append(record)
            return False
        if record.msg == _FAILED and isinstance(record.args, tuple) and agreed_exit_code(record.args[:1]):
            self.held.clear()
            return False
        self.release()
        return True

    def release(self) -> None:
        """Emit what is held, in order."""
        held, self.held = self.held, []
        self._releasing = True
        try:
            for record in held:
                self.logger.handle(record)
        finally:
            self._releasing = False


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    logger = logging.getLogger(_TORCHRUN_LOGGER)
    lines = _WorkerExitLines(logger)
    logger.addFilter(lines)
    try:
        torchrun(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as e:
        code = agreed_exit_code(failure.exitcode for failure in e.failures.values())
        if code is None:
            lines.release()
            raise
        raise SystemExit(code) from None
    finally:
        lines.release()
        logger.removeFilter(lines)


if __name__ == "__main__":
    main()
