"""Run a function in W real processes joined by a gloo process group, from a pytest test.

Importing torch and Megatron-Core costs seconds per process on a 2-core machine, so a test
should spawn ONE group per world size and run many cases inside ``fn``, returning results
(picklable) that the parent asserts on.

A run fails, never hangs:
- the ranks meet through a ``file://`` store in a fresh temporary directory (no port to race for);
- the first rank that raises (or dies) fails the run at once with that rank's traceback, and the
  other ranks are killed (they may be blocked in a collective the failed rank never joins);
- the whole run has a time limit (``timeout_s``, default ``RELAX_GDN_TEST_TIMEOUT_S`` or 900 s);
  past it every rank's Python stack is dumped into the failure message before the ranks are
  killed, and every collective has that limit too (``init_process_group(timeout=...)``).

Each rank is set up like an entry point sets up its process: ``fn`` runs inside an installed
:class:`relax_gdn.runtime.Runtime` (CPU shims without CUDA, FLA's settings with it), unless the
test asks for a bare process (``runtime=False``: pure-torch cases that need no Megatron-Core).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

# Generous: the 4-rank model fixtures take minutes on a loaded 2-core machine. A hang costs this
# much once, instead of blocking the suite until someone kills it.
DEFAULT_TIMEOUT_S = float(os.environ.get("RELAX_GDN_TEST_TIMEOUT_S", 900))
_STACK_DUMP_GRACE_S = 3.0


# what a launcher around pytest (torchrun, SLURM, HYDRA_FULL_ERROR for tracebacks) may have set
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                       "HYDRA_FULL_ERROR")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child command that starts its own run (``python train.py``,
    torchrun, a sweep): this process's, without a surrounding launcher's variables, with
    ``torch.compile`` off and one OpenMP thread (2-core machines), plus ``extra``."""
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    for key in _LAUNCHER_VARIABLES:
        env.pop(key, None)
    return {**env, **(extra or {})}


class OutputLines:
    """A child's output lines as they come (a reader thread), each wait bounded."""

    def __init__(self, stream):
        self.seen: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=lambda: [self._queue.put(line) for line in stream], daemon=True)
        self._reader.start()

    def all(self, timeout: float) -> str:
        """Every line, once the child has closed its output."""
        self._reader.join(timeout)
        assert not self._reader.is_alive(), f"the output did not end within {timeout} s"
        while not self._queue.empty():
            self.seen.append(self._queue.get())
        return "".join(self.seen)

    def wait_for(self, pattern: str, timeout: float) -> str:
        """The first line from here on that matches ``pattern``."""
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {timeout} s; output so far:\n"
                                     + "".join(self.seen[-60:])) from None
            self.seen.append(line)
            if re.search(pattern, line):
                return line


def value_error_message(fn: Callable[[], Any]) -> str | None:
    """``str`` of the ``ValueError`` that ``fn()`` raises, None if it returns: a picklable outcome
    for a check that runs inside a rank and is asserted in the parent."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, path)  # the parent never reads half a file


def _worker(
    rank: int, world_size: int, run_dir: str, backend: str, timeout_s: float, runtime: bool, fn: Callable, args: tuple
) -> None:
    run = Path(run_dir)
    # The parent sends SIGUSR1 when the run is past its limit: every thread's stack lands here.
    stacks = open(run / f"rank{rank}.stacks", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # as torchrun says: every rank on this host
    if os.environ.get("RELAX_GDN_HANG_DUMP_S"):  # debugging aid: every thread's stack, then exit
        faulthandler.dump_traceback_later(float(os.environ["RELAX_GDN_HANG_DUMP_S"]), exit=True)

    import contextlib

    import torch
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{run / 'store'}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        if runtime:
            from relax_gdn.runtime import Runtime

            setup = Runtime()
        else:
            setup = contextlib.nullcontext()
        with setup:
            result = fn(*args)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        _write_atomically(run / f"rank{rank}.error", traceback.format_exc().encode())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no teardown: the other ranks may be blocked in a collective with this one
    _write_atomically(run / f"rank{rank}.result", pickle.dumps(result))
    dist.destroy_process_group()


def _failures(run: Path, procs: list, exited: list[int]) -> list[str]:
    """One section per failed rank, the earliest traceback first: once a rank dies, its peers'
    collectives fail too ("connection closed"), and those later errors are only its echo."""
    raised = sorted(run.glob("rank*.error"), key=lambda p: p.stat().st_mtime_ns)
    sections = [f"--- rank {p.stem.removeprefix('rank')} raised ---\n{p.read_text()}" for p in raised]
    for rank in exited:
        code = procs[rank].exitcode
        produced = (run / f"rank{rank}.result").exists()
        if not (run / f"rank{rank}.error").exists() and (code != 0 or not produced):
            how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
            sections.append(f"--- rank {rank} {how} without a result ---")
    return sections


def _stacks_of_ranks_alive(run: Path, procs: list) -> str:
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    stacks = {r: run / f"rank{r}.stacks" for r in alive}
    for r in alive:
        os.kill(procs[r].pid, signal.SIGUSR1)
    deadline = time.monotonic() + _STACK_DUMP_GRACE_S
    while time.monotonic() < deadline and not all(p.exists() and p.stat().st_size for p in stacks.values()):
        time.sleep(0.1)  # polling for the files the signal handlers write, not timing anything
    return "\n".join(
        f"--- rank {r} stacks ---\n" + (p.read_text() if p.exists() else "(not started yet)\n")
        for r, p in stacks.items()
    )


def _join(run: Path, procs: list, timeout_s: float) -> str | None:
    """Wait for every rank; None when all succeeded, else the failure message (ranks still alive
    are left for the caller to kill)."""
    deadline = time.monotonic() + timeout_s
    running = {p.sentinel: r for r, p in enumerate(procs)}
    while running:
        ready = wait(list(running), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return (
                f"distributed run passed its {timeout_s:.0f} s limit "
                f"(RELAX_GDN_TEST_TIMEOUT_S); stacks of the ranks still running:\n"
                + _stacks_of_ranks_alive(run, procs)
            )
        exited = [running.pop(sentinel) for sentinel in ready]
        for rank in exited:
            procs[rank].join()
        if any(procs[r].exitcode != 0 or not (run / f"rank{r}.result").exists() for r in exited):
            others = sorted(running.values())
            killed = f"\n(ranks {others} were still running and are killed)" if others else ""
            return "distributed run failed:\n" + "\n".join(_failures(run, procs, exited)) + killed
    return None


def run_distributed(
    fn: Callable, world_size: int, *args: Any, backend: str = "gloo", timeout_s: float | None = None,
    runtime: bool = True,
) -> list[Any]:
    """Run ``fn(*args)`` on ranks ``0..world_size-1`` with the default process group initialised
    (gloo on CPU; ``backend="nccl"`` puts rank r on GPU r) and, unless ``runtime=False``, a
    Runtime installed; return each rank's result.

    Raises AssertionError with the failing rank's traceback as soon as one rank fails, or with
    every rank's stack when the run takes longer than ``timeout_s``."""
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="relax-gdn-ranks-") as run_dir:
        run = Path(run_dir)
        procs = [
            ctx.Process(target=_worker, args=(rank, world_size, run_dir, backend, timeout_s, runtime, fn, args))
            for rank in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            failure = _join(run, procs, timeout_s)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        if failure is not None:
            raise AssertionError(failure)
        results = []
        for rank in range(world_size):
            with open(run / f"rank{rank}.result", "rb") as f:
                results.append(pickle.load(f))
        return results
