"""Megatron-Core's dense MLP with the SwiGLU activation recomputable on its own (``mlp_act``) and,
under full recompute, without the GEMM whose output no gradient reads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.mlp import MLP
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack


class _MatmulOutputUnread(TorchFunctionMode):
    """``torch.matmul`` returns zeros of its product's shape without computing it; everything else
    runs. Around a linear layer this keeps the layer's autograd node (what it saves, its backward)
    and drops only the forward GEMM."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.matmul:
            a, b = args  # plain tensors, or FP8 operands (relax_gdn.model.fp8) that report their output dtype
            return torch.zeros((*a.shape[:-1], b.shape[-1]), dtype=a.dtype, device=a.device)
        return func(*args, **(kwargs or {}))


def matmul_output_unread() -> bool:
    """Whether a :class:`_MatmulOutputUnread` is active: a linear that computes its GEMM otherwise than
    through ``torch.matmul`` (relax_gdn.model.fp8) skips it then too."""
    return any(isinstance(mode, _MatmulOutputUnread) for mode in _get_current_function_mode_stack())


class Qwen3_5MLP(MLP):
    """``MLP`` (same parameters, same forward) with two recompute options, set when the model is
    built (through :meth:`as_mlp_submodule`), so two models in one process can differ:

    * ``recompute_activation`` (``recompute.modules: mlp_act``): frees the SwiGLU output after
      linear_fc2 has used it and recomputes it from linear_fc1's output before linear_fc2's
      backward: per token and layer it keeps ``2·ffn`` (fc1's output) instead of ``4·ffn`` values
      (fc1's output, ``silu(a)`` and the product).
    * ``skip_unread_gemm`` (``recompute.skip_unused``): when full recompute re-runs this layer for
      its backward, linear_fc2's GEMM is skipped. Its output only flows into the layer's output,
      whose value backward never reads (the checkpoint holds one layer, so nothing downstream is
      recomputed from it); linear_fc2 still saves its input and weight for its own backward.
    """

    recompute_activation: bool = False  # what an MLP built without the setting does
    skip_unread_gemm: bool = False

    @classmethod
    def as_mlp_submodule(
        cls, *args, recompute_activation: bool = False, skip_unread_gemm: bool = False, **kwargs
    ) -> Qwen3_5MLP:
        """Megatron-Core's builder (a TransformerLayer's ``mlp`` submodule), told the recompute options."""
        mlp = super().as_mlp_submodule(*args, **kwargs)
        mlp.recompute_activation = recompute_activation
        mlp.skip_unread_gemm = skip_unread_gemm
        return mlp

    def _plain_swiglu(self, per_token_scale) -> bool:
        """Whether this MLP's activation is the SwiGLU :meth:`_swiglu` computes."""
        return (
            per_token_scale is None
            and self.config.gated_linear_unit
            and self.config.activation_func is F.silu
            and self.config.activation_func_clamp_value is None
        )

    def _recomputing_one_layer(self) -> bool:
        """Inside Megatron-Core's full-recompute checkpoint, re-running this layer for backward
        (the first forward runs under no_grad), with one layer per checkpoint."""
        config = self.config
        return (
            config.recompute_granularity == "full"
            and is_checkpointing()
            and torch.is_grad_enabled()
            and (config.recompute_method == "block" or config.recompute_num_layers == 1)
        )

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        plain = self._plain_swiglu(per_token_scale)
        if self.skip_unread_gemm and plain and self._recomputing_one_layer():
            fc1_out, fc1_bias = self.linear_fc1(hidden_states)
            with _MatmulOutputUnread():
                return self.linear_fc2(self._swiglu(fc1_out, fc1_bias))
        # never inside a whole-layer recompute (full, or a full layer of mixed): nothing to save there
        if not (self.recompute_activation and torch.is_grad_enabled() and plain and not is_checkpointing()):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        fc1_out, fc1_bias = self.linear_fc1(hidden_states)
        checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=None)  # fp8=False would import TE
        activation = checkpoint.checkpoint(self._swiglu, fc1_out, fc1_bias)
        output, output_bias = self.linear_fc2(activation)
        checkpoint.discard_output_and_register_recompute(output)
        return output, output_bias

    def _swiglu(self, fc1_out: torch.Tensor, fc1_bias: torch.Tensor | None) -> torch.Tensor:
        if self.config.bias_activation_fusion:  # model.fused_swiglu: what MLP.forward runs then
            return bias_swiglu_impl(fc1_out, fc1_bias)
        if fc1_bias is not None:
            fc1_out = fc1_out + fc1_bias
        a, b = torch.chunk(fc1_out, 2, dim=-1)
        return self.config.activation_func(a) * (b + self.config.glu_linear_offset)


__all__ = ["Qwen3_5MLP"]
