"""Where Megatron-Core's checkpoint writer reports its results, so that nothing it starts outlives its rank.

Megatron-Core 0.19.2's ``FileSystemWriterAsync`` hands the results of a save's writes back through
``filesystem_async.get_write_results_queue()``: a ``multiprocessing.Manager().Queue()`` whose server
is a spawned process, made at the first save and kept in the module global ``_results_queue``. That
server never learns of its rank's death (``kill -9`` of the rank leaves it running, holding the
job's output open) and dies of the job's SIGTERM / SIGUSR1 like every process of the job, failing
the save in progress (BrokenPipeError). :func:`use_write_results_queue` puts a queue there before
Megatron-Core makes one (it makes one only while the global is None):

* inline saves (every CPU save, GPU saves without ``checkpoint.async_save``): a plain in-process
  ``queue.Queue``. The writer's threads and the reader are one process, so no process is needed.
* background saves (``checkpoint.async_save``): the writer is a forked process, so the queue needs
  a server; ours is a Manager whose server asks the kernel to SIGKILL it when the rank dies
  (``PR_SET_PDEATHSIG``) and ignores SIGTERM, SIGINT, SIGUSR1 and SIGHUP: the rank owns shutdown.
  :func:`dies_with_parent` gives the forked writer the same death signal.

A fork-context queue instead of a Manager would need no server, but a forked writer putting more
than a pipe's buffer into it blocks until the rank reads, and the rank reads only after the writer
has exited. This module imports neither torch nor Megatron-Core at import time: the Manager's
server process imports it to run :func:`_serve_for`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# what the rank owns: the job's stop signals reach every process of the job, the writer's server included
_IGNORED_IN_SERVER = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)


def die_with(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent (``parent_pid``) dies (Linux; elsewhere
    nothing is asked); exit at once if the parent is gone already."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent_pid:  # the parent died before the request was made
        os._exit(0)


def _serve_for(parent_pid: int) -> None:
    """The Manager server's initializer: die with the rank, leave its stop signals to the rank."""
    die_with(parent_pid)
    for signum in _IGNORED_IN_SERVER:
        signal.signal(signum, signal.SIG_IGN)


def dies_with_parent(fn: Callable | None) -> Callable | None:
    """``fn`` run in a child process that dies with the process calling this (for the forked
    background writer); None stays None (nothing to write on this rank)."""
    if fn is None:
        return None
    parent = os.getpid()

    @functools.wraps(fn)
    def run(*args, **kwargs):
        die_with(parent)
        return fn(*args, **kwargs)

    return run


def use_write_results_queue(background: bool) -> Callable[[], None]:
    """Give Megatron-Core's writer the queue described in the module docstring (``background``:
    saves written by a forked process); returns the function that puts back what was there and
    stops the server."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert hasattr(filesystem_async, "_results_queue") and hasattr(
        filesystem_async, "get_write_results_queue"
    ), (
        "Megatron-Core's filesystem_async no longer keeps its write-results queue in _results_queue: "
        "see relax_gdn/compat/write_results.py"
    )
    before = filesystem_async._results_queue
    manager = None
    if background:
        import multiprocessing as mp
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=_serve_for, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()
    else:
        filesystem_async._results_queue = queue.Queue()

    def restore() -> None:
        filesystem_async._results_queue = before
        if manager is not None:
            manager.shutdown()

    return restore
