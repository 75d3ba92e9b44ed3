"""GPU timing and host-sync counting shared by the benchmarks and the GPU tests."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def event_ms(fn) -> float:
    """One call of ``fn`` timed by CUDA events on the current stream (ms)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def cuda_median_ms(fn, iters: int = 10, warmup: int = 3, align_ranks: bool = True) -> float:
    """Median of ``iters`` timed calls (CUDA events; ranks aligned by a barrier before each call
    unless ``align_ranks=False``, for rank-local work that ranks may run a different number of
    times), after warm-up."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if align_ranks and dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        samples.append(event_ms(fn))
    return statistics.median(samples)


def cuda_pipelined_ms(fn, calls: int = 8, iters: int = 5, warmup: int = 2) -> float:
    """Per-call time of ``calls`` back-to-back calls (median of ``iters`` batches, ranks aligned
    before each batch): the steady state of a model whose layers are issued ahead of the GPU, where
    a call's host time hides behind the previous calls' GPU work, unlike ``cuda_median_ms``, which
    starts every call on an idle GPU."""

    def batch():
        for _ in range(calls):
            fn()

    return cuda_median_ms(batch, iters, warmup) / calls


def count_host_syncs(fn, where: dict | None = None) -> int:
    """Host<->device synchronisations during ``fn()``, as ``set_sync_debug_mode("warn")`` sees them;
    ``where`` (optional) receives ``{"file:line": count}``."""
    # imported here: relax_gdn.train imports Megatron-Core, which a benchmark refused on this
    # machine (relax_gdn.bench.needs) never gets to
    from relax_gdn.train.metrics import HostSyncCounter

    torch.cuda.synchronize()
    with HostSyncCounter(enabled=True) as counter:
        fn()
    if where is not None:
        where.update(counter.locations)
    return counter.count


def host_enqueue_ms(fn, iters: int = 5) -> float:
    """Host time to issue one call, the GPU idle at its start (median): when it is close to the
    call's GPU time, the call is host-bound."""
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)
