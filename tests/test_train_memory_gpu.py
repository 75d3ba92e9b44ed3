"""A finished run on one GPU hands its memory back to the process: what runs next in it (another run,
a test, a benchmark variant, a sweep's next job under Hydra's basic launcher) starts from what was
allocated before the run, with no Megatron-Core DDP left waiting for a garbage collection."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from tests.helpers import train_reduced_9b_on_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# what may stay allocated: cuBLAS workspaces of a first GEMM, kernels' small caches; a run's own
# buffers are GiBs (the reduced 9B's weights, fp32 gradients and Adam states)
LEFT_BEHIND_BOUND = 2**30


def _tracked_ddp_objects() -> int:
    """Megatron-Core DDP objects the collector tracks: reachable, or garbage not yet collected."""
    from megatron.core.distributed import DistributedDataParallel

    return sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())


def test_a_finished_run_leaves_no_gpu_memory_behind(runtime):
    gc.collect()
    torch.cuda.synchronize()
    allocated_before, ddp_before = torch.cuda.memory_allocated(), _tracked_ddp_objects()

    result = train_reduced_9b_on_gpu(runtime)

    assert math.isfinite(result.records[-1]["loss"])
    # no collection here: returning from the run must have freed its DDP and buffers already
    assert _tracked_ddp_objects() == ddp_before
    left = torch.cuda.memory_allocated() - allocated_before
    assert left < LEFT_BEHIND_BOUND, f"{left / 2**30:.2f} GiB still allocated after the run returned"
