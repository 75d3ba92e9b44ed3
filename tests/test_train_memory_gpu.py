"""A finished run on one GPU hands its memory back to the process: what runs next in it (another run,
a test, a benchmark variant, the export) starts from what was allocated before the run, with no
Megatron-Core DDP left waiting for a garbage collection that may come late."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from relax_gdn.config import RunConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TINY_ON_GPU = {
    "train.device": "cuda",
    "train.precision": "bf16",
    "train.steps": 2,
    "logging.console": False,
    "logging.jsonl": False,
}


def _live_ddp_objects() -> int:
    """Megatron-Core DDP objects the collector tracks, reachable or garbage not yet collected."""
    from megatron.core.distributed import DistributedDataParallel

    return sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())


def test_a_finished_run_leaves_no_gpu_memory_behind(runtime):
    from relax_gdn.train import run_training

    gc.collect()
    torch.cuda.synchronize()
    allocated_before, ddp_before = torch.cuda.memory_allocated(), _live_ddp_objects()

    result = run_training(RunConfig().with_overrides(TINY_ON_GPU), None, runtime=runtime)

    assert math.isfinite(result.records[-1]["loss"])
    # no collection here: the run's return must have freed its DDP and buffers already
    assert _live_ddp_objects() == ddp_before
    left = torch.cuda.memory_allocated() - allocated_before
    assert left <= 16 * 2**20, f"{left / 2**20:.1f} MiB still allocated after the run returned"
