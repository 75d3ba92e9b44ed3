"""The scaled FP8 cast as one Triton kernel: amax -> scale -> saturated cast, written as stored, transposed
(the tokens padded to a multiple of 16), or both, in one pass over the high-precision tensor, with the
scale and its reciprocal (the GEMM's factor).

It computes what torchao's building blocks compute (``amax_to_scale``: ``fp8_max / max(amax, 1e-12)``
in float64, rounded to float32, optionally down to a power of two; ``x.float() * scale`` saturated to
the FP8 range, rounded to nearest even), bit for bit (``tests/test_fp8_gpu.py`` and, through Triton's
interpreter, ``tests/test_fp8.py``). Why a kernel of our own: compiled with ``torch.compile`` on a
dynamic token count, each cast costs about 200 µs of host time (dynamo's guards) and its amax
reduction runs at a fifth of the memory bandwidth, which together took back what the FP8 GEMMs save
at the 9B's shapes (docs/benchmarks.md, "FP8 on one GPU"); here the amax is one ATen reduction and the
cast one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# torchao's float8_utils.EPS: the smallest amax a scale is computed from
AMAX_EPS = 1e-12
TENSORWISE, PER_ROW, PER_COLUMN = 0, 1, 2
_BLOCK_M, _BLOCK_K = 64, 128
_TL_DTYPES = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


# the scale in float64 from exact float64 constants, as torchao's amax_to_scale
@triton.jit
def _scales(
    amax_ptr,
    scale_ptr,
    inv_scale_ptr,
    offs,
    mask,
    store,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    POW2: tl.constexpr,
):
    """The scales of the amax at ``offs`` (one, or a row's or a column's block), stored with their
    reciprocals where ``store`` (one program per scale writes it)."""
    amax = tl.load(amax_ptr + offs, mask=mask, other=1.0).to(tl.float64)
    scale = (tl.full([], FP8_MAX, tl.float64) / tl.maximum(amax, tl.full([], EPS, tl.float64))).to(tl.float32)
    if POW2:  # down to a power of two: the exponent bits alone (scales are positive and normal)
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    if store:
        # the GEMM's dequantising factor, rounded as torch's reciprocal rounds it (IEEE division:
        # Triton's `/` on float32 is an approximation)
        tl.store(
            inv_scale_ptr + offs, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=mask
        )
        tl.store(scale_ptr + offs, scale, mask=mask)
    return scale


# the padding rows of the transposed layout load as zeros
@triton.jit
def _scaled_cast(
    x_ptr,
    amax_ptr,
    rows_ptr,
    cols_ptr,
    scale_ptr,
    inv_scale_ptr,
    M,
    K,
    M_PAD,
    stride_m,
    stride_k,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    POW2: tl.constexpr,
    WRITE_ROWS: tl.constexpr,
    WRITE_COLS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    in_m, in_k = offs_m < M, offs_k < K
    mask = in_m[:, None] & in_k[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_m + offs_k[None, :] * stride_k, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if SCALE_MODE == 0:  # one scale, written by the first program
        offs, in_range, store = 0, pid_m >= 0, (pid_m == 0) & (pid_k == 0)
    elif SCALE_MODE == 1:  # a scale per row, written by the programs of the first column block
        offs, in_range, store = offs_m, in_m, pid_k == 0
    else:  # a scale per column, written by the programs of the first row block
        offs, in_range, store = offs_k, in_k, pid_m == 0
    scale = _scales(amax_ptr, scale_ptr, inv_scale_ptr, offs, in_range, store, FP8_MAX, EPS, POW2)
    if SCALE_MODE == 1:
        scale = scale[:, None]
    elif SCALE_MODE == 2:
        scale = scale[None, :]
    scaled = x * scale
    limit = tl.full([], FP8_MAX, tl.float32)
    q = tl.minimum(tl.maximum(scaled, -limit), limit).to(OUT_DTYPE, fp_downcast_rounding="rtne")
    if WRITE_ROWS:
        tl.store(rows_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)
    if WRITE_COLS:
        tl.store(
            cols_ptr + offs_k[None, :] * M_PAD + offs_m[:, None],
            q,
            mask=(offs_m < M_PAD)[:, None] & in_k[None, :],
        )


def scaled_cast(
    x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, pow2: bool, rows: bool, cols: bool, *, align: int
):
    """``x [m, k]`` scaled by the scale of ``amax`` (a scalar, ``[m, 1]`` or ``[1, k]``) and cast to
    ``dtype``: (as stored ``[m, k]`` or None, transposed ``[k, m']`` with ``m`` padded to a multiple of
    ``align`` or None, the float32 scale shaped as ``amax``, its reciprocal, ``amax``). The reciprocal is
    what ``torch._scaled_mm`` multiplies by; written here, it costs no launch of its own."""
    m, k = x.shape
    if amax.numel() == 1:
        mode = TENSORWISE
    elif amax.shape == (m, 1):
        mode = PER_ROW
    elif amax.shape == (1, k):
        mode = PER_COLUMN
    else:
        raise ValueError(f"amax of shape {tuple(amax.shape)} for a tensor of shape {(m, k)}")
    m_pad = m + (-m) % align
    as_stored = torch.empty((m, k), dtype=dtype, device=x.device) if rows else None
    transposed = torch.empty((k, m_pad), dtype=dtype, device=x.device) if cols else None
    scale = torch.empty(amax.shape, dtype=torch.float32, device=x.device)
    inv_scale = torch.empty_like(scale)
    grid = (triton.cdiv(m_pad if cols else m, _BLOCK_M), triton.cdiv(k, _BLOCK_K))
    _scaled_cast[grid](
        x,
        amax.contiguous(),
        as_stored if rows else scale,  # an unused pointer still needs a tensor
        transposed if cols else scale,
        scale,
        inv_scale,
        m,
        k,
        m_pad,
        x.stride(0),
        x.stride(1),
        FP8_MAX=torch.finfo(dtype).max,
        EPS=AMAX_EPS,
        SCALE_MODE=mode,
        POW2=pow2,
        WRITE_ROWS=rows,
        WRITE_COLS=cols,
        OUT_DTYPE=_TL_DTYPES[dtype],
        BLOCK_M=_BLOCK_M,
        BLOCK_K=_BLOCK_K,
        num_warps=8,
    )
    return as_stored, transposed, scale, inv_scale, amax


def amax(x: torch.Tensor, axiswise_dim: int | None) -> torch.Tensor:
    """``max |x|`` in float32, over the whole tensor or along ``axiswise_dim`` (kept): one ATen reduction
    that reads bf16 and accumulates in float32 without a copy."""
    if axiswise_dim is None:
        return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    return torch.linalg.vector_norm(x, float("inf"), dim=axiswise_dim, keepdim=True, dtype=torch.float32)


__all__ = ["AMAX_EPS", "amax", "scaled_cast"]
