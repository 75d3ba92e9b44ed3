"""The per-rank kernels of packed causal attention (:mod:`relax_gdn.model.attention`): one function
per backend, what each needs, and the ``auto`` choice.

Every kernel takes this rank's queries ``[T/W, Hq, D]`` (local zigzag order), every rank's keys and
values rank-major ``[T, Hkv, D]`` and the micro-batch's
:class:`~relax_gdn.model.attention.ZigzagAttentionPlan`; each query sees the keys of its own
document up to its own global position. The backends (:data:`relax_gdn.choices.ATTENTION_BACKENDS`):

``sdpa``   dense masked ``scaled_dot_product_attention`` over all gathered keys: the reference,
           any device and dtype, O(T/W x T) memory.
``varlen`` torch's FlashAttention-2 (``torch.nn.attention.varlen.varlen_attn``), one segment per
           (document, local chunk) with the causal mask aligned bottom-right: CUDA, fp16/bf16.
``flex``   FlexAttention (``torch.nn.attention.flex_attention``) with a block mask built on the
           host from the plan's positions: compiled with Triton on CUDA; on CPU the unfused eager
           path, forward only (torch has no FlexAttention backward on CPU; the CPU tests check its
           outputs and block mask, the GPU tests its gradients).
``fa4``    FlashAttention-4 (the ``flash-attn-4`` package's CuTe DSL kernels,
           ``flash_attn.cute.flash_attn_varlen_func``; ``pip install '.[fa4]'``): the ``varlen``
           segments, native GQA; SM 9.x-11.x, fp16/bf16, head dim <= 256.

``auto`` runs, on CUDA, :data:`AUTO_ATTENTION_BACKEND` where it can run (for ``fa4``: the package
imports, the GPU is SM 9.x-11.x, the tensors fp16/bf16 with head dim <= 256), else ``varlen`` where
it can; ``sdpa`` otherwise.

cuDNN's fused attention on ragged offsets is not offered: at head dim 256 on an H200 its first
fwd+bwd left the CUDA context with an illegal memory access (docs/benchmarks.md, "Attention
kernels at the 9B's shapes").
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from relax_gdn.choices import ATTENTION_BACKENDS

try:  # torch >= 2.9; its signature differs between versions: see varlen_unsupported_reason
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    varlen_attn = None


@dataclass(frozen=True)
class DenseIndex:
    """What the dense (``sdpa``) kernel masks with: key ``j`` is visible to query ``i`` iff
    ``q_start[i] <= k_pos[j] <= q_pos[i]`` (same document, not in the future)."""

    q_pos: torch.Tensor  # [T/W] global position of each local query
    q_start: torch.Tensor  # [T/W] global start of its document
    k_pos: torch.Tensor  # [T] global position of each gathered (rank-major) key


@dataclass(frozen=True)
class VarlenSegments:
    """What the ``varlen`` kernel runs: segment ``s`` has queries ``cu_q[s]:cu_q[s+1]`` (local
    rows) and keys ``cu_k[s]:cu_k[s+1]`` of ``gathered.index_select(0, key_rows)``."""

    cu_q: torch.Tensor  # int32 [S+1]
    cu_k: torch.Tensor  # int32 [S+1]
    key_rows: torch.Tensor | None  # None: the (un-gathered, W = 1) keys are the segments as they are
    max_q: int
    max_k: int


class AttentionPlan(Protocol):
    """What a kernel reads of one micro-batch's plan (built, cached and uploaded by
    :class:`relax_gdn.model.attention.ZigzagAttentionPlan`)."""

    @property
    def dense(self) -> DenseIndex: ...

    @property
    def varlen(self) -> VarlenSegments: ...

    @property
    def flex_block_mask(self): ...


# What ``auto`` runs where it can (CUDA, its dtype and head-dim rules), chosen by measurement: the
# fastest exact kernel at the 9B's shapes (``python -m relax_gdn.bench.attention``,
# docs/benchmarks.md); ``varlen`` elsewhere.
AUTO_ATTENTION_BACKEND = "fa4"

HALF_DTYPES = (torch.float16, torch.bfloat16)
FLEX_BLOCK = 128  # the block mask's tile (FlexAttention's default sparse block size)
FA4_SM_MAJORS = (9, 10, 11)  # the GPU generations FlashAttention-4's CuTe DSL kernels are built for


# ---------------------------------------------------------------------------------------------
# What each backend needs
# ---------------------------------------------------------------------------------------------


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(varlen_attn).parameters)


def _half_on_cuda(query: torch.Tensor) -> str | None:
    if query.device.type != "cuda":
        return f"it needs CUDA tensors, got {query.device}"
    if query.dtype not in HALF_DTYPES:
        return f"it needs float16 or bfloat16, got {query.dtype}"
    head_dim = query.shape[-1]
    if head_dim > 256 or head_dim % 8:
        return f"it needs head_dim <= 256 and a multiple of 8, got {head_dim}"
    return None


def varlen_unsupported_reason(query: torch.Tensor) -> str | None:
    """Why the ``varlen`` kernel cannot run on ``query`` (None when it can)."""
    if varlen_attn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    if (reason := _half_on_cuda(query)) is not None:
        return reason.replace("it needs float16", "flash attention needs float16")
    params = _varlen_parameters()
    if "window_size" not in params and "is_causal" not in params:
        return "this torch's varlen_attn takes neither is_causal nor window_size"
    return None


@functools.cache
def _flex_attention_import_error() -> str | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention ({e})"
    return None


def flex_unsupported_reason(query: torch.Tensor) -> str | None:
    if (reason := _flex_attention_import_error()) is not None:
        return reason
    if query.device.type == "cpu" and query.requires_grad and torch.is_grad_enabled():
        return "FlexAttention has no backward on CPU (forward only there; train with it on CUDA)"
    if query.device.type not in ("cuda", "cpu"):
        return f"it runs on CUDA (compiled) or CPU (eager, forward only), got {query.device}"
    return None


@functools.cache
def fa4_import_error() -> str | None:
    """Why FlashAttention-4's varlen kernel does not import here (None when it does); asked once,
    and only where it could run (its CUTLASS DSL takes seconds to load)."""
    install = "pip install '.[fa4]' (flash-attn-4 and nvidia-cutlass-dsl, pinned in pyproject.toml)"
    try:
        if importlib.util.find_spec("flash_attn") is None:
            return f"flash-attn-4 is not installed: {install}"
        _fa4_varlen()
    except (ImportError, OSError) as e:  # a missing module or a shared library of the CUTLASS DSL
        return f"flash-attn-4 does not import ({type(e).__name__}: {e}): {install}"
    return None


def fa4_unsupported_reason(query: torch.Tensor) -> str | None:
    if (reason := _half_on_cuda(query)) is not None:
        return reason
    major = torch.cuda.get_device_capability(query.device)[0]
    if major not in FA4_SM_MAJORS:
        return f"its kernels are for SM 9.x-11.x (head dim {query.shape[-1]}), this GPU is SM {major}.x"
    return fa4_import_error()


def unsupported_reason(backend: str, query: torch.Tensor) -> str | None:
    """Why ``backend`` cannot run on ``query`` (None when it can)."""
    if backend == "sdpa":
        return None
    if backend == "varlen":
        return varlen_unsupported_reason(query)
    if backend == "flex":
        return flex_unsupported_reason(query)
    if backend == "fa4":
        return fa4_unsupported_reason(query)
    raise ValueError(f"unknown attention backend {backend!r}: use one of {ATTENTION_BACKENDS}")


def choose_backend(backend: str, query: torch.Tensor) -> str:
    """The kernel that runs for the request ``backend``: itself (``ValueError`` when it cannot run
    here), or for ``auto`` on CUDA the first of :data:`AUTO_ATTENTION_BACKEND`, ``varlen`` that can,
    else ``sdpa``."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}: use one of {ATTENTION_BACKENDS}")
    if backend == "auto":
        if query.device.type == "cuda":  # elsewhere the reference is also the fastest
            for candidate in (AUTO_ATTENTION_BACKEND, "varlen"):
                if unsupported_reason(candidate, query) is None:
                    return candidate
        return "sdpa"
    reason = unsupported_reason(backend, query)
    if reason is not None:
        raise ValueError(f"attention backend {backend!r} cannot run here: {reason}; use 'sdpa' or 'auto'")
    return backend


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------


def dense_attention(q, k_all, v_all, plan: AttentionPlan, scale: float) -> torch.Tensor:
    index = plan.dense
    k_pos = index.k_pos[None, :]
    mask = (k_pos >= index.q_start[:, None]) & (k_pos <= index.q_pos[:, None])  # [T/W, T]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, Hq, T/W, D]
        k_all.transpose(0, 1).unsqueeze(0),  # [1, Hkv, T, D]
        v_all.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k_all.shape[1],
    )
    return out[0].transpose(0, 1)  # [T/W, Hq, D]


def _segment_keys(k_all, v_all, plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values laid out as the varlen segments read them."""
    rows = plan.varlen.key_rows
    if rows is None:
        return k_all.contiguous(), v_all.contiguous()
    return k_all.index_select(0, rows), v_all.index_select(0, rows)


def varlen_attention(q, k_all, v_all, plan: AttentionPlan, scale: float) -> torch.Tensor:
    seg = plan.varlen
    k, v = _segment_keys(k_all, v_all, plan)
    q = q.contiguous()
    params = _varlen_parameters()
    kwargs = {}
    if "is_causal" in params:  # older signature
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)  # causal, bottom-right aligned (relax_gdn.model.attention)
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # the kernel's own scale is 1/sqrt(D)
        q = q * (scale * math.sqrt(q.shape[-1]))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # torch 2.11
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@functools.cache
def _fa4_varlen():
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def fa4_attention(q, k_all, v_all, plan: AttentionPlan, scale: float) -> torch.Tensor:
    seg = plan.varlen
    k, v = _segment_keys(k_all, v_all, plan)
    out = _fa4_varlen()(
        q.contiguous(),
        k,
        v,
        cu_seqlens_q=seg.cu_q,
        cu_seqlens_k=seg.cu_k,
        max_seqlen_q=seg.max_q,
        max_seqlen_k=seg.max_k,
        softmax_scale=scale,
        causal=True,  # causal: bottom-right aligned, as FA2
    )
    return out[0] if isinstance(out, tuple) else out


# ---------------------------------------------------------------------------------------------
# FlexAttention: the block mask from the plan's positions
# ---------------------------------------------------------------------------------------------


def _block_ranges(values: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) of ``values`` over consecutive blocks of ``block`` rows (the last may be short)."""
    starts = np.arange(0, values.size, block)
    return np.minimum.reduceat(values, starts), np.maximum.reduceat(values, starts)


def _ordered(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(count per row, column indices of the True entries first) of a [rows, cols] bool matrix."""
    counts = blocks.sum(axis=1, dtype=np.int32)
    indices = np.argsort(~blocks, axis=1, kind="stable").astype(np.int32)
    return counts, indices


def flex_block_classes(
    q_pos: np.ndarray, q_start: np.ndarray, k_pos: np.ndarray, block: int = FLEX_BLOCK
) -> tuple[np.ndarray, np.ndarray]:
    """Which (query block, key block) tiles FlexAttention visits: ``(partial, full)`` bool matrices.

    Query ``i`` sees key ``j`` iff ``q_start[i] <= k_pos[j] <= q_pos[i]``. A tile is full when that
    holds for every pair (no mask evaluated), partial when it may hold for some (the mask decides
    per element), skipped otherwise. From per-block minima and maxima, so any row order works (the
    zigzag queries, the rank-major keys): ``full`` is exact where it says so, ``partial`` a superset.
    """
    q_lo, q_hi = _block_ranges(q_pos, block)
    s_lo, s_hi = _block_ranges(q_start, block)
    k_lo, k_hi = _block_ranges(k_pos, block)
    any_visible = (k_lo[None, :] <= q_hi[:, None]) & (k_hi[None, :] >= s_lo[:, None])
    full = (k_hi[None, :] <= q_lo[:, None]) & (k_lo[None, :] >= s_hi[:, None])
    return any_visible & ~full, full


def build_flex_block_mask(
    q_pos: np.ndarray,
    q_start: np.ndarray,
    k_pos: np.ndarray,
    index,
    device: torch.device,
    block: int = FLEX_BLOCK,
):
    """FlexAttention ``BlockMask`` for the plan's visibility rule; ``index`` holds the same three
    arrays on ``device`` (:class:`DenseIndex`), which the mask reads."""
    from torch.nn.attention.flex_attention import BlockMask

    q_pos_d, q_start_d, k_pos_d = index.q_pos, index.q_start, index.k_pos

    def document_causal(b, h, q_idx, kv_idx):
        k = k_pos_d[kv_idx]
        return (k >= q_start_d[q_idx]) & (k <= q_pos_d[q_idx])

    partial, full = flex_block_classes(q_pos, q_start, k_pos, block)
    tensors = []
    for counts, indices in (_ordered(partial), _ordered(full)):
        tensors.append(torch.from_numpy(counts)[None, None].to(device))
        tensors.append(torch.from_numpy(indices)[None, None].to(device))
    return BlockMask.from_kv_blocks(
        *tensors, BLOCK_SIZE=block, mask_mod=document_causal, seq_lengths=(q_pos.size, k_pos.size)
    )


@functools.cache
def _flex_kernel(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":  # fused Triton kernels; dynamic: micro-batch lengths differ
        return torch.compile(flex_attention, dynamic=True)
    return flex_attention  # the unfused eager path: the CPU reference


def flex_attention(q, k_all, v_all, plan: AttentionPlan, scale: float) -> torch.Tensor:
    eager = q.device.type != "cuda"
    with (
        warnings.catch_warnings(),
        torch._dynamo.config.patch(disable=False) if eager else contextlib.nullcontext(),
    ):
        # the eager path is chosen on purpose off CUDA; torch warns that it is unfused. It still
        # traces the attention with Dynamo's eager backend, which CPU runs may have switched off
        # (relax_gdn.compat.cpu turns off compilation for Megatron-Core's fused kernels)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = _flex_kernel(q.device.type)(
            q.transpose(0, 1).unsqueeze(0),
            k_all.transpose(0, 1).unsqueeze(0),
            v_all.transpose(0, 1).unsqueeze(0),
            block_mask=plan.flex_block_mask,
            scale=scale,
            enable_gqa=q.shape[1] != k_all.shape[1],
        )
    return out[0].transpose(0, 1)


KERNELS = {"sdpa": dense_attention, "varlen": varlen_attention, "flex": flex_attention, "fa4": fa4_attention}

__all__ = [
    "AUTO_ATTENTION_BACKEND",
    "FA4_SM_MAJORS",
    "FLEX_BLOCK",
    "KERNELS",
    "build_flex_block_mask",
    "choose_backend",
    "fa4_import_error",
    "flex_block_classes",
    "unsupported_reason",
    "varlen_unsupported_reason",
]
