"""Megatron-Core's parallel linears with their GEMMs in FP8.

Megatron-Core's ``ColumnParallelLinear`` / ``RowParallelLinear`` run their GEMMs through
``self._forward_impl`` (``linear_with_grad_accumulation_and_async_allreduce``, or
``linear_with_frozen_weight`` for a frozen weight). :class:`FP8LinearImpl` takes that place on a
layer (an instance attribute: the layer's class, parameters and checkpoint keys stay Megatron-Core's,
and a LoRA layer, a subclass calling ``super().forward``, gets it too) and computes the same
function with the three GEMMs (output, input gradient, weight gradient) in FP8 as the recipe says,
keeping what Megatron-Core's function does around them:

* sequence parallelism: the input is all-gathered over TP for the GEMM and only this rank's part is
  saved (gathered again in backward); the input gradient is reduce-scattered;
* column-parallel without SP: the input gradient is all-reduced over TP;
* ``gradient_accumulation_fusion``: the weight gradient is added into the fp32 ``main_grad`` and
  autograd gets Megatron-Core's placeholder (:func:`~relax_gdn.model.fusion.handed_to_main_grad`);
  a high-precision weight-gradient GEMM (``rowwise_gw_hp``) accumulates there inside the GEMM; an FP8
  one (``torch._scaled_mm`` cannot accumulate) writes a step's first gradient straight into the zeroed
  ``main_grad`` in fp32 (:func:`~relax_gdn.model.fusion.main_grad_is_empty`) and adds the later ones;
* a frozen weight (LoRA's base) is cast once and kept in FP8 until the weight changes (its
  ``_version``: a checkpoint load casts again), not at every step. The bf16 weight itself may live
  in host memory (``model.fp8.frozen_weights_on_host``): its casts (and its bf16 gate rows) are
  made from a copy brought to the GPU and kept there, both layouts, two bytes per weight (the
  rowwise recipes' forward and input-gradient casts scale along different dimensions; tensorwise
  writes both layouts in one cast). A frozen weight left on the GPU keeps one byte per weight under
  tensorwise, and each backward makes the input gradient's transposed copy from the kept rows;
* ``bf16_rows``: the last rows of the output (the GDN input projection's beta/alpha gates) come
  from a bf16 GEMM beside the FP8 one.

What it saves for backward is what Megatron-Core's function saves (the input in high precision and
the weight; a tensorwise recipe also keeps their amax, a scalar each, instead of reducing them again),
so recompute, activation memory and the memory model are unchanged; the FP8 casts are transient. The
GEMMs are ``torch._scaled_mm`` on operands cast straight into its layouts
(:mod:`relax_gdn.model.fp8.casts`). Where :class:`~relax_gdn.model.mlp.Qwen3_5MLP` skips a GEMM whose
output no gradient reads (full recompute), the forward skips its casts and GEMM too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchao.float8.config import Float8LinearConfig

from relax_gdn.model.fp8.casts import CastKernels, FP8Data, Operand, cast_to_fp8, fp8_mm, operand
from relax_gdn.model.fp8.options import TORCHAO_RECIPES
from relax_gdn.model.fusion import handed_to_main_grad, main_grad_is_empty
from relax_gdn.model.mlp import matmul_output_unread


@dataclass(frozen=True)
class LinearOperands:
    """The six casts of one linear (2-D: input ``[T, K]``, weight ``[N, K]``, output gradient ``[T, N]``,
    the dimensions on the tensors as stored), with the dimension TP splits each along for its kind of
    layer. torchao casts the weight transposed; the dimensions here are the same ones on the weight."""

    input: Operand
    weight: Operand
    grad_output: Operand
    weight_for_grad_input: Operand
    grad_output_for_grad_weight: Operand
    input_for_grad_weight: Operand

    @classmethod
    def of(cls, c: Float8LinearConfig, parallel: str) -> LinearOperands:
        row = parallel == "row"  # input and weight split over K; else the weight and grad split over N
        x_split, w_split, g_split = (1, 1, None) if row else (None, 0, 1)
        return cls(
            input=operand(c.cast_config_input, -1, x_split),
            weight=operand(c.cast_config_weight, -1, w_split),  # over K, per output row
            grad_output=operand(c.cast_config_grad_output, -1, g_split),
            weight_for_grad_input=operand(
                c.cast_config_weight_for_grad_input, 0, w_split
            ),  # over N, per input
            grad_output_for_grad_weight=operand(c.cast_config_grad_output_for_grad_weight, 0, g_split),
            input_for_grad_weight=operand(c.cast_config_input_for_grad_weight, 0, x_split),
        )

    @property
    def weight_grad_in_fp8(self) -> bool:
        return not (self.grad_output_for_grad_weight.disabled or self.input_for_grad_weight.disabled)


@dataclass
class FP8LinearImpl:
    """One layer's FP8 GEMMs, installed as its ``_forward_impl`` (see the module docstring).

    Args:
        config: the recipe (torchao's ``Float8LinearConfig``).
        parallel: ``"column"`` or ``"row"``: how TP splits the layer (which operands' amax spans ranks).
        tp_group: the layer's TP group.
        kernels: the model's casts (one :class:`CastKernels` shared by its layers).
        bf16_rows: output rows at the end computed in bf16 (0: all in FP8).
    """

    config: Float8LinearConfig
    parallel: str
    tp_group: dist.ProcessGroup | None
    kernels: CastKernels
    bf16_rows: int = 0
    calls: int = 0  # forwards run in FP8 (the run summary reports which layers ran)
    weight_casts: int = 0  # weight casts computed (a frozen weight's are kept: tests count them)
    operands: LinearOperands = field(init=False)
    _frozen_casts: dict = field(init=False, default_factory=dict, repr=False)
    _frozen_key: tuple | None = field(init=False, default=None, repr=False)

    def __post_init__(self):
        self.operands = LinearOperands.of(self.config, self.parallel)

    @classmethod
    def of_recipe(
        cls,
        recipe: str,
        *,
        parallel: str = "column",
        tp_group: dist.ProcessGroup | None = None,
        kernels: CastKernels | None = None,
        bf16_rows: int = 0,
    ) -> FP8LinearImpl:
        """The layer's implementation of ``model.fp8.recipe`` ``recipe`` (``kernels``: None, casts of its own)."""
        return cls(
            Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[recipe]),
            parallel,
            tp_group,
            kernels or CastKernels(),
            bf16_rows=bf16_rows,
        )

    def __call__(
        self,
        input,
        weight,
        *,
        bias=None,
        gradient_accumulation_fusion=False,
        allreduce_dgrad=False,
        sequence_parallel=False,
        grad_output_buffer=None,
        wgrad_deferral_limit=None,
        tp_group=None,
        gtp_remat_size=1,
    ):
        """Megatron-Core's ``_forward_impl`` arguments (it passes them by keyword)."""
        if grad_output_buffer is not None or gtp_remat_size > 1:
            raise NotImplementedError("FP8 linears do not defer weight gradients or shard weights over GTP")
        self.calls += 1
        comm = _Communication(gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel)
        output = _FP8LinearFunction.apply(input, weight, self, comm)
        return output if bias is None else output + bias

    # -- casts ------------------------------------------------------------------------------------

    def cast(self, x: torch.Tensor, op: Operand, layout: str, amax: torch.Tensor | None = None):
        """(``x`` cast as ``op`` says into ``layout``, its amax)."""
        casts, amax = cast_to_fp8(
            x,
            op,
            layouts=(layout,),
            pow2=self.config.round_scales_to_power_of_2,
            tp_group=self.tp_group,
            kernels=self.kernels,
            amax=amax,
        )
        return casts[layout], amax

    def weight(
        self,
        weight: torch.Tensor,
        op: Operand,
        layout: str,
        amax: torch.Tensor | None = None,
        *,
        device: torch.device,
    ):
        """(the FP8 rows of ``weight`` ``[N, K]`` cast as ``op`` says into ``layout`` on ``device``, its
        amax); a frozen weight's casts are computed once per value of the weight and kept, from a copy
        brought to ``device`` where the weight is kept in host memory (:meth:`FP8Plan.keep_frozen_weights_on_host`)."""
        if weight.requires_grad:
            self.weight_casts += 1
            return self.cast(self.fp8_rows(weight), op, layout, amax)
        kept_casts = self._frozen(weight, device)
        layouts = self.kept_layouts(on_host=weight.device != device) or (layout,)
        kept = layout if layout in layouts else "rows"
        if (op, kept) not in kept_casts:
            casts, amax = cast_to_fp8(
                self.fp8_rows(weight.to(device, non_blocking=True)),
                op,
                layouts=layouts,
                tp_group=self.tp_group,
                pow2=self.config.round_scales_to_power_of_2,
                kernels=self.kernels,
            )
            self.weight_casts += 1
            kept_casts.update({(op, name): (cast, amax) for name, cast in casts.items()})
        cast, amax = kept_casts[op, kept]
        return (cast, amax) if kept == layout else (cast.transposed(), amax)

    def kept_layouts(self, *, on_host: bool) -> tuple[str, ...]:
        """The FP8 layouts a frozen weight keeps from one cast, where forward and input gradient cast it
        alike (tensorwise; empty otherwise: each GEMM's cast is kept on its own). Its bf16 values in
        host memory (``on_host``) leave the GPU two bytes per weight, so it keeps both layouts there
        and no backward transposes; on the GPU it keeps the rows alone, on top of bf16's bytes, and
        each backward makes the transposed copy (a byte copy, freed after its GEMM)."""
        if self.operands.weight != self.operands.weight_for_grad_input:
            return ()
        return ("rows", "cols") if on_host else ("rows",)

    def gate_rows(self, weight: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The weight's last ``bf16_rows`` rows (their GEMMs run in bf16) on ``device``: a frozen weight
        kept in host memory keeps a copy of them there."""
        rows = weight[-self.bf16_rows :]
        if weight.device == device:
            return rows
        kept_casts = self._frozen(weight, device)
        if "gate_rows" not in kept_casts:
            kept_casts["gate_rows"] = rows.to(device, non_blocking=True)
        return kept_casts["gate_rows"]

    def _frozen(self, weight: torch.Tensor, device: torch.device) -> dict:
        """What is kept of a frozen weight for ``device``, emptied when the weight changes (a checkpoint
        load writes into it: its ``_version``) or moves."""
        key = (weight.data_ptr(), weight._version, weight.device, device)
        if key != self._frozen_key:
            self._frozen_casts.clear()
            self._frozen_key = key
        return self._frozen_casts

    def mm(self, a: FP8Data, b_t: FP8Data, out_dtype: torch.dtype, gemm, out=None) -> torch.Tensor:
        """``a @ b_tᵀ`` with the recipe's setting for ``gemm`` (a ``Float8GemmConfig``), into ``out``
        when given."""
        return fp8_mm(a, b_t, out_dtype, fast_accum=gemm.use_fast_accum, emulate=not a.data.is_cuda, out=out)

    def fp8_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of a weight ``[N, K]`` that run in FP8."""
        return t if not self.bf16_rows else t[: t.shape[0] - self.bf16_rows]

    def split_out(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``t [..., N]`` as (FP8 columns, bf16 columns or None)."""
        if not self.bf16_rows:
            return t, None
        n8 = t.shape[-1] - self.bf16_rows
        return t[..., :n8], t[..., n8:]


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` all-gathered over ``group`` along the sequence, into Megatron-Core's shared buffer (as
    its own linears gather: the gathered input is used at once, never saved)."""
    from megatron.core.parallel_state import get_global_memory_buffer

    size = list(x.size())
    size[0] *= group.size()
    out = get_global_memory_buffer().get_tensor(size, x.dtype, "mpu")
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


@dataclass(frozen=True)
class _Communication:
    """What Megatron-Core's function is told besides its tensors: add the weight gradient into
    ``main_grad``, all-reduce the input gradient over TP, gather the input over the sequence (SP)."""

    grad_accumulation_fusion: bool
    allreduce_dgrad: bool
    sequence_parallel: bool


def _reusable(first: Operand, then: Operand, amax: torch.Tensor | None) -> torch.Tensor | None:
    """The amax of ``first``'s cast when ``then`` casts the same tensor the same way (a tensorwise
    recipe's input and weight in backward), else None."""
    same = first.cast == then.cast and first.axiswise_dim is None and then.axiswise_dim is None
    return amax if same else None


class _FP8LinearFunction(torch.autograd.Function):
    """``input @ weightᵀ`` with Megatron-Core's TP communication, the GEMMs in FP8."""

    @staticmethod
    def forward(ctx, input, weight, impl: FP8LinearImpl, comm: _Communication):
        ctx.impl, ctx.allreduce_dgrad, ctx.sequence_parallel = (
            impl,
            comm.allreduce_dgrad,
            comm.sequence_parallel,
        )
        fuse = comm.grad_accumulation_fusion and hasattr(weight, "main_grad")
        ctx.main_grad = weight.main_grad if fuse else None  # on ctx, as Megatron-Core's: layers may share it
        total = _gather_sequence(input, impl.tp_group) if comm.sequence_parallel else input
        x = total.reshape(-1, total.shape[-1])
        shape = (*total.shape[:-1], weight.shape[0])
        if matmul_output_unread():  # Qwen3_5MLP under full recompute: backward reads only the saved inputs
            ctx.save_for_backward(input, weight, None, None)
            return x.new_zeros(shape)
        ops = impl.operands
        x8, x_amax = impl.cast(x, ops.input, "rows")
        w8, w_amax = impl.weight(weight, ops.weight, "rows", device=x.device)
        ctx.save_for_backward(input, weight, x_amax, w_amax)
        out = impl.mm(x8, w8, x.dtype, impl.config.gemm_config_output)
        if impl.bf16_rows:
            out = torch.cat([out, torch.matmul(x, impl.gate_rows(weight, x.device).t())], dim=-1)
        return out.reshape(shape)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, x_amax, w_amax = ctx.saved_tensors
        impl: FP8LinearImpl = ctx.impl
        group = impl.tp_group
        g = grad_output.reshape(-1, grad_output.shape[-1])
        g8, g_hp = impl.split_out(g)
        need_input, need_weight = (
            ctx.needs_input_grad[0],
            weight.requires_grad,
        )  # LoRA: no input grad in layer 0
        casts = _grad_output_casts(impl, g8, need_input, need_weight and impl.operands.weight_grad_in_fp8)
        grad_input, handle = None, None
        if need_input:
            grad_input = _grad_input(impl, casts["rows"], g_hp, weight, w_amax)
            grad_input, handle = _reduce_grad_input(
                grad_input.reshape(*grad_output.shape[:-1], weight.shape[1]),
                input,
                ctx.sequence_parallel,
                ctx.allreduce_dgrad,
                group,
            )
        grad_weight = None
        if need_weight:
            total = _gather_sequence(input, group) if ctx.sequence_parallel else input
            x = total.reshape(-1, total.shape[-1])
            grad_weight = _grad_weight(
                impl, casts.get("cols"), g8, g_hp, x, weight, main_grad=ctx.main_grad, x_amax=x_amax
            )
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, None, None


def _grad_output_casts(impl: FP8LinearImpl, g8: torch.Tensor, rows: bool, cols: bool) -> dict[str, FP8Data]:
    """The output gradient's FP8 casts: ``rows`` for the input gradient, ``cols`` (transposed) for the
    weight gradient; one pass over it where the recipe casts both the same way (tensorwise)."""
    ops = impl.operands
    pow2, kw = impl.config.round_scales_to_power_of_2, dict(tp_group=impl.tp_group, kernels=impl.kernels)
    if rows and cols and ops.grad_output == ops.grad_output_for_grad_weight:
        return cast_to_fp8(g8, ops.grad_output, layouts=("rows", "cols"), pow2=pow2, **kw)[0]
    casts = {}
    if rows:
        casts.update(cast_to_fp8(g8, ops.grad_output, layouts=("rows",), pow2=pow2, **kw)[0])
    if cols:
        casts.update(cast_to_fp8(g8, ops.grad_output_for_grad_weight, layouts=("cols",), pow2=pow2, **kw)[0])
    return casts


def _reduce_grad_input(grad_input, input, sequence_parallel: bool, allreduce: bool, group):
    """Start the input gradient's TP reduction as Megatron-Core's function does (reduce-scatter over the
    sequence with SP, all-reduce for a column-parallel layer without it), overlapping the weight
    gradient's GEMM: (this rank's input gradient once ``handle`` is waited on, handle or None)."""
    if sequence_parallel:
        part = torch.empty_like(input)
        return part, dist.reduce_scatter_tensor(part, grad_input.contiguous(), group=group, async_op=True)
    if allreduce:
        return grad_input, dist.all_reduce(grad_input, group=group, async_op=True)
    return grad_input, None


def _grad_input(
    impl: FP8LinearImpl, g8: FP8Data, g_hp: torch.Tensor | None, weight: torch.Tensor, w_amax
) -> torch.Tensor:
    ops = impl.operands
    device = g8.data.device
    w_t8, _ = impl.weight(
        weight,
        ops.weight_for_grad_input,
        "cols",
        _reusable(ops.weight, ops.weight_for_grad_input, w_amax),
        device=device,
    )
    grad = impl.mm(g8, w_t8, weight.dtype, impl.config.gemm_config_grad_input)
    if g_hp is not None:
        grad.addmm_(g_hp, impl.gate_rows(weight, device))
    return grad


def _grad_weight(
    impl: FP8LinearImpl,
    g_t8: FP8Data | None,
    g8: torch.Tensor,
    g_hp: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    main_grad: torch.Tensor | None,
    x_amax,
) -> torch.Tensor:
    """The weight gradient (FP8 from ``g_t8``, the output gradient's transposed cast, or in high
    precision from ``g8`` where the recipe says so; the bf16 rows from ``g_hp``), added into ``main_grad``
    when given (then Megatron-Core's placeholder is returned), else returned in the weight's dtype."""
    ops = impl.operands
    into = impl.fp8_rows(main_grad) if main_grad is not None else None
    if g_t8 is not None:
        x_t8, _ = impl.cast(
            x, ops.input_for_grad_weight, "cols", _reusable(ops.input, ops.input_for_grad_weight, x_amax)
        )
        gemm = impl.config.gemm_config_grad_weight
        if into is not None and main_grad_is_empty(weight):
            # the step's first addition into a zeroed main_grad: the GEMM writes it in fp32, which
            # spares the bf16 product's round trip through memory and the addition's pass over main_grad
            grads = [impl.mm(g_t8, x_t8, into.dtype, gemm, out=into)]
        else:
            gw = impl.mm(g_t8, x_t8, weight.dtype, gemm)
            grads = [gw if into is None else into.add_(gw)]
    else:
        grads = [_hp_weight_grad(g8, x, into)]
    if g_hp is not None:
        grads.append(
            _hp_weight_grad(g_hp, x, main_grad[-impl.bf16_rows :] if main_grad is not None else None)
        )
    if main_grad is not None:
        return handed_to_main_grad(weight)
    return grads[0] if len(grads) == 1 else torch.cat(grads, dim=0)


def _hp_weight_grad(g: torch.Tensor, x: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor | None:
    """``gᵀ x`` in the activations' precision, accumulated inside the GEMM into ``into`` when given
    (Megatron-Core's fused wgrad kernel, as its own linears do)."""
    if into is None:
        return g.t().matmul(x)
    from megatron.core.tensor_parallel import layers

    fused = getattr(
        layers, "fused_weight_gradient_mlp_cuda", None
    )  # apex's, or relax_gdn.compat.wgrad's (CUDA)
    if fused is None:
        into.add_(g.t().matmul(x))
        return None
    (fused.wgrad_gemm_accum_fp32 if into.dtype == torch.float32 else fused.wgrad_gemm_accum_fp16)(x, g, into)
    return None


__all__ = ["FP8LinearImpl", "LinearOperands"]
