"""High-precision tensors to FP8 GEMM operands, with torchao's float8 building blocks.

Each operand of an FP8 GEMM is cast as its recipe's ``CastConfig`` says (torchao's
``tensor_to_amax`` -> ``amax_to_scale`` -> saturated cast, wrapped as a ``Float8TrainingTensor``
whose ``torch.mm`` torchao dispatches to ``torch._scaled_mm``, or to the fp32 emulation on CPU).
One thing torchao leaves to its DTensor path is done here for Megatron-Core's tensor parallelism:
an operand split over the TP ranks along a dimension its scale reduces over gets its amax
all-reduced (MAX) over the TP group, so every rank casts with the scale the whole tensor would
have: TP 2 (+ SP) computes what TP 1 computes. The reduction is a device collective; the scales
never leave the device (no host sync).

On CUDA the amax and the scaled cast are compiled (``torch.compile``, dynamic shapes): one or two
fused kernels per operand instead of an fp32 copy and a chain of elementwise kernels. A compile
that fails falls back to eager for the model that asked (:class:`CastKernels`), with one warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchao.float8.config import CastConfig, ScalingGranularity, ScalingType
from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole, LinearMMConfig
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax, to_fp8_saturated

logger = logging.getLogger(__name__)


def _amax(x: torch.Tensor, axiswise_dim: int | None) -> torch.Tensor:
    granularity = ScalingGranularity.TENSORWISE if axiswise_dim is None else ScalingGranularity.AXISWISE
    return tensor_to_amax(x, scaling_granularity=granularity, axiswise_dim=axiswise_dim)


def _scaled_bits(x: torch.Tensor, amax: torch.Tensor, float8_dtype: torch.dtype,
                 round_scales_to_power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # torchao's hp_tensor_and_scale_to_float8: the product in fp32, then a saturated cast
    scale = amax_to_scale(amax, float8_dtype, round_scales_to_power_of_2)
    return to_fp8_saturated(x.to(torch.float32) * scale, float8_dtype), scale


def _amax_and_scaled_bits(x: torch.Tensor, axiswise_dim: int | None, float8_dtype: torch.dtype,
                          round_scales_to_power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _scaled_bits(x, _amax(x, axiswise_dim), float8_dtype, round_scales_to_power_of_2)


_RECOMPILE_LIMIT = 64
_RECOMPILE_LIMIT_KEY = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


class CastKernels:
    """The cast's pieces, compiled on CUDA for the model that owns this object (eager on CPU, and
    eager for this model alone after a compile error)."""

    def __init__(self, compile_on_cuda: bool = True):
        self._compile = compile_on_cuda
        self._compiled: dict[str, object] = {}

    def _call(self, name: str, fn, x: torch.Tensor, *args):
        if not (self._compile and x.is_cuda):
            return fn(x, *args)
        compiled = self._compiled.get(name)
        if compiled is None:
            compiled = self._compiled[name] = torch.compile(fn, dynamic=True)
        try:
            # one graph per dtype, scaling axis and layout: a model's recipe needs up to ~5, a benchmark
            # comparing the recipes in one process more than dynamo's default limit of 8 per function,
            # past which it would run the casts eagerly without a word
            with torch._dynamo.config.patch(**{_RECOMPILE_LIMIT_KEY: _RECOMPILE_LIMIT}):
                return compiled(x, *args)
        except Exception as e:  # noqa: BLE001 - Inductor fails in many ways; eager is the same math
            logger.warning("torch.compile failed for the FP8 casts (%s: %s); this model casts eagerly",
                           type(e).__name__, e)
            self._compile = False
            return fn(x, *args)

    def amax(self, x: torch.Tensor, axiswise_dim: int | None) -> torch.Tensor:
        return self._call("amax", _amax, x, axiswise_dim)

    def scaled_bits(self, x, amax, float8_dtype, round_scales_to_power_of_2):
        return self._call("scaled_bits", _scaled_bits, x, amax, float8_dtype, round_scales_to_power_of_2)

    def amax_and_scaled_bits(self, x, axiswise_dim, float8_dtype, round_scales_to_power_of_2):
        return self._call("amax_and_scaled_bits", _amax_and_scaled_bits, x, axiswise_dim, float8_dtype,
                          round_scales_to_power_of_2)


@dataclass(frozen=True)
class Operand:
    """How one GEMM operand is cast: its recipe's cast config, its role, the dimension its scale
    reduces over (None: tensorwise) and the dimension TP splits it along (None: replicated)."""

    cast: CastConfig
    role: GemmInputRole
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


def operand(cast: CastConfig, role: GemmInputRole, axiswise_dim: int, split_dim: int | None) -> Operand:
    """An :class:`Operand` whose axiswise dimension applies only where the cast is axiswise
    (torchao's ``get_maybe_axiswise_dim``)."""
    axiswise = cast.scaling_granularity is ScalingGranularity.AXISWISE
    return Operand(cast, role, axiswise_dim if axiswise else None, split_dim)


def cast_to_fp8(x: torch.Tensor, op: Operand, mm_config: LinearMMConfig, *, round_scales_to_power_of_2: bool,
                tp_group: dist.ProcessGroup | None, kernels: CastKernels) -> Float8TrainingTensor:
    """``x`` as the FP8 operand ``op`` describes (``x`` must not be a disabled operand)."""
    dtype = op.cast.target_dtype
    if tp_group is not None and tp_group.size() > 1 and op.amax_spans_ranks(x.dim()):
        amax = kernels.amax(x, op.axiswise_dim)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
        bits, scale = kernels.scaled_bits(x, amax, dtype, round_scales_to_power_of_2)
    else:
        bits, scale = kernels.amax_and_scaled_bits(x, op.axiswise_dim, dtype, round_scales_to_power_of_2)
    return Float8TrainingTensor(bits, scale, x.dtype, linear_mm_config=mm_config, gemm_input_role=op.role,
                                axiswise_dim=op.axiswise_dim)


__all__ = ["CastKernels", "Operand", "cast_to_fp8", "operand"]
