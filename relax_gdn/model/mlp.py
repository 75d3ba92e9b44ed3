"""Megatron-Core's dense MLP with the SwiGLU activation recomputable on its own (``mlp_act``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.transformer.mlp import MLP


class Qwen3_5MLP(MLP):
    """``MLP`` (same parameters, same forward) that, with ``recompute_activation`` on, frees the
    SwiGLU output after linear_fc2 has used it and recomputes it from linear_fc1's output before
    linear_fc2's backward: per token and layer it keeps ``2·ffn`` (fc1's output) instead of
    ``4·ffn`` values (fc1's output, ``silu(a)`` and the product). Set when the model is built
    (``recompute.modules: mlp_act``, through :meth:`as_mlp_submodule`), so two models in one
    process can differ."""

    recompute_activation: bool = False  # what an MLP built without the setting does

    @classmethod
    def as_mlp_submodule(cls, *args, recompute_activation: bool = False, **kwargs) -> "Qwen3_5MLP":
        """Megatron-Core's builder (a TransformerLayer's ``mlp`` submodule), told whether to
        recompute the activation."""
        mlp = super().as_mlp_submodule(*args, **kwargs)
        mlp.recompute_activation = recompute_activation
        return mlp

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        if not (self.recompute_activation and torch.is_grad_enabled() and per_token_scale is None
                and self.config.gated_linear_unit and self.config.activation_func is F.silu
                and self.config.activation_func_clamp_value is None
                and self.config.recompute_granularity != "full"):
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
