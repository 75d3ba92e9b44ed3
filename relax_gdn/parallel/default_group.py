"""The default process group: joining the launcher's (torchrun) or making a one-process one, and
what the launcher says about this process before any group exists."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(device: torch.device, timeout_s: float | None = None) -> bool:
    """Join torchrun's group (env://), or make a one-process group; True when created here.
    ``timeout_s``: the group's collective timeout (``train.collective_timeout_s``; None: torch's)."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://", **timeout)
    else:
        # An in-process store: one rank has nobody to meet, so no port to pick (and race for).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **timeout)
    return True


def launcher_rank() -> int:
    """This process's global rank: the default group's, or before it exists the launcher's
    (torchrun's ``RANK``; 0 without a launcher)."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def launcher_world_size() -> int:
    """The world size: the default group's, or before it exists the launcher's (``WORLD_SIZE``; 1
    without a launcher): what ``validate`` checks a config against before anything is built."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))
