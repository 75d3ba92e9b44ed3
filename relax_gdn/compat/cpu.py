"""What Megatron-Core 0.19.2 needs to run on a machine without a GPU — all in one place.

Applied explicitly with ``apply_cpu_shims()`` (tests and the CPU demo do; GPU runs never do).
Each shim asserts that what it patches exists, so a Megatron-Core upgrade that moves a symbol
fails loudly here instead of silently running unpatched.
"""

from __future__ import annotations

import os

import torch

_applied = False


def apply_cpu_shims() -> None:
    """Make Megatron-Core's GPU-only assumptions hold on CPU. Idempotent."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_shims() is for machines without CUDA; it would hide the GPU")

    # Parameters are created on torch.cuda.current_device() (GDN ctor, reset_parameters, RoPE).
    assert hasattr(torch.cuda, "current_device")
    torch.cuda.current_device = lambda: "cpu"

    # reset_parameters forks the CUDA RNG tracker; the inference tracker's fork is a no-op
    # (dropout is 0 in every CPU test, so TP/CP-decorrelated RNG streams are not needed).
    from megatron.core.tensor_parallel import random as mcore_random

    assert hasattr(mcore_random, "initialize_rng_tracker")
    mcore_random.initialize_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=True, force_reset=True)

    # Full recompute (activation checkpointing) saves and restores the CUDA RNG state around the
    # recomputed forward; there is none without a GPU, and no dropout runs in CPU jobs.
    assert hasattr(mcore_random, "_get_cuda_rng_state") and hasattr(mcore_random, "_set_cuda_rng_state")
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: None
    mcore_random._set_cuda_rng_state = lambda *args, **kwargs: None

    # Distributed checkpointing (torch_dist) stages tensors with ``preload_tensors(buckets,
    # non_blocking=True)``, which ends in torch.cuda.synchronize(); CPU tensors need no staging
    # wait, so stage them blocking (the same copies, no synchronize).
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    assert isinstance(FileSystemWriterAsync.__dict__.get("preload_tensors"), staticmethod)
    preload_tensors = FileSystemWriterAsync.preload_tensors
    FileSystemWriterAsync.preload_tensors = staticmethod(
        lambda write_buckets, non_blocking=True: preload_tensors(write_buckets, False))

    # jit_fuser = torch.compile: ~20 s of Inductor + gcc per process on 2 cores for no benefit.
    from torch import _dynamo

    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    _dynamo.config.disable = True
    _applied = True
