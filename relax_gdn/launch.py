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

Ctrl-C is counted here, not by torchrun (which would pass it on to the workers as a second SIGINT,
kill them 30 s later whatever they were writing, and end with a traceback). A terminal's Ctrl-C
reaches the launcher and every worker; ``kill -INT`` of the launcher reaches it alone. So each
press is passed on to the workers (:data:`LAUNCHED_ENV` tells them who counts):

* the first as SIGINT: each worker finishes its step, the run saves its checkpoint and every
  worker exits 130 (:mod:`relax_gdn.train.stop`); the launcher then exits 130 too, with no report;
* the second as :data:`AT_ONCE_SIGNAL`: each worker stops at once (rank 0 says what is saved and
  what is not); a worker still running :data:`AT_ONCE_GRACE_S` later (stopped, or in a state
  where not even its signal thread runs) is killed, and so is every process below the workers;
  the launcher exits 130.

A Ctrl-C before any worker started ends the launcher at once with one line. A command line no
worker could run (``--nproc-per-node two``, a script or ``-m`` module that is not there) is one
line and exit code 2 before any worker starts, where torchrun ends in a traceback or in every
worker's error.

``make run`` and ``slurm/train.sbatch`` start their workers through it; a bare ``torchrun`` runs
the same workers and ends with torchrun's own report and exit code.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from relax_gdn.errors import INTERRUPTED_EXIT_CODE, RecipeError, report_user_error

# In the workers' environment: "1" when this launcher counts the presses of Ctrl-C (relax_gdn.train.stop)
LAUNCHED_ENV = "RELAX_GDN_LAUNCHED"
AT_ONCE_SIGNAL = signal.SIGUSR2  # the second Ctrl-C as the launcher passes it on: stop at once
AT_ONCE_GRACE_S = 10.0  # a worker that has not stopped this long after AT_ONCE_SIGNAL is killed
# torchrun's --signals-to-handle (the signals it stops its workers on) as its environment default,
# given here without SIGINT, which the launcher handles
_TORCHRUN_SIGNALS_ENV = "PET_SIGNALS_TO_HANDLE"
_TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default

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


class _CtrlC:
    """The launcher's SIGINT handler: counts the presses and passes them on (module docstring)."""

    def __init__(self) -> None:
        self.presses = 0

    def __call__(self, signum, frame) -> None:
        import psutil

        self.presses += 1
        workers = psutil.Process().children()
        if not workers:
            raise KeyboardInterrupt  # no worker yet: nothing ran
        if self.presses == 1:
            for worker in workers:
                _signal(worker, signal.SIGINT)
            return
        _stop_at_once(workers)
        raise SystemExit(INTERRUPTED_EXIT_CODE)


def _signal(process, signum: int) -> None:
    import psutil

    try:
        process.send_signal(signum)
    except psutil.NoSuchProcess:
        pass


def _rank(process) -> int:
    import psutil

    try:
        return int(process.environ().get("RANK", "0"))
    except (psutil.Error, ValueError):
        return 0


def _stop_at_once(workers: list) -> None:
    """:data:`AT_ONCE_SIGNAL` to every worker; what is still running after the grace, and every
    process below the workers (a checkpoint writer), is killed."""
    import psutil

    tree = list(workers)
    for worker in workers:
        try:
            tree += worker.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    ranks = {worker.pid: _rank(worker) for worker in workers}  # read while they run
    for worker in workers:
        _signal(worker, AT_ONCE_SIGNAL)
    _, running = psutil.wait_procs(workers, timeout=AT_ONCE_GRACE_S)
    for process in tree:
        _signal(process, signal.SIGKILL)
    psutil.wait_procs(tree, timeout=5.0)
    if running:
        named = ", ".join(
            f"rank {ranks[p.pid]} (pid {p.pid})" for p in sorted(running, key=lambda p: ranks[p.pid])
        )
        sys.stderr.write(
            f"relax-gdn: second Ctrl-C: killed {named}, not stopped {AT_ONCE_GRACE_S:.0f} s "
            "after being asked\n"
        )


@contextmanager
def _ctrl_c_counted_here() -> Iterator[None]:
    """SIGINT handled by :class:`_CtrlC` (not torchrun) and :data:`LAUNCHED_ENV` set for the workers,
    both undone after."""
    saved_env = {name: os.environ.get(name) for name in (LAUNCHED_ENV, _TORCHRUN_SIGNALS_ENV)}
    torchruns = os.environ.get(_TORCHRUN_SIGNALS_ENV, _TORCHRUN_SIGNALS).split(",")
    os.environ[_TORCHRUN_SIGNALS_ENV] = ",".join(name for name in torchruns if name.strip() != "SIGINT")
    os.environ[LAUNCHED_ENV] = "1"
    previous = signal.signal(signal.SIGINT, _CtrlC())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv: list[str] | None = None) -> None:
    try:
        with _ctrl_c_counted_here():
            _torchrun(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        sys.stderr.write("relax-gdn: Ctrl-C before the workers started: stopped, nothing ran\n")
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None


class LaunchError(RecipeError):
    """A command line torchrun would start no worker from, or start every worker to fail on."""


def check_launch(argv: list[str]) -> None:
    """What torchrun would only find out with a traceback (``--nproc-per-node two``) or in every
    worker (a script that is not there), as one :class:`LaunchError` before any worker starts."""
    from torch.distributed.run import determine_local_world_size, get_args_parser

    parser = get_args_parser()
    parser.prog = "python -m relax_gdn.launch"  # not argparse's default, this file's name (launch.py)
    args = parser.parse_args(argv)  # a usage error: torchrun's own message, exit 2
    try:
        determine_local_world_size(args.nproc_per_node)
    except ValueError as e:
        raise LaunchError(
            f"--nproc-per-node {args.nproc_per_node} ({str(e).rstrip('.')}): give a number of processes, "
            "or auto, cpu or gpu (one per CPU core / GPU of this machine)"
        ) from None
    if args.module:
        try:
            found = importlib.util.find_spec(args.training_script) is not None
        except ImportError:  # a parent package that is not there
            found = False
        if not found:
            raise LaunchError(
                f"-m {args.training_script}: no such module here (python {sys.executable}): check its "
                "name, e.g. -m relax_gdn.bench.train_e2e"
            )
    elif not (args.no_python or os.path.isfile(args.training_script)):
        raise LaunchError(
            f"{args.training_script} is not a file (from {os.getcwd()}): give the path of train.py, "
            "or -m and a module (python -m relax_gdn.launch --nproc-per-node N train.py <overrides>)"
        )


def _torchrun(argv: list[str]) -> None:
    """torchrun, ending with the failed workers' agreed exit code without its report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        check_launch(argv)
    except LaunchError as e:
        report_user_error(e)
    logger = logging.getLogger(_TORCHRUN_LOGGER)
    lines = _WorkerExitLines(logger)
    logger.addFilter(lines)
    try:
        torchrun(argv)
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
