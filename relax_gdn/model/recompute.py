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
keeps everything. ``mixed`` (``recompute.granularity=mixed``) sits between selective and full:
the first ``recompute.full_layers`` layers are recomputed whole (Megatron-Core's ``block``
method, one layer per checkpoint), the others run selective with ``recompute.modules``. Per token
and layer, full keeps the layer's input (8 KiB at the 9B's width) and selective ≈ 125 KiB (the
memory model's figure, measured at 32k-128k tokens), so each layer moved to full saves ≈ 117 KiB
for one more forward of that layer; the fewest full layers that fit the GPU
(``recompute.full_layers=null``) are the memory model's choice
(:func:`relax_gdn.train.memory.fewest_full_layers`). Per layer, that exchange is about as good as
any finer split here: dropping linear_fc1's output (49 KiB) costs that GEMM again (46 % of the
layer's forward GEMM FLOPs), full recompute saves ≈ 117 KiB for ≈ 77 %.
The selective pieces never nest inside a whole-layer recompute: ``mlp_act`` and ``gdn_core`` run
only outside Megatron-Core's checkpoint (``is_checkpointing()``), and ``core_attn`` is switched on
per layer after the model is built (:func:`apply_mixed_recompute`; Megatron-Core decides it from
the config, whose granularity is ``full`` here). With ``recompute.skip_unused`` (default on) full recompute leaves out the work no
gradient reads: the last layer is not recomputed (its backward follows its forward at once:
Megatron-Core's ``block`` method over all layers but the last; the layer's activations live at
that moment anyway, being recomputed), and a recomputed layer skips the GEMM of its MLP's
linear_fc2, whose output only feeds the layer's output, which backward never reads
(:class:`relax_gdn.model.mlp.Qwen3_5MLP`). About a quarter of a layer's forward GEMM FLOPs.
"""

from __future__ import annotations

from typing import Any

from relax_gdn.choices import RECOMPUTE_MODULES as SELECTIVE_MODULES

MEGATRON_MODULES = ("core_attn",)  # what TransformerConfig.recompute_modules gets


def check_recompute_modules(modules) -> None:
    unknown = sorted(set(modules) - set(SELECTIVE_MODULES))
    if unknown:
        raise ValueError(f"recompute.modules: unknown {unknown}; choose from {list(SELECTIVE_MODULES)}")


def recompute_config_fields(
    granularity: str,
    modules=SELECTIVE_MODULES,
    *,
    skip_unused: bool = False,
    num_layers: int | None = None,
    full_layers: int | None = None,
) -> dict[str, Any]:
    """``recompute.granularity`` (+ ``recompute.modules``, ``recompute.skip_unused`` with the model's
    ``num_layers``, ``recompute.full_layers`` resolved to a number for ``mixed``) -> TransformerConfig
    fields."""
    if granularity == "mixed":
        if full_layers is None or full_layers < 0:
            raise ValueError(
                f"recompute.granularity=mixed needs full_layers >= 0 resolved, got {full_layers!r}"
            )
        if not full_layers:  # nothing recomputed whole: plain selective
            return recompute_config_fields("selective", modules)
        # "block": the first full_layers layers are checkpointed, one per unit; the others run plain
        return dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=full_layers)
    if granularity == "full":  # every layer recomputed as a whole (what all_gather CP needs)
        if skip_unused and num_layers is not None and num_layers > 1:
            # "block": the first num_layers - 1 layers are checkpointed, one per unit; the last is kept
            return dict(
                recompute_granularity="full", recompute_method="block", recompute_num_layers=num_layers - 1
            )
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if granularity == "selective":
        check_recompute_modules(modules)
        megatron = [m for m in modules if m in MEGATRON_MODULES]
        # Megatron-Core treats an empty list as "core_attn"; with none of its modules asked for,
        # its selective machinery stays off and only ours runs
        return (
            dict(recompute_granularity="selective", recompute_modules=megatron)
            if megatron
            else dict(recompute_granularity=None)
        )
    return dict(recompute_granularity=None)


def recomputes(granularity: str, modules, module: str) -> bool:
    """Whether this package's own ``module`` (``mlp_act``, ``gdn_core``: pieces Megatron-Core does
    not have) is recomputed; the model builder tells the MLPs and GDN layers (under ``mixed`` every
    one: inside a whole-layer recompute they stand aside by themselves)."""
    return granularity in ("selective", "mixed") and module in modules


def mtp_recompute(granularity: str, modules, *, skip_unused: bool) -> dict[str, bool]:
    """How the multi-token-prediction layer (after the last decoder layer) is recomputed, as
    :class:`relax_gdn.model.mtp.MTPOptions` fields: like the decoder's last layer under ``full``
    (kept whole with ``recompute.skip_unused``: its backward follows its forward; else recomputed
    whole), like the selective layers under ``selective`` and ``mixed`` (``core_attn``; ``mlp_act`` is
    the MLP's own, told by the model builder), not at all under ``none``."""
    whole = granularity == "full" and not skip_unused
    core_attention = granularity in ("selective", "mixed") and "core_attn" in modules
    return {"recompute_whole_layer": whole, "recompute_core_attention": core_attention}


def apply_mixed_recompute(model, full_layers: int, modules) -> int:
    """``mixed`` with ``full_layers`` > 0: Megatron-Core's core-attention recompute (``core_attn``)
    on the attention layers that are not recomputed whole (it decides it from the config, whose
    granularity is ``full`` there). Returns how many layers were switched on."""
    from megatron.core.transformer.attention import Attention  # here: this module stays torch-free

    if not full_layers or "core_attn" not in modules:
        return 0
    switched = 0
    for layer in model.decoder.layers:
        attention = layer.self_attention
        if layer.layer_number - 1 >= full_layers and isinstance(attention, Attention):
            attention.checkpoint_core_attention = True
            switched += 1
    return switched


__all__ = [
    "MEGATRON_MODULES",
    "SELECTIVE_MODULES",
    "apply_mixed_recompute",
    "check_recompute_modules",
    "mtp_recompute",
    "recompute_config_fields",
    "recomputes",
]
