"""Selective activation recompute for Qwen3.5: what ``recompute.granularity=selective`` recomputes.

The rule: recompute the cheap, activation-heavy parts and keep every GEMM output. The names in
``recompute.modules`` (default: all of :data:`SELECTIVE_MODULES`):

``core_attn``  Megatron-Core: the full-attention layers' core attention (varlen flash attention),
               recomputed from q/k/v.
``mlp_act``    the SwiGLU ``silu(a) · b``: only linear_fc1's output is kept; the activation (the
               input linear_fc2 saves for its weight gradient) is freed and recomputed before
               linear_fc2's backward (:class:`relax_gdn.model.mlp.Qwen3_5MLP`).
``gdn_core``   every GDN layer's conv -> gates -> scan -> gated norm, recomputed from the in_proj
               output (``CPGatedDeltaNet.recompute_core``, from ``GDNOptions.recompute_core``).

Megatron-Core's ``layernorm`` module is not offered: in 0.19.2 its output-discarding checkpoint
(``CheckpointWithoutOutput()``, fp8 default False but ``self.fp8 = fp8 is not None``) reaches for
Transformer Engine's FP8 state and fails without it; ``mlp_act`` builds the same checkpoint with
``fp8=None``. The two norm outputs it would free are 4 bytes per hidden unit, token and layer
(≈ 4 GiB at 8k tokens for the 9B).

``full`` recomputes whole layers from their inputs (least memory, one extra forward); ``none``
keeps everything.
"""

from __future__ import annotations

from typing import Any

from relax_gdn.choices import RECOMPUTE_MODULES as SELECTIVE_MODULES

MEGATRON_MODULES = ("core_attn",)  # what TransformerConfig.recompute_modules gets


def check_recompute_modules(modules) -> None:
    unknown = sorted(set(modules) - set(SELECTIVE_MODULES))
    if unknown:
        raise ValueError(f"recompute.modules: unknown {unknown}; choose from {list(SELECTIVE_MODULES)}")


def recompute_config_fields(granularity: str, modules=SELECTIVE_MODULES) -> dict[str, Any]:
    """``recompute.granularity`` (+ ``recompute.modules``) -> TransformerConfig fields."""
    if granularity == "full":  # every layer recomputed as a whole (what all_gather CP needs)
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if granularity == "selective":
        check_recompute_modules(modules)
        megatron = [m for m in modules if m in MEGATRON_MODULES]
        # Megatron-Core treats an empty list as "core_attn"; with none of its modules asked for,
        # its selective machinery stays off and only ours runs
        return dict(recompute_granularity="selective", recompute_modules=megatron) if megatron else \
            dict(recompute_granularity=None)
    return dict(recompute_granularity=None)


def recomputes(granularity: str, modules, module: str) -> bool:
    """Whether this package's own ``module`` (``mlp_act``, ``gdn_core``: pieces Megatron-Core does
    not have) is recomputed; the model builder tells the MLPs and GDN layers."""
    return granularity == "selective" and module in modules


__all__ = ["MEGATRON_MODULES", "SELECTIVE_MODULES", "check_recompute_modules", "recompute_config_fields",
           "recomputes"]
