"""Run a function in W real processes joined by a gloo process group, from a pytest test.

Two ways, with the same guarantees:

- ``RankPool`` (the session's pools, fixture ``gloo`` in tests/conftest.py): W ranks spawned and
  joined ONCE, then one job per call. Importing torch and Megatron-Core costs seconds per process
  on a 2-core machine; a pool pays that once per world size for the whole session, so each test
  case can be its own job (one failure fails one test).
- ``run_distributed``: W fresh processes for one call (a test about process start-up or the
  harness itself, or NCCL on the GPU host).

A run fails, never hangs:
- the ranks meet through a ``file://`` store in a fresh temporary directory (no port to race for);
- the first rank that raises (or dies) fails the run at once with that rank's traceback, and the
  other ranks are killed (they may be blocked in a collective the failed rank never joins); a
  pool is then started again for the next job;
- the whole run has a time limit (``timeout_s``, default ``RELAX_GDN_TEST_TIMEOUT_S`` or 900 s);
  past it every rank's Python stack is dumped into the failure message before the ranks are
  killed, and every collective has that limit too (``init_process_group(timeout=...)``).

Each job runs like an entry point's work: inside an installed :class:`relax_gdn.runtime.Runtime`
(CPU shims without CUDA, FLA's settings with it), closed after it, unless the test asks for a bare
process (``runtime=False``: pure-torch cases that need no Megatron-Core).
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import IO, Any

import torch.multiprocessing as mp

from relax_gdn.compat.cpu import DYNAMO_OFF_ENV

# Generous: the 4-rank model fixtures take minutes on a loaded 2-core machine. A hang costs this
# much once, instead of blocking the suite until someone kills it.
DEFAULT_TIMEOUT_S = float(os.environ.get("RELAX_GDN_TEST_TIMEOUT_S", 900))
_STACK_DUMP_GRACE_S = 3.0


# what a launcher around pytest (torchrun, SLURM, HYDRA_FULL_ERROR for tracebacks) may have set
_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "HYDRA_FULL_ERROR",
)


# What every CPU rank imports anyway, imported once per pytest process by the fork server the
# ranks start from (below) instead of once per rank.
_RANK_IMPORTS = ["torch", "megatron.core", "relax_gdn.train.loop", "tests.distributed"]


def _rank_processes(backend: str):
    """The multiprocessing context rank processes start from. CPU (gloo): forked from one server
    process that imported torch, Megatron-Core and the loop once, so a rank starts in a fraction of
    a second instead of importing them again (about 9 s of CPU per process on a 2-core machine,
    the larger part of the suite's time); the server itself imported nothing else and started no
    thread, and a forked rank still gets a fresh interpreter state for everything it does. NCCL:
    spawned, since CUDA must not be touched before a fork."""
    if backend != "gloo":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_IMPORTS)  # read when the server starts (the first rank)
    return ctx


def rank_process_context():
    """The context CPU ranks start from (:func:`_rank_processes`), for a test's process of its own
    that runs what a rank runs (the ``kill -9`` checkpoint runs, which kill their own process
    group): it starts with torch, Megatron-Core and the loop imported, as a rank does."""
    return _rank_processes("gloo")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child command that starts its own run (``python train.py``,
    torchrun, a sweep): this process's, without a surrounding launcher's variables, with
    ``torch.compile`` off and one OpenMP thread (2-core machines), plus ``extra``."""
    env = {**os.environ, **dict.fromkeys(DYNAMO_OFF_ENV, "1"), "OMP_NUM_THREADS": "1"}
    for key in _LAUNCHER_VARIABLES:
        env.pop(key, None)
    return {**env, **(extra or {})}


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


# The parent asks a rank for every thread's stack with this signal. Not SIGUSR1: the training loop
# takes that one over (preemption) and restores the default action afterwards, which kills.
_STACKS_SIGNAL = signal.SIGUSR2


def _join_group(rank: int, world_size: int, run: Path, backend: str, timeout_s: float) -> IO:
    """What a rank does first: dump its stacks on request into ``run/rank<r>.stacks``, look like a
    torchrun worker, join the default group through the ``file://`` store. Returns the stacks file."""
    stacks = open(run / f"rank{rank}.stacks", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(_STACKS_SIGNAL, file=stacks, all_threads=True)
    for name in DYNAMO_OFF_ENV:
        os.environ.setdefault(name, "1")
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # as torchrun says: every rank on this host
    # gloo groups connect their ranks at first use, not in new_group: on this 2-core machine under
    # load, new_group's eager connect failed now and then ("connectFullMesh failed ... Connection
    # closed by peer", the other ranks still running; cause not found), in whichever case made a
    # group. The collectives, and what the cases assert, are the same either way.
    if backend == "gloo":
        os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")

    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{run / 'store'}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return stacks


def _dump_stacks_and_exit_after_env_limit() -> None:
    if os.environ.get("RELAX_GDN_HANG_DUMP_S"):  # debugging aid: every thread's stack, then exit
        faulthandler.dump_traceback_later(float(os.environ["RELAX_GDN_HANG_DUMP_S"]), exit=True)


_job_runtime = None  # the Runtime of the job this rank runs (runtime=True), for job_runtime()


def job_runtime():
    """The installed :class:`relax_gdn.runtime.Runtime` of the job this rank runs, to hand to what
    needs one (``run_training(..., runtime=job_runtime())``), as an entry point hands its own."""
    if _job_runtime is None:
        raise RuntimeError("job_runtime(): this job runs without a Runtime (runtime=False) or outside a job")
    return _job_runtime


def _in_runtime(fn: Callable, args: tuple, runtime: bool) -> Any:
    """``fn(*args)`` inside an installed Runtime (closed after it), or bare."""
    global _job_runtime
    if not runtime:
        return fn(*args)
    from relax_gdn.runtime import Runtime

    with Runtime() as installed:
        _job_runtime = installed
        try:
            return fn(*args)
        finally:
            _job_runtime = None


def _worker(
    rank: int,
    world_size: int,
    run_dir: str,
    backend: str,
    timeout_s: float,
    runtime: bool,
    fn: Callable,
    args: tuple,
) -> None:
    run = Path(run_dir)
    _dump_stacks_and_exit_after_env_limit()
    try:
        _join_group(rank, world_size, run, backend, timeout_s)
        result = _in_runtime(fn, args, runtime)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        _write_atomically(run / f"rank{rank}.error", traceback.format_exc().encode())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no teardown: the other ranks may be blocked in a collective with this one
    _write_atomically(run / f"rank{rank}.result", pickle.dumps(result))
    import torch.distributed as dist

    dist.destroy_process_group()


def _how_it_ended(proc) -> str:
    code = proc.exitcode
    if code is None:
        return "closed its pipe"
    return f"was killed by signal {-code}" if code < 0 else f"exited with {code}"


def _failures(run: Path, procs: list, exited: list[int]) -> list[str]:
    """One section per failed rank, the earliest traceback first: once a rank dies, its peers'
    collectives fail too ("connection closed"), and those later errors are only its echo."""
    raised = sorted(run.glob("rank*.error"), key=lambda p: p.stat().st_mtime_ns)
    sections = [f"--- rank {p.stem.removeprefix('rank')} raised ---\n{p.read_text()}" for p in raised]
    for rank in exited:
        code = procs[rank].exitcode
        produced = (run / f"rank{rank}.result").exists()
        if not (run / f"rank{rank}.error").exists() and (code != 0 or not produced):
            sections.append(f"--- rank {rank} {_how_it_ended(procs[rank])} without a result ---")
    return sections


def _stacks_of(run: Path, procs: list, ranks: list[int]) -> str:
    """Every thread's stack of each of ``ranks`` still alive, from what it writes on the signal."""
    alive = [r for r in ranks if procs[r].is_alive()]
    files = {r: run / f"rank{r}.stacks" for r in alive}
    before = {r: p.stat().st_size if p.exists() else 0 for r, p in files.items()}
    for r in alive:
        os.kill(procs[r].pid, _STACKS_SIGNAL)
    deadline = time.monotonic() + _STACK_DUMP_GRACE_S
    while time.monotonic() < deadline and not all(
        p.exists() and p.stat().st_size > before[r] for r, p in files.items()
    ):
        time.sleep(0.1)  # polling for the files the signal handlers write, not timing anything

    def text(r: int) -> str:
        if not files[r].exists():
            return "(not started yet)\n"
        with open(files[r]) as f:
            f.seek(before[r])
            return f.read() or "(no stack written)\n"

    return "\n".join(f"--- rank {r} stacks ---\n" + text(r) for r in alive)


def _past_limit(timeout_s: float, stacks: str) -> str:
    return (
        f"distributed run passed its {timeout_s:.0f} s limit (RELAX_GDN_TEST_TIMEOUT_S); "
        f"stacks of the ranks still running:\n{stacks}"
    )


def _join(run: Path, procs: list, timeout_s: float) -> str | None:
    """Wait for every rank; None when all succeeded, else the failure message (ranks still alive
    are left for the caller to kill)."""
    deadline = time.monotonic() + timeout_s
    running = {p.sentinel: r for r, p in enumerate(procs)}
    while running:
        ready = wait(list(running), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return _past_limit(timeout_s, _stacks_of(run, procs, sorted(running.values())))
        exited = [running.pop(sentinel) for sentinel in ready]
        for rank in exited:
            procs[rank].join()
        if any(procs[r].exitcode != 0 or not (run / f"rank{r}.result").exists() for r in exited):
            others = sorted(running.values())
            killed = f"\n(ranks {others} were still running and are killed)" if others else ""
            return "distributed run failed:\n" + "\n".join(_failures(run, procs, exited)) + killed
    return None


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float | None = None,
    runtime: bool = True,
) -> list[Any]:
    """Run ``fn(*args)`` on ranks ``0..world_size-1`` of fresh processes with the default process
    group initialised (gloo on CPU; ``backend="nccl"`` puts rank r on GPU r) and, unless
    ``runtime=False``, a Runtime installed; return each rank's result. On CPU a test uses the
    session's pool instead (fixture ``gloo``): no start-up per call.

    Raises AssertionError with the failing rank's traceback as soon as one rank fails, or with
    every rank's stack when the run takes longer than ``timeout_s``."""
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    ctx = _rank_processes(backend)
    with tempfile.TemporaryDirectory(prefix="relax-gdn-ranks-") as run_dir:
        run = Path(run_dir)
        procs = [
            ctx.Process(
                target=_worker, args=(rank, world_size, run_dir, backend, timeout_s, runtime, fn, args)
            )
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


# ---------------------------------------------------------------------------------------------
# the pool: ranks started once, one job per call
# ---------------------------------------------------------------------------------------------


class JobResults(Mapping):
    """One rank's view of several pool jobs, read like the dict one big job would return:
    ``self[key]`` runs the job that makes ``key`` (once: ``run`` is the ``gloo_once`` fixture) and
    gives this rank's value of it, so a test fails only with the jobs it reads. ``jobs``: key ->
    ``(fn, world_size, *args)``; ``fn`` returns a dict holding its keys."""

    def __init__(self, run: Callable, jobs: dict[str, tuple], rank: int = 0):
        self._run, self._jobs, self._rank = run, jobs, rank

    def __getitem__(self, key: str) -> Any:
        fn, world_size, *args = self._jobs[key]
        return self._run(fn, world_size, *args)[self._rank][key]

    def __iter__(self):
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)


_computed: dict[Any, Any] = {}


def computed_once(key: Any, make: Callable[[], Any]) -> Any:
    """In a pool's rank: ``make()`` for the first job that asks for ``key``, the same object for
    every later job of this rank (a reference several test cases compare with). Every rank of a pool
    runs the same jobs, so all of them make it in the same job (``make`` may use collectives). It
    must not keep a process group: those a job makes are destroyed after it."""
    if key not in _computed:
        _computed[key] = make()
    return _computed[key]


def _left_behind(groups_before: set) -> str | None:
    """What a job must not leave to the next one; the groups it made are destroyed here."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return "the job destroyed the default process group (the pool's ranks share it between jobs)"
    for group in set(distributed_c10d._world.pg_map) - groups_before:
        dist.destroy_process_group(group)  # local: gloo closes its connections, no collective
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        return (
            "the job left Megatron-Core's model-parallel state initialised: call "
            "parallel_state.destroy_model_parallel() in a `finally`"
        )
    return None


def _run_job(message: bytes, initial_seed: int) -> tuple[str, Any]:
    """``("ok", (result, groups made))`` or ``("error", traceback)`` of one job, which starts from the
    random state its rank started with (whatever ran before); environment and directory are restored
    after it."""
    import torch
    from torch.distributed import distributed_c10d

    groups_before, environ, cwd = set(distributed_c10d._world.pg_map), dict(os.environ), os.getcwd()
    torch.manual_seed(initial_seed)
    torch.set_num_threads(1)  # W ranks share a few cores; the tests' tensors are small
    try:
        fn, args, runtime = pickle.loads(message)
        # torch names a new group by a per-process count: the parent checks every rank made as many
        first_name = distributed_c10d._world.group_count
        result = _in_runtime(fn, args, runtime)
        problem = _left_behind(groups_before)
        if problem is not None:
            raise RuntimeError(problem)
        return "ok", (result, distributed_c10d._world.group_count - first_name)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        return "error", traceback.format_exc()
    finally:
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)


def _pool_worker(rank: int, world_size: int, run_dir: str, backend: str, timeout_s: float, conn) -> None:
    run = Path(run_dir)
    log = open(run / f"rank{rank}.log", "w")  # noqa: SIM115 - the rank's stdout and stderr, relayed per job
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        stacks = _join_group(rank, world_size, run, backend, timeout_s)
    except BaseException:  # noqa: BLE001 - the first job's reply says why the rank could not start
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        os._exit(1)
    import torch

    initial_seed = torch.initial_seed()
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:  # the parent is gone
            break
        if not message:  # the parent closes the pool
            break
        faulthandler.register(_STACKS_SIGNAL, file=stacks, all_threads=True)  # in case a job replaced it
        _dump_stacks_and_exit_after_env_limit()
        status, value = _run_job(message, initial_seed)
        faulthandler.cancel_dump_traceback_later()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            reply = pickle.dumps((status, value))
        except Exception:  # noqa: BLE001 - an unpicklable result fails the job, not the rank
            reply = pickle.dumps(("error", "the result cannot be pickled:\n" + traceback.format_exc()))
        conn.send_bytes(reply)
    import torch.distributed as dist

    dist.destroy_process_group()


class RankPool:
    """W ranks joined by one default group (gloo on CPU), started at the first job and kept: each
    ``run(fn, *args)`` runs ``fn(*args)`` on every rank and returns each rank's result.

    Each job runs inside a Runtime (unless ``runtime=False``) from the random state its rank started
    with. It may make process groups (every rank the same ones, in the same order): they are
    destroyed after it. It must leave Megatron-Core's model-parallel state as it found it (a job
    that does not fails) and keep the default group; ``os.environ`` and the working directory are
    restored. A job that fails (a rank raises, dies or passes its limit) takes the ranks with it:
    the next job starts a fresh pool. What the ranks print is relayed to the caller's stdout after
    the job.
    """

    def __init__(self, world_size: int, backend: str = "gloo"):
        self.world_size, self.backend = world_size, backend
        self._procs: list = []
        self._conns: list = []
        self._run_dir: tempfile.TemporaryDirectory | None = None
        self._log_offsets: list[int] = []
        self._closes_at_exit = False

    def _start(self) -> None:
        if not self._closes_at_exit:  # before multiprocessing's own exit handler joins the ranks
            atexit.register(self.close)
            self._closes_at_exit = True
        ctx = _rank_processes(self.backend)
        self._run_dir = tempfile.TemporaryDirectory(prefix="relax-gdn-pool-")
        self._log_offsets = [0] * self.world_size
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            # not daemonic: a rank starts children of its own (Megatron-Core's checkpoint writer)
            proc = ctx.Process(
                target=_pool_worker,
                args=(rank, self.world_size, self._run_dir.name, self.backend, DEFAULT_TIMEOUT_S, child),
            )
            proc.start()
            child.close()  # the parent's copy: a rank that dies then reads as end of file
            self._procs.append(proc)
            self._conns.append(parent)

    def run(
        self, fn: Callable, *args: Any, timeout_s: float | None = None, runtime: bool = True
    ) -> list[Any]:
        """Like ``run_distributed(fn, world_size, *args)`` on this pool's ranks."""
        timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        message = pickle.dumps((fn, args, runtime))  # an unpicklable job fails here, before any rank sees it
        if not self._procs:
            try:
                self._start()
            except BaseException:
                self.close()
                raise
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:  # a rank already gone: _collect reports how it ended
                pass
        try:
            failure, results = self._collect(time.monotonic() + timeout_s, timeout_s)
        except BaseException:
            self.close()
            raise
        finally:
            self._relay_output()
        # ranks whose counts drift apart would name their next groups differently; the failure
        # closes the pool, so the next job starts on fresh ranks
        if failure is None and len({made for _, made in results}) > 1:
            failure = (
                "the job's ranks made different numbers of process groups "
                f"({[made for _, made in results]} by rank): every rank must make every group, in "
                "the same order (torch names groups by that count)"
            )
        if failure is not None:
            self.close()
            raise AssertionError(failure)
        return [result for result, _ in results]

    def _collect(self, deadline: float, timeout_s: float) -> tuple[str | None, list[Any]]:
        results: list[Any] = [None] * self.world_size
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sections: list[str] = []
        while waiting and not sections:
            sentinels = {self._procs[r].sentinel: r for r in waiting.values()}
            ready = wait([*waiting, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                run = Path(self._run_dir.name)
                return _past_limit(timeout_s, _stacks_of(run, self._procs, sorted(waiting.values()))), results
            for conn in [c for c in ready if c in waiting]:  # replies first: a rank may reply, then exit
                rank = waiting.pop(conn)
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    self._procs[rank].join(_STACK_DUMP_GRACE_S)
                    sections.append(
                        f"--- rank {rank} {_how_it_ended(self._procs[rank])} without a result ---"
                    )
                    continue
                if status == "ok":
                    results[rank] = value
                else:
                    sections.append(f"--- rank {rank} raised ---\n{value}")
            for rank in [sentinels[s] for s in ready if s in sentinels]:
                conn = self._conns[rank]
                if conn in waiting and not conn.poll():
                    del waiting[conn]
                    self._procs[rank].join()
                    sections.append(
                        f"--- rank {rank} {_how_it_ended(self._procs[rank])} without a result ---"
                    )
        if not sections:
            return None, results
        others = sorted(waiting.values())
        killed = f"\n(ranks {others} were still running and are killed)" if others else ""
        return "distributed run failed:\n" + "\n".join(sections) + killed, results

    def _relay_output(self) -> None:
        if self._run_dir is None:
            return
        for rank in range(self.world_size):
            path = Path(self._run_dir.name) / f"rank{rank}.log"
            if not path.exists():
                continue
            with open(path, errors="replace") as f:
                f.seek(self._log_offsets[rank])
                text = f.read()
                self._log_offsets[rank] = f.tell()
            for line in text.splitlines():
                print(f"[rank {rank}] {line}")

    def close(self) -> None:
        """Stop the ranks (asked first, killed if they do not go) and remove their directory."""
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + _STACK_DUMP_GRACE_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._run_dir is not None:
            self._run_dir.cleanup()
            self._run_dir = None


class RankPools:
    """One ``RankPool`` per world size, started when first asked for (the session's, in
    tests/conftest.py)."""

    def __init__(self, backend: str = "gloo"):
        self.backend = backend
        self._pools: dict[int, RankPool] = {}

    def run(
        self, fn: Callable, world_size: int, *args: Any, timeout_s: float | None = None, runtime: bool = True
    ) -> list[Any]:
        """``fn(*args)`` on every rank of the pool of ``world_size`` (inside a Runtime unless
        ``runtime=False``); each rank's result."""
        pool = self._pools.setdefault(world_size, RankPool(world_size, self.backend))
        return pool.run(fn, *args, timeout_s=timeout_s, runtime=runtime)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
