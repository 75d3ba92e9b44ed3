"""A run's process groups and seeds, made first in the Trainer's setup (a collective)."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from relax_gdn.config import ParallelDims, RunConfig
from relax_gdn.parallel import ParallelContext, init_distributed


def start_process_groups(
    cfg: RunConfig, dims: ParallelDims, device: torch.device, runtime
) -> tuple[ParallelContext, bool]:
    """The default group (torchrun's, or a one-process one made here: then the second value is
    True), the run's TP / CP / DP groups (and dynamic CP's sub-groups), torch's deterministic
    algorithms with ``train.deterministic`` (through ``runtime``, which puts torch's setting back)
    and the seeds every rank starts from."""
    timeout_s = cfg.train.collective_timeout_s
    if device.type == "cuda":
        torch.cuda.set_device(device)
    created = init_distributed(device, timeout_s=timeout_s)
    if cfg.train.deterministic:
        runtime.use_deterministic_algorithms(warn_only=True)
    seed_everything(cfg.train.seed)
    parallel = ParallelContext.initialize(
        tp=dims.tp,
        cp=dims.cp,
        dynamic_max_cp=cfg.effective_max_cp if cfg.parallel.dynamic_cp.enabled else None,
        timeout=timedelta(seconds=timeout_s),
    )
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(cfg.train.seed)
    return parallel, created


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def broadcast_run_dir(run_dir: Path | None) -> Path | None:
    """Rank 0's run directory on every rank (Hydra names it from the clock on every rank)."""
    box = [str(run_dir) if run_dir is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] is not None else None
