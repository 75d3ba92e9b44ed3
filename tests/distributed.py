"""Run a function in W real processes joined by a gloo process group, from a pytest test.

Importing torch and Megatron-Core costs seconds per process on a 2-core machine, so a test
should spawn ONE group per world size and run many cases inside ``fn``, returning results
(picklable) that the parent asserts on. Exceptions in any rank are re-raised in the parent with
the rank's traceback.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def value_error_message(fn: Callable[[], Any]) -> str | None:
    """``str`` of the ``ValueError`` that ``fn()`` raises, None if it returns: a picklable outcome
    for a check that runs inside a rank and is asserted in the parent."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, results: Any
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # as torchrun says: every rank on this host
    if os.environ.get("RELAX_GDN_HANG_DUMP_S"):  # debugging aid: every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["RELAX_GDN_HANG_DUMP_S"]), exit=True)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        results[rank] = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """Run ``fn(*args)`` on ranks ``0..world_size-1`` with the default process group initialised
    (gloo on CPU; ``backend="nccl"`` puts rank r on GPU r); return each rank's result."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _worker,
            args=(world_size, _free_port(), backend, fn, args, results),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        outcome = [results.get(rank, ("error", "rank produced no result")) for rank in range(world_size)]
    errors = [f"--- rank {r} ---\n{payload}" for r, (status, payload) in enumerate(outcome) if status != "ok"]
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [payload for _, payload in outcome]
