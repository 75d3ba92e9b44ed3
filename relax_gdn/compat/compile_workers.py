"""Inductor's compile workers, stopped without torch's 300 s wait.

``torch.compile`` (the FP8 casts, the HF peer's float8 blocks) starts a sidecar process that owns
Inductor's compile-worker pool (``torch._inductor.compile_worker.subproc_pool.SubprocPool``), and
torch's exit hook ``shutdown_compile_workers`` asks it to stop and waits up to 300 s for it. A
sidecar can wedge tearing down its own pool (pytorch/pytorch#176968 and #186136; after the 300 s
torch 2.11 raises out of its exit hook, torch 2.14 kills the sidecar): one ``bench.peers`` process
on an H100 sat in that wait, its results written, until its device call's 540 s limit ended it.
:func:`stop_compile_workers` asks each sidecar to stop the same way, and kills the one still alive
after ``grace_s``; torch's own hook then finds nothing running.
"""

from __future__ import annotations

import sys
import threading

GRACE_S = 10.0


def stop_compile_workers(grace_s: float = GRACE_S) -> int:
    """Stop every compile-worker sidecar this process started; returns how many had to be killed."""
    module = sys.modules.get("torch._inductor.async_compile")
    if module is None:  # nothing was compiled here: no sidecar
        return 0
    killed = 0
    for pool in list(getattr(module, "_pool_set", ())):
        process = getattr(pool, "process", None)  # a SubprocPool; other pools' shutdown does not wait
        stopper = threading.Thread(target=pool.shutdown, name="stop-compile-workers", daemon=True)
        stopper.start()
        stopper.join(grace_s)
        if stopper.is_alive() and process is not None and process.poll() is None:
            process.kill()  # the wedged sidecar; shutdown's wait then returns
            killed += 1
            stopper.join(grace_s)
    # torch's own teardown, now without a wait: forgets the stopped pools, so that a later
    # torch.compile in this process starts a new one
    module.shutdown_compile_workers()
    return killed
