"""High-precision tensors to FP8 GEMM operands, and the FP8 GEMM, with torchao's float8 recipes.

Each operand is cast as its recipe's ``CastConfig`` says, with torchao's building blocks
(``tensor_to_amax`` -> ``amax_to_scale`` -> ``to_fp8_saturated``), straight into the layout Hopper's
FP8 GEMM reads (``torch._scaled_mm``: the first operand row-major, the second column-major): a cast
writes the tensor as it is stored (``rows``), transposed (``cols``, the tokens padded to a multiple
of 16 where a weight gradient's GEMM reduces over them), or both in one pass. On CUDA the amax is
one ATen reduction and the cast one Triton kernel (:mod:`relax_gdn.model.fp8.cast_kernel`), bit for
bit what the torchao functions here compute; a separate transposing copy of the FP8 data, torchao's
tensor-subclass dispatch around every GEMM, or these functions compiled by ``torch.compile`` took
back what the FP8 GEMMs save at the 9B's shapes (docs/benchmarks.md, "FP8 on one GPU").

Tensor parallelism: an operand split over the TP ranks along a dimension its scale reduces over gets
its amax all-reduced (MAX) over the TP group first, so every rank casts with the scale the whole
tensor would have: TP 2 (+ SP) computes what TP 1 computes. The reduction is a device collective;
the scales never leave the device (no host sync).

On CPU the GEMM is torchao's emulation: the same FP8 operands, dequantised and multiplied in fp32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchao.float8.config import CastConfig, ScalingGranularity, ScalingType
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax, to_fp8_saturated

from relax_gdn.model.fp8 import cast_kernel

logger = logging.getLogger(__name__)

# torch._scaled_mm: the reduction dimension a multiple of 16
ALIGN = 16
_RECOMPILE_LIMIT = 64
_RECOMPILE_LIMIT_KEY = (
    "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
)


@dataclass(frozen=True)
class Operand:
    """How one GEMM operand is cast: its recipe's cast config, the dimension its scale reduces over
    (None: tensorwise) and the dimension TP splits it along (None: replicated), both on the tensor as
    stored."""

    cast: CastConfig
    axiswise_dim: int | None
    split_dim: int | None = None

    @property
    def disabled(self) -> bool:
        return self.cast.scaling_type is ScalingType.DISABLED

    def amax_spans_ranks(self, ndim: int) -> bool:
        """Whether this operand's amax reduces over a dimension TP splits (then it is all-reduced)."""
        if self.split_dim is None:
            return False
        return self.axiswise_dim is None or self.axiswise_dim % ndim == self.split_dim % ndim


def operand(cast: CastConfig, axiswise_dim: int, split_dim: int | None) -> Operand:
    """An :class:`Operand` whose axiswise dimension applies only where the cast is axiswise
    (torchao's ``get_maybe_axiswise_dim``)."""
    axiswise = cast.scaling_granularity is ScalingGranularity.AXISWISE
    return Operand(cast, axiswise_dim if axiswise else None, split_dim)


@dataclass(frozen=True)
class FP8Data:
    """One GEMM operand in FP8: ``data`` row-major ``[rows, k]``, the ``scale`` that made it (scalar,
    or ``[rows, 1]``: one per row) and its reciprocal, the factor the GEMM dequantises by; the value is
    ``data * inv_scale``."""

    data: torch.Tensor
    scale: torch.Tensor
    inv_scale: torch.Tensor

    def transposed(self) -> FP8Data:
        """The ``cols`` layout of a tensorwise ``rows`` cast, bit for bit the one :func:`cast_to_fp8`
        makes: the same FP8 values transposed, the first dimension zero-padded to a multiple of 16.
        A byte copy, no scaling (so a kept LoRA base weight needs one layout, not two)."""
        assert not self.scale.dim(), "a per-row scale is along the other dimension once transposed"
        n, k = self.data.shape
        out = torch.zeros(k, n + (-n) % ALIGN, dtype=torch.uint8, device=self.data.device)
        out[:, :n].copy_(self.data.view(torch.uint8).t())  # uint8: every torch copies it, any layout
        return FP8Data(out.view(self.data.dtype), self.scale, self.inv_scale)


# --- the reference casts (plain torch: eager on CPU, compiled in mode 'compiled') ---------------


def _amax(x: torch.Tensor, axiswise_dim: int | None) -> torch.Tensor:
    granularity = ScalingGranularity.TENSORWISE if axiswise_dim is None else ScalingGranularity.AXISWISE
    return tensor_to_amax(x, scaling_granularity=granularity, axiswise_dim=axiswise_dim)


def _cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, pow2: bool, rows: bool, cols: bool):
    """``x [m, n]`` scaled by the scale of ``amax`` and cast to ``dtype``: (as stored or None, transposed
    ``[n, m']`` with ``m`` padded to a multiple of 16 or None, the scale, ``amax``)."""
    scale = amax_to_scale(amax, dtype, pow2)
    scaled = x.to(torch.float32) * scale  # torchao's hp_tensor_and_scale_to_float8: the product in fp32
    as_stored = to_fp8_saturated(scaled, dtype) if rows else None
    transposed = None
    if cols:
        transposed = to_fp8_saturated(F.pad(scaled.t(), (0, (-x.shape[0]) % ALIGN)), dtype).contiguous()
    return as_stored, transposed, scale, amax


def _with_reciprocal(cast):
    """A cast's (as stored, transposed, scale, amax) with the scale's reciprocal after the scale, taken
    eagerly: Inductor's reciprocal of a per-row scale differs from torch's in the last bit."""
    as_stored, transposed, scale, amax = cast
    return as_stored, transposed, scale, scale.reciprocal(), amax


def _amax_and_cast(x, axiswise_dim, dtype, pow2, rows, cols):
    return _cast(x, _amax(x, axiswise_dim), dtype, pow2, rows, cols)


class CastKernels:
    """The casts of one model: on CUDA Triton's kernel (``triton``, the default) or the same functions
    compiled by ``torch.compile`` (``compiled``, kept for comparison in ``relax_gdn.bench.gemm``) or
    eager; eager on CPU. An error of the Triton kernel or of the compiler turns this model's casts eager
    (the same values), with one warning."""

    MODES = ("triton", "compiled", "eager")

    def __init__(self, mode: str = "triton"):
        if mode not in self.MODES:
            raise ValueError(f"cast mode {mode!r}: one of {', '.join(self.MODES)}")
        self.mode = mode
        self._compiled: dict[str, object] = {}

    def _call(self, name: str, fn, x: torch.Tensor, *args):
        if not (self.mode == "compiled" and x.is_cuda):
            return fn(x, *args)
        compiled = self._compiled.get(name)
        if compiled is None:
            compiled = self._compiled[name] = torch.compile(fn, dynamic=True)
        try:
            # one graph per dtype, scaling axis and layout: a model's recipe needs a few, a benchmark
            # comparing the recipes in one process more than dynamo's default limit of 8 per function,
            # past which it would run the casts eagerly without a word
            with torch._dynamo.config.patch(**{_RECOMPILE_LIMIT_KEY: _RECOMPILE_LIMIT}):
                return compiled(x, *args)
        except Exception as e:  # noqa: BLE001 - Inductor fails in many ways; eager is the same math
            self._fall_back("torch.compile", e)
            return fn(x, *args)

    def _fall_back(self, what: str, error: Exception) -> None:
        logger.warning(
            "%s failed for the FP8 casts (%s: %s); this model casts eagerly",
            what,
            type(error).__name__,
            error,
        )
        self.mode = "eager"

    def _triton(self, x: torch.Tensor) -> bool:
        return self.mode == "triton" and x.is_cuda

    def amax(self, x: torch.Tensor, axiswise_dim: int | None) -> torch.Tensor:
        if self._triton(x):
            return cast_kernel.amax(x, axiswise_dim)
        return self._call("amax", _amax, x, axiswise_dim)

    def cast(self, x, amax, dtype, pow2, rows, cols):
        if self._triton(x):
            try:
                return cast_kernel.scaled_cast(x, amax, dtype, pow2, rows, cols, align=ALIGN)
            except Exception as e:  # noqa: BLE001 - Triton's compiler and driver fail in many ways
                self._fall_back("Triton's cast kernel", e)
        return _with_reciprocal(self._call("cast", _cast, x, amax, dtype, pow2, rows, cols))

    def amax_and_cast(self, x, axiswise_dim, dtype, pow2, rows, cols):
        if self._triton(x):
            return self.cast(x, self.amax(x, axiswise_dim), dtype, pow2, rows, cols)
        return _with_reciprocal(
            self._call("amax_and_cast", _amax_and_cast, x, axiswise_dim, dtype, pow2, rows, cols)
        )


def cast_to_fp8(
    x: torch.Tensor,
    op: Operand,
    *,
    layouts: tuple[str, ...],
    pow2: bool,
    tp_group: dist.ProcessGroup | None,
    kernels: CastKernels,
    amax: torch.Tensor | None = None,
) -> tuple[dict[str, FP8Data], torch.Tensor]:
    """``x`` (2-D) cast as ``op`` says into ``layouts`` (``rows``: as stored, ``cols``: transposed, the
    first dimension padded to a multiple of 16): ({layout: FP8Data}, the amax it was scaled by).
    ``amax``: one computed earlier for the same operand (the backward's cast of a tensorwise input)."""
    dtype, rows, cols = op.cast.target_dtype, "rows" in layouts, "cols" in layouts
    # what fp8_mm multiplies: a scale per row of the data, so rows keep the last dimension's, cols the first's
    assert op.axiswise_dim is None or op.axiswise_dim % x.dim() == (x.dim() - 1 if rows else 0), (op, layouts)
    if amax is None and tp_group is not None and tp_group.size() > 1 and op.amax_spans_ranks(x.dim()):
        amax = kernels.amax(x, op.axiswise_dim)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
    if amax is None:
        as_stored, transposed, scale, inv_scale, amax = kernels.amax_and_cast(
            x, op.axiswise_dim, dtype, pow2, rows, cols
        )
    else:
        as_stored, transposed, scale, inv_scale, amax = kernels.cast(x, amax, dtype, pow2, rows, cols)
    out = {}
    if rows:
        out["rows"] = FP8Data(as_stored, scale, inv_scale)
    if cols:
        out["cols"] = FP8Data(transposed, scale.t(), inv_scale.t())  # t() keeps a 0-d scale as it is
    return out, amax


def fp8_mm(
    a: FP8Data,
    b_t: FP8Data,
    out_dtype: torch.dtype,
    *,
    fast_accum: bool,
    emulate: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b_tᵀ`` in FP8 (``a [m, k]``, ``b_t [n, k]``, both row-major): Hopper's ``torch._scaled_mm``,
    or on CPU torchao's emulation (the dequantised operands multiplied in fp32); written into ``out``
    (``[m, n]``, contiguous, of ``out_dtype``) when given."""
    if emulate:
        product = ((a.data.float() / a.scale) @ (b_t.data.float() / b_t.scale).t()).to(out_dtype)
        return product if out is None else out.copy_(product)
    into = {} if out is None else {"out": out}
    scale_a, scale_b = a.inv_scale, b_t.inv_scale.t()
    rowwise = scale_a.dim() or scale_b.dim()
    if rowwise:  # _scaled_mm scales both operands the same way: a tensorwise one is repeated
        scale_a = scale_a.expand(a.data.shape[0], 1).contiguous() if not scale_a.dim() else scale_a
        scale_b = scale_b.expand(1, b_t.data.shape[0]).contiguous() if not scale_b.dim() else scale_b
    if rowwise and not fast_accum:
        # torchao's choice: the rowwise kernel without fast accumulation is slow; the tensorwise one
        # with unit scales, then the scales applied to the product
        one = torch.ones((), device=a.data.device)
        product = torch._scaled_mm(
            a.data, b_t.data.t(), one, one, out_dtype=out_dtype, use_fast_accum=False, **into
        )
        return product.mul_(scale_a).mul_(scale_b)
    return torch._scaled_mm(
        a.data, b_t.data.t(), scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum, **into
    )


__all__ = ["ALIGN", "CastKernels", "FP8Data", "Operand", "cast_to_fp8", "fp8_mm", "operand"]
