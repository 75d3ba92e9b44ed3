"""RMSNorm for Qwen3.5 on Megatron-Core's local (non Transformer Engine) path.

Megatron-Core's ``WrappedTorchNorm`` refuses ``layernorm_zero_centered_gamma`` and sequence
parallelism, and Qwen3.5 needs both kinds of RMSNorm (docs/design/QWEN3_5.md):

* zero-centred ``x̂ · (1 + w)``, ``w`` initialised to 0: the two norms of every layer, the final
  norm and the attention QK-norms (Megatron's ``layernorm_zero_centered_gamma``);
* plain ``x̂ · w``, ``w`` initialised to 1: the gated output norm inside GDN (HF's
  ``Qwen3_5RMSNormGated``), whatever the config flag says.

The plain path normalises in fp32 (fp64 inputs in fp64) and casts back to the input dtype, as the HF
reference does;
with ``model.fused_norms`` (:mod:`relax_gdn.model.fusion`, the default; given at build time as
``fusion``) the same formula is one fused ``rms_norm`` kernel, and the GDN layer's gated norm one
FLA kernel on CUDA (:meth:`RMSNorm.forward_gated`).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer import TransformerConfig

from relax_gdn.model.fusion import (
    Fusion,
    fused_gated_rms_norm,
    fused_rms_norm,
    gated_rms_norm_applies,
)

# A parameter attribute, set where the parameter is made: its gradient on each TP rank is a partial
# sum that must be summed over the TP group (Megatron-Core's counterpart for averages is
# ``average_gradients_across_tp_domain``; it has none for sums outside sequence parallelism).
SUM_GRAD_OVER_TP = "sum_gradients_across_tp_domain"


class RMSNorm(torch.nn.Module):
    """``x / rms(x) · scale`` over the last dimension, with ``scale = 1 + w`` (zero-centred) or
    ``w``. Built like any Megatron-Core norm: ``RMSNorm(config=..., hidden_size=..., eps=...)``.

    ``zero_centered_gamma``: ``None`` follows ``config.layernorm_zero_centered_gamma``.
    ``fusion``: whether the fused forms run (:class:`~relax_gdn.model.fusion.Fusion`), fixed here.
    ``grad_sum_group``: a group over which the weight's gradient is summed inside autograd. The GDN
    output norm needs it under tensor parallelism: its weight is shared by every value head, each
    TP rank holds other heads, and Megatron-Core's ``finalize_model_grads`` sums only norms marked
    ``sequence_parallel`` (and only with SP on) or named ``q_layernorm``/``k_layernorm``.
    ``heads_split_over_tp``: the weight is shared by heads that TP splits between ranks (the
    attention QK-norms), so each rank's gradient is a partial sum: the weight is marked
    :data:`SUM_GRAD_OVER_TP` for the optimizer that sums it (the CPU path's; on GPU Megatron-Core's
    ``finalize_model_grads`` sums these norms by their names).

    Like Transformer Engine's norms, the weight is marked ``sequence_parallel`` when SP is on, so
    ``finalize_model_grads`` sums its partial (sequence-sharded) gradient over TP — except when
    ``grad_sum_group`` already does that summing.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        zero_centered_gamma: bool | None = None,
        grad_sum_group: torch.distributed.ProcessGroup | None = None,
        fusion: Fusion = Fusion(),
        heads_split_over_tp: bool = False,
        **unused,  # persist_layer_norm, normalization, ...: accepted like Megatron-Core's norms
    ):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"relax_gdn RMSNorm built for normalization={config.normalization!r}; "
                "Qwen3.5 uses normalization='RMSNorm'"
            )
        self.hidden_size = hidden_size
        self.eps = eps
        self.fusion = fusion
        self.zero_centered_gamma = (
            config.layernorm_zero_centered_gamma if zero_centered_gamma is None else zero_centered_gamma
        )
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        # Where Megatron-Core puts its own parameters: the default device with CPU initialisation
        # (also meta, for shape-only builds), else the current GPU.
        device = None if config.use_cpu_initialization else _current_device()
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=device))
        summing = grad_sum_group is not None and grad_sum_group.size() > 1
        self.grad_sum_group = grad_sum_group if summing else None
        if grad_sum_group is None:
            self.weight.sequence_parallel = config.sequence_parallel
        if heads_split_over_tp:
            setattr(self.weight, SUM_GRAD_OVER_TP, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.grad_sum_group is not None:
            weight = _sum_grad_over(weight, self.grad_sum_group)
        if self.fusion.norms:
            return fused_rms_norm(x, weight, self.eps, self.zero_centered_gamma)
        wide = torch.promote_types(x.dtype, torch.float32)  # fp32 for bf16 / fp32 inputs, fp64 stays
        x32 = x.to(wide)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = weight.to(wide) + 1.0 if self.zero_centered_gamma else weight.to(wide)
        return (normed * scale).to(x.dtype)

    def forward_gated(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
        """``norm(x) · silu(gate)`` in one kernel (the GDN output's gated norm, ``[N, D]`` each), or
        None where that fused path does not apply (fused norms off, not CUDA, zero-centred scale):
        the caller then runs ``norm(x)`` and the gate itself."""
        if self.zero_centered_gamma or not gated_rms_norm_applies(x, self.fusion):
            return None
        weight = self.weight
        if self.grad_sum_group is not None:
            weight = _sum_grad_over(weight, self.grad_sum_group)
        return fused_gated_rms_norm(x, gate, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


@torch.compiler.disable  # Megatron-Core calls the GDN output norm inside torch.compile (jit_fuser)
def _sum_grad_over(weight: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; the gradient is all-reduced (summed) over ``group`` in backward."""
    return copy_to_tensor_model_parallel_region(weight, group=group)


def _current_device():
    # The ambient default device wins when it is meta (shape-only builds of the 9B model).
    ambient = torch.empty(0).device
    if ambient.type == "meta":
        return ambient
    return torch.cuda.current_device() if torch.cuda.is_available() else None


__all__ = ["RMSNorm", "SUM_GRAD_OVER_TP"]
