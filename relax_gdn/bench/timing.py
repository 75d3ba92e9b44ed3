"""GPU timing and host-sync counting shared by the benchmarks and the GPU tests."""

from __future__ import annotations

import statistics
import warnings

import torch
import torch.distributed as dist


def cuda_median_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    """Median of ``iters`` timed calls (CUDA events, ranks aligned by a barrier), after warm-up."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def count_host_syncs(fn) -> int:
    """Host<->device synchronisations during ``fn()``, as ``set_sync_debug_mode("warn")`` sees them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)
