"""What Megatron-Core 0.19.2 needs to run on a machine without a GPU — all in one place.

Applied by :class:`relax_gdn.runtime.Runtime` (the entry points install one; tests install one
per process or per test), never by library code. Each shim asserts that what it patches exists,
so a Megatron-Core upgrade that moves a symbol fails loudly here instead of silently running
unpatched, and each one is undone by the function :func:`apply_cpu_shims` returns.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

_applied = False  # one owner (the Runtime): shims applied twice would be undone out of order
# torch reads TORCH_COMPILE_DISABLE when torch._dynamo.config imports, TORCHDYNAMO_DISABLE at each
# torch.compile call
DYNAMO_OFF_ENV = ("TORCH_COMPILE_DISABLE", "TORCHDYNAMO_DISABLE")


def apply_cpu_shims() -> Callable[[], None]:
    """Make Megatron-Core's GPU-only assumptions hold on CPU; returns the function that puts back
    everything it changed. Refused where CUDA is available (it would hide the GPU) or when the
    shims are already in place (one owner: the Runtime)."""
    global _applied
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_shims() is for machines without CUDA; it would hide the GPU")
    if _applied:
        raise RuntimeError(
            "the CPU shims are already applied in this process (relax_gdn.runtime.Runtime owns them)"
        )
    # dynamo first: the other shims import Megatron-Core, whose import decorates its fused functions
    undo = [
        _no_dynamo(),
        _current_device_is_cpu(),
        _inference_rng_tracker(),
        _no_cuda_rng_state(),
        _blocking_staging(),
    ]
    _applied = True

    def restore() -> None:
        global _applied
        for step in reversed(undo):
            step()
        _applied = False

    return restore


def _current_device_is_cpu() -> Callable[[], None]:
    # Parameters are created on torch.cuda.current_device() (GDN ctor, reset_parameters, RoPE).
    assert hasattr(torch.cuda, "current_device")
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"

    def undo() -> None:
        torch.cuda.current_device = original

    return undo


def _inference_rng_tracker() -> Callable[[], None]:
    # reset_parameters forks the CUDA RNG tracker; the inference tracker's fork is a no-op
    # (dropout is 0 in every CPU job, so TP/CP-decorrelated RNG streams are not needed).
    from megatron.core.tensor_parallel import random as mcore_random

    assert hasattr(mcore_random, "initialize_rng_tracker")
    assert hasattr(mcore_random, "_CUDA_RNG_STATE_TRACKER")
    before = (mcore_random._CUDA_RNG_STATE_TRACKER, mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    mcore_random.initialize_rng_tracker(
        use_te_rng_tracker=False, inference_rng_tracker=True, force_reset=True
    )

    def undo() -> None:
        mcore_random._CUDA_RNG_STATE_TRACKER, mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = before

    return undo


def _no_cuda_rng_state() -> Callable[[], None]:
    # Full recompute (activation checkpointing) saves and restores the CUDA RNG state around the
    # recomputed forward; there is none without a GPU, and no dropout runs in CPU jobs.
    from megatron.core.tensor_parallel import random as mcore_random

    assert hasattr(mcore_random, "_get_cuda_rng_state") and hasattr(mcore_random, "_set_cuda_rng_state")
    originals = (mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state)
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: None
    mcore_random._set_cuda_rng_state = lambda *args, **kwargs: None

    def undo() -> None:
        mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state = originals

    return undo


def _blocking_staging() -> Callable[[], None]:
    # Distributed checkpointing (torch_dist) stages tensors with ``preload_tensors(buckets,
    # non_blocking=True)``, which ends in torch.cuda.synchronize(); CPU tensors need no staging
    # wait, so stage them blocking (the same copies, no synchronize).
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.__dict__.get("preload_tensors")
    assert isinstance(original, staticmethod)
    preload_tensors = FileSystemWriterAsync.preload_tensors
    FileSystemWriterAsync.preload_tensors = staticmethod(
        lambda write_buckets, non_blocking=True: preload_tensors(write_buckets, False)
    )

    def undo() -> None:
        FileSystemWriterAsync.preload_tensors = original

    return undo


def _no_dynamo() -> Callable[[], None]:
    # Megatron-Core's jit_fuser is torch.compile: Inductor + a C compiler per process on CPU, for
    # kernels that gain nothing there. TORCHDYNAMO_DISABLE makes torch.compile return the function
    # itself, so the fused functions Megatron-Core decorates when it is imported after this stay
    # plain Python, and its import skips Inductor's set-up.
    # config.disable covers what was compiled before: those run eagerly.
    from torch import _dynamo

    env_before = {name: os.environ.get(name) for name in DYNAMO_OFF_ENV}
    config_before = _dynamo.config.disable
    for name in DYNAMO_OFF_ENV:
        os.environ.setdefault(name, "1")
    _dynamo.config.disable = True

    def undo() -> None:
        _dynamo.config.disable = config_before
        for name, value in env_before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    return undo
