"""Qwen3.5's decoder layers on Megatron-Core 0.19.2: the spec provider, the per-token RoPE attention
and the layer specs that :func:`relax_gdn.model.qwen3_5.build_qwen3_5_model` builds the decoder from.

Spec providers: ``"te"`` takes Megatron-Core's Transformer Engine block spec for experimental
attention variants and substitutes the CP-mode GDN, the output norm and the RoPE handling;
``"local"`` (no Transformer Engine) builds the same layers from Megatron-Core's own linears, the
CP + THD attention core :class:`~relax_gdn.model.attention.CPDotProductAttention` and
:class:`~relax_gdn.model.norms.RMSNorm`. ``"auto"`` picks ``local`` (``te`` only when asked).

RoPE by per-token positions: Megatron-Core's packed (THD) RoPE derives each token's position
from ``cu_seqlens`` with ``.tolist()``/``.item()`` (host syncs in every attention layer) and its
own static CP group (wrong under dynamic CP). Here the model turns the micro-batch's
``position_ids`` (global positions within each document, already zigzag-sharded by the data side)
into per-token rotary angles once, and :class:`Qwen3_5SelfAttention` applies them token by token:
correct for any sharding, no host sync.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from relax_gdn.choices import MODEL_ATTENTION_BACKENDS, SPEC_PROVIDERS
from relax_gdn.gdn.layer import gdn_cp_layer_spec
from relax_gdn.model.attention import CPDotProductAttention
from relax_gdn.model.fusion import Fusion
from relax_gdn.model.gdn_runs import with_contiguous_gdn_runs
from relax_gdn.model.mlp import Qwen3_5MLP
from relax_gdn.model.norms import RMSNorm

if TYPE_CHECKING:  # the options are defined beside the model, which imports this module
    from relax_gdn.model.qwen3_5 import Qwen3_5Options

logger = logging.getLogger(__name__)

# The options (relax_gdn.choices): SPEC_PROVIDERS ``auto`` takes Transformer Engine specs where
# ``transformer_engine`` imports, else local specs. MODEL_ATTENTION_BACKENDS is the core attention
# of the full-attention layers: ``te`` is Transformer Engine's ``TEDotProductAttention`` (``te``
# specs only); the others are :class:`CPDotProductAttention` with that kernel; ``auto``
# is ``te`` with ``te`` specs, else ``CPDotProductAttention(backend="auto")``.

# ---------------------------------------------------------------------------------------------
# Spec provider
# ---------------------------------------------------------------------------------------------

# (request, choice) pairs already logged: the spec-provider line once per process, not once per model
_logged_choices: set[tuple[str, str]] = set()


@functools.cache
def transformer_engine_import_error() -> str | None:
    """Why ``transformer_engine`` does not import here (None when it does); asked once."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken TE install fails in many ways
        return f"{type(e).__name__}: {e}"
    return None


def resolve_spec_provider(spec_provider: str = "auto") -> str:
    """``"te"`` or ``"local"`` for the request ``spec_provider`` (one of :data:`SPEC_PROVIDERS`);
    the choice is logged once per process.

    ``auto`` is ``local`` even where Transformer Engine imports (every NGC container): the local
    specs are the path every test and benchmark of this recipe runs; TE's stays an explicit
    ``te``, and the log says it is available."""
    if spec_provider not in SPEC_PROVIDERS:
        raise ValueError(f"unknown spec_provider {spec_provider!r}: use one of {SPEC_PROVIDERS}")
    te_error = None if spec_provider == "local" else transformer_engine_import_error()
    if spec_provider == "te":
        if te_error is not None:
            raise ValueError(
                f"spec_provider='te' needs Transformer Engine, which does not import here ({te_error}); "
                "install transformer_engine or use spec_provider='local' (or 'auto')"
            )
        chosen, why = "te", "requested"
    elif spec_provider == "local":
        chosen, why = "local", "requested"
    else:
        chosen = "local"
        why = (
            "the verified path; Transformer Engine imports here, model.spec_provider=te selects its specs"
            if te_error is None
            else f"no transformer_engine ({te_error})"
        )
    if (spec_provider, chosen) not in _logged_choices:
        _logged_choices.add((spec_provider, chosen))
        logger.info("Qwen3.5 spec provider: %s (spec_provider=%r: %s)", chosen, spec_provider, why)
    return chosen


# ---------------------------------------------------------------------------------------------
# RoPE by per-token positions
# ---------------------------------------------------------------------------------------------


class TokenRotaryEmbedding(RotaryEmbedding):
    """Megatron-Core's ``RotaryEmbedding`` (same frequencies) evaluated at given positions."""

    def for_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Rotary angles ``[s, b, 1, rot_dim]`` for ``position_ids [b, s]`` (any integer positions;
        the layout Megatron-Core's ``apply_rotary_pos_emb`` takes for ``[s, b, h, d]`` input)."""
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}")
        if self.inv_freq.device != position_ids.device:  # once: built on CPU, used on the GPU
            self.inv_freq = self.inv_freq.to(position_ids.device)
        positions = position_ids.t().to(self.inv_freq.dtype)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = positions.unsqueeze(-1) * self.inv_freq  # [s, b, rot_dim / 2]
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.unsqueeze(2)


class Qwen3_5SelfAttention(SelfAttention):
    """``SelfAttention`` whose ``rotary_pos_emb`` holds per-TOKEN angles ``[s, b, 1, rot_dim]``
    (from :meth:`TokenRotaryEmbedding.for_positions`), applied to q and k right after the QK-norm,
    before any packing logic; Megatron-Core's own RoPE step is skipped."""

    _token_rotary: torch.Tensor | None = None

    def forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        *args,
        **kwargs,
    ):
        if isinstance(rotary_pos_emb, tuple):
            raise ValueError("Qwen3_5SelfAttention takes one per-token rotary tensor, not a (q, k) pair")
        self._token_rotary = rotary_pos_emb
        try:
            return super().forward(
                hidden_states, attention_mask, key_value_states, inference_context, None, *args, **kwargs
            )
        finally:
            self._token_rotary = None

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        freqs = self._token_rotary
        if freqs is None:
            return out
        if not split_qkv:
            raise ValueError("per-token RoPE needs split q/k/v; turn off fused_single_qkv_rope")
        query, key, *rest = out
        if freqs.shape[0] != query.shape[0]:
            raise ValueError(
                f"per-token rotary angles cover {freqs.shape[0]} tokens but the query has {query.shape[0]}; "
                "position_ids must be [batch, local tokens] of this rank's shard"
            )
        cp = self.pg_collection.cp  # unused by the [s, b, h, d] path; avoids a parallel_state lookup
        query = apply_rotary_pos_emb(query, freqs, config=self.config, cp_group=cp)
        key = apply_rotary_pos_emb(key, freqs, config=self.config, cp_group=cp)
        return (query, key, *rest)


# ---------------------------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------------------------


def _core_attention_spec(provider: str, attention_backend: str, te_core):
    if attention_backend not in MODEL_ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention_backend {attention_backend!r}: use one of {MODEL_ATTENTION_BACKENDS}"
        )
    if attention_backend == "te" and provider != "te":
        raise ValueError(
            "attention_backend='te' needs Transformer Engine specs (spec_provider='te'); "
            f"use one of {[b for b in MODEL_ATTENTION_BACKENDS if b != 'te']} with local specs"
        )
    if attention_backend == "te" or (attention_backend == "auto" and provider == "te"):
        return te_core
    return ModuleSpec(module=CPDotProductAttention, params={"backend": attention_backend})


def _gdn_output_norm_spec(tp_group, fusion: Fusion) -> ModuleSpec:
    # HF's Qwen3_5RMSNormGated: plain weight (init 1) whatever layernorm_zero_centered_gamma says
    return ModuleSpec(
        module=RMSNorm, params={"zero_centered_gamma": False, "grad_sum_group": tp_group, "fusion": fusion}
    )


def _local_block_spec(config, gdn_spec_for, options: Qwen3_5Options) -> TransformerBlockSubmodules:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend

    norm = ModuleSpec(module=RMSNorm, params={"fusion": options.fusion})
    # one head_dim weight shared by the heads TP splits: each TP rank's gradient is a partial sum
    qk_norm = ModuleSpec(module=RMSNorm, params={"fusion": options.fusion, "heads_split_over_tp": True})
    attention = ModuleSpec(
        module=Qwen3_5SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=_core_attention_spec("local", options.attention_backend, None),
            linear_proj=RowParallelLinear,
            q_layernorm=qk_norm,  # zero-centred per config
            k_layernorm=qk_norm,
        ),
    )
    gdn = gdn_spec_for(ColumnParallelLinear, RowParallelLinear)
    mlp = get_mlp_module_spec_for_backend(backend=LocalSpecProvider())
    mlp = functools.partial(
        Qwen3_5MLP.as_mlp_submodule,
        *mlp.args,  # same submodules
        recompute_activation=options.recompute_mlp_activation,
        skip_unread_gemm=options.recompute_skips_unread_gemm,
        **mlp.keywords,
    )
    layers = [
        ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=norm,
                self_attention=gdn if is_gdn else attention,
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=norm,
                mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        )
        for is_gdn in get_linear_attention_pattern(config)
    ]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm)


def _te_block_spec(config, gdn_spec_for, attention_backend: str) -> TransformerBlockSubmodules:
    """Megatron-Core's TE block spec with the CP-mode GDN, its plain output norm and the per-token
    RoPE attention substituted (TE norms take ``layernorm_zero_centered_gamma`` from the config)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )

    block = get_transformer_block_with_experimental_attention_variant_spec(config)
    layers = []
    for layer in block.layer_specs:
        attn = layer.submodules.self_attention
        if isinstance(attn.module, type) and issubclass(attn.module, GatedDeltaNet):
            new_attn = gdn_spec_for(attn.submodules.in_proj, attn.submodules.out_proj)
            new_attn.metainfo = dict(attn.metainfo)
        elif isinstance(attn.module, type) and issubclass(attn.module, SelfAttention):
            core = _core_attention_spec("te", attention_backend, attn.submodules.core_attention)
            new_attn = ModuleSpec(
                module=Qwen3_5SelfAttention,
                params=dict(attn.params),
                submodules=dataclasses.replace(attn.submodules, core_attention=core),
                metainfo=dict(attn.metainfo),
            )
        else:
            raise ValueError(f"unexpected attention module {attn.module} in Megatron-Core's TE block spec")
        layers.append(
            dataclasses.replace(
                layer, submodules=dataclasses.replace(layer.submodules, self_attention=new_attn)
            )
        )
    return dataclasses.replace(block, layer_specs=layers)


def qwen3_5_block_spec(
    config: TransformerConfig,
    options: Qwen3_5Options,
    tp_group: torch.distributed.ProcessGroup | None = None,
) -> TransformerBlockSubmodules:
    """Layer specs of the decoder (GDN : attention = 3 : 1) and its final norm, as ``options`` say
    (its layer fields: ``gdn``, ``attention_backend``, ``spec_provider``,
    ``contiguous_between_layers``, ``fusion``, ``recompute_*``).

    ``tp_group``: the tensor-parallel group (for the GDN output norm's gradient sum; None reads
    Megatron-Core's ``parallel_state``). ``config.transformer_impl`` must match the provider
    (:func:`build_qwen3_5_model` sees to it).
    """
    provider = resolve_spec_provider(options.spec_provider)
    if tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()

    def gdn_spec_for(in_proj, out_proj) -> ModuleSpec:
        out_norm = _gdn_output_norm_spec(tp_group, options.fusion)
        return gdn_cp_layer_spec(options.gdn, in_proj=in_proj, out_norm=out_norm, out_proj=out_proj)

    if provider == "te":
        block = _te_block_spec(config, gdn_spec_for, options.attention_backend)
    else:
        block = _local_block_spec(config, gdn_spec_for, options)
    return with_contiguous_gdn_runs(
        block,
        contiguous_between_layers=options.contiguous_between_layers,
        cp_mode=options.gdn.cp_mode,
        sequence_parallel=config.sequence_parallel,
    )


def mtp_attention_layer_spec(config: TransformerConfig, options: Qwen3_5Options, tp_group) -> ModuleSpec:
    """The decoder's gated-attention layer spec, for the MTP layer (local specs). Its MLP never skips
    linear_fc2 under recompute: the MTP layer's checkpoint ends with a norm that reads the layer's output."""
    plain = dataclasses.replace(options, recompute_skips_unread_gemm=False)
    for layer in qwen3_5_block_spec(config, plain, tp_group=tp_group).layer_specs:
        if layer.submodules.self_attention.module is Qwen3_5SelfAttention:
            return layer
    raise ValueError("the MTP layer is a gated-attention layer, and this layer pattern has none to copy")


__all__ = [
    "Qwen3_5SelfAttention",
    "TokenRotaryEmbedding",
    "mtp_attention_layer_spec",
    "qwen3_5_block_spec",
    "resolve_spec_provider",
    "transformer_engine_import_error",
]
