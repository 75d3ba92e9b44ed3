"""Qwen3.5 (text) on Megatron-Core 0.19.2: the configuration and the model.

One place decides the presets (:data:`PRESETS`); :func:`qwen3_5_config` turns one into a
``TransformerConfig`` and :func:`build_qwen3_5_model` builds the ``GPTModel`` from it and a frozen
:class:`Qwen3_5Options` (everything else the model is told, fixed at build) (docs/design/QWEN3_5.md):

* 3 GDN layers then 1 full-attention layer, repeated (``linear_attention_freq=4``);
* GDN layers are :class:`~relax_gdn.gdn.layer.CPGatedDeltaNet` told one frozen
  :class:`~relax_gdn.gdn.options.GDNOptions` (CP mode, route, kernels, swap transport, ...); in
  ``chunkwise`` mode the residual stream stays contiguous through each run of GDN layers
  (:mod:`relax_gdn.model.gdn_runs`, switch ``contiguous_between_layers``);
* attention has GQA, QK-norm, a sigmoid output gate and partial RoPE (64 of 256 dims, θ=1e7);
* zero-centred RMSNorm ``x̂·(1+w)`` everywhere except the GDN gated output norm (plain ``x̂·w``);
* SwiGLU MLP, no biases, untied input embedding and output layer.

The decoder's layer specs, the spec provider (Transformer Engine or Megatron-Core's own linears)
and the per-token RoPE attention: :mod:`relax_gdn.model.qwen3_5_specs`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer import TransformerConfig

from relax_gdn.choices import ModelAttentionBackend, SpecProvider
from relax_gdn.gdn.layer import check_gdn_cp_config, with_standard_strides
from relax_gdn.gdn.options import GDNOptions
from relax_gdn.model.fp8.options import FP8Options
from relax_gdn.model.fusion import (
    ChunkKernels,
    Fusion,
    embedding_into_main_grad,
    fused_output_loss,
    takes_main_grad,
)
from relax_gdn.model.lora_options import LoRAOptions, lora_problems
from relax_gdn.model.mtp import MTPInputs, MTPOptions, build_mtp_block, mtp_postprocess
from relax_gdn.model.presets import Qwen3_5Preset, qwen3_5_preset
from relax_gdn.model.qwen3_5_specs import (
    TokenRotaryEmbedding,
    mtp_attention_layer_spec,
    qwen3_5_block_spec,
    resolve_spec_provider,
    transformer_engine_import_error,
)


def qwen3_5_config(preset: str | Qwen3_5Preset = "qwen3_5_9b", **overrides) -> TransformerConfig:
    """``TransformerConfig`` of ``preset`` with ``overrides`` (any ``TransformerConfig`` field:
    ``tensor_model_parallel_size``, ``sequence_parallel``, ``bf16``/``params_dtype``,
    ``recompute_granularity``, ``num_layers``, ...). The vocabulary size and maximum sequence
    length are on the preset (:func:`qwen3_5_preset`)."""
    kwargs = dict(qwen3_5_preset(preset).config, activation_func=F.silu)  # SwiGLU
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(TransformerConfig)})
    if unknown:
        raise ValueError(f"qwen3_5_config: {unknown} are not TransformerConfig fields")
    # the provider "auto" would pick; build_qwen3_5_model re-aligns it with the provider it uses
    have_te = transformer_engine_import_error() is None
    kwargs["transformer_impl"] = "transformer_engine" if have_te else "local"
    kwargs.update(overrides)
    if kwargs.get("pipeline_model_parallel_size", 1) > 1:
        raise ValueError(_PP_MESSAGE.format(pp=kwargs["pipeline_model_parallel_size"]))
    return TransformerConfig(**kwargs)


_PP_MESSAGE = (
    "pipeline parallelism is not supported for Qwen3.5 here (pipeline_model_parallel_size={pp}); "
    "use parallel.pp=1 and scale with TP / CP / DP"
)


@dataclass(frozen=True)
class Qwen3_5Options:
    """What :func:`build_qwen3_5_model` builds besides the ``TransformerConfig`` and the process
    groups, fixed for the model's life (two models built with different options run side by side).

    Args:
        vocab_size: rows of the input embedding and the output layer (the tokenizer's vocabulary
            padded for TP, or a checkpoint's).
        max_sequence_length: the longest sequence the model is built for (``GPTModel``'s).
        gdn: what every GDN layer is told (:class:`~relax_gdn.gdn.options.GDNOptions`, e.g.
            ``RunConfig.gdn_options``).
        attention_backend: the core attention of the full-attention layers, one of
            :data:`~relax_gdn.choices.MODEL_ATTENTION_BACKENDS`.
        spec_provider: Transformer Engine or Megatron-Core's local layers, one of
            :data:`~relax_gdn.choices.SPEC_PROVIDERS`.
        rotary_percent: the share of each attention head's dimensions that RoPE rotates.
        rotary_base: RoPE's θ.
        parallel_output: the logits stay split over TP (``GPTModel``'s ``parallel_output``).
        contiguous_between_layers: chunkwise GDN runs keep the residual stream contiguous (two
            layout swaps per run of GDN layers instead of two per GDN layer;
            :mod:`relax_gdn.model.gdn_runs`).
        fusion: the fused norms, loss and embedding gradient (:class:`~relax_gdn.model.fusion.Fusion`,
            e.g. ``model.fused_*``).
        recompute_mlp_activation: the MLPs recompute their SwiGLU (``recompute.modules: mlp_act``;
            local provider; the GDN layers' own recompute is ``GDNOptions.recompute_core``).
        recompute_skips_unread_gemm: under full recompute the MLPs skip linear_fc2's GEMM when their
            layer is recomputed (``recompute.skip_unused``; :class:`~relax_gdn.model.mlp.Qwen3_5MLP`).
        mtp: the multi-token-prediction layer (:class:`~relax_gdn.model.mtp.MTPOptions`,
            ``model.mtp.*``); none by default.
        lora: LoRA adapters on the projections, every other weight frozen (``model.lora``;
            :mod:`relax_gdn.model.lora`); None: the whole model trains.
        fp8: the linear layers' GEMMs in FP8 (:class:`~relax_gdn.model.fp8.options.FP8Options`,
            ``model.fp8``); None: bf16 (or the parameters' dtype).
    """

    vocab_size: int
    max_sequence_length: int
    gdn: GDNOptions = GDNOptions()
    attention_backend: ModelAttentionBackend = "auto"
    spec_provider: SpecProvider = "auto"
    rotary_percent: float = 0.25
    rotary_base: float = 10_000_000.0
    parallel_output: bool = True
    contiguous_between_layers: bool = True
    fusion: Fusion = Fusion()
    recompute_mlp_activation: bool = False
    recompute_skips_unread_gemm: bool = False
    mtp: MTPOptions = MTPOptions()
    lora: LoRAOptions | None = None
    fp8: FP8Options | None = None

    @classmethod
    def for_preset(cls, preset: str | Qwen3_5Preset, **fields) -> Qwen3_5Options:
        """The options of ``preset``'s vocabulary, sequence length and RoPE, with ``fields``
        (any of the fields above) given or overriding them."""
        p = qwen3_5_preset(preset)
        shapes = dict(
            vocab_size=p.vocab_size,
            max_sequence_length=p.max_sequence_length,
            rotary_percent=p.rotary_percent,
            rotary_base=p.rotary_base,
        )
        return cls(**{**shapes, **fields})


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


class _VocabEmbeddingIntoMainGrad(VocabParallelEmbedding):
    """Megatron-Core's ``VocabParallelEmbedding`` (same parameters and checkpoint keys) whose weight
    gradient goes straight into the DDP ``main_grad`` at TP 1 when the model's fusion says so
    (``Fusion.embedding_grad_into_main_grad``, :func:`relax_gdn.model.fusion.embedding_into_main_grad`);
    Megatron-Core's forward otherwise (TP > 1, no DDP, no gradient)."""

    fusion: Fusion = Fusion()

    def forward(self, input_):
        weight = self.weight
        if (
            self.tp_group.size() == 1
            and getattr(self, "gtp_remat_size", 1) == 1
            and torch.is_grad_enabled()
            and weight.requires_grad
            and self.fusion.embedding_grad_into_main_grad
            and takes_main_grad(weight)
        ):
            return embedding_into_main_grad(input_, weight)
        return super().forward(input_)


class Qwen3_5Model(GPTModel):
    """``GPTModel`` whose RoPE follows ``position_ids`` token by token (see the module docstring).

    Megatron-Core's own position embedding is off (``position_embedding_type="none"``); the
    rotary angles for the micro-batch are computed once in ``_preprocess`` from ``position_ids``
    and handed to every attention layer.

    ``fusion``: whether the loss runs chunked with the output layer
    (:class:`~relax_gdn.model.fusion.Fusion` ``cross_entropy``) and whether the embedding's gradient
    goes straight into its DDP main grad (``embedding_grad_into_main_grad``), fixed here.
    """

    _mtp_inputs: MTPInputs | None = None  # during a forward given MTP inputs

    def __init__(
        self,
        config,
        transformer_layer_spec,
        vocab_size,
        max_sequence_length,
        *,
        rotary_percent: float,
        rotary_base: float,
        pg_collection: ProcessGroupCollection,
        fusion: Fusion = Fusion(),
        **kwargs,
    ):
        super().__init__(
            config=config,
            transformer_layer_spec=transformer_layer_spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            share_embeddings_and_output_weights=False,
            position_embedding_type="none",
            rotary_percent=rotary_percent,
            rotary_base=rotary_base,
            pg_collection=pg_collection,
            **kwargs,
        )
        if self.pre_process:
            # GPTModel builds its embedding itself: give the built module the subclass's forward
            # (same state, parameters and checkpoint keys), which acts at TP 1 only
            words = self.embedding.word_embeddings
            words.__class__ = _VocabEmbeddingIntoMainGrad
            words.fusion = fusion
        self.rotary_pos_emb = TokenRotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=rotary_percent,
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=rotary_base,
            use_cpu_initialization=True,  # moved to the positions' device on first use
            cp_group=pg_collection.cp,
        )
        self.fusion = fusion
        self.loss_kernels = ChunkKernels()  # the fused loss's compiled kernels (an eager fallback stays here)

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        if kwargs.get("inference_context") is not None:
            raise NotImplementedError("Qwen3.5 here is for training: GDN has no inference path")
        if position_ids is None:
            raise ValueError(
                "Qwen3.5 needs position_ids [batch, local tokens] (global positions within each "
                "document, sharded like input_ids) for its rotary embedding"
            )
        out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        # the embedding's [S, 1, H] is a transposed [1, S, H]: the first layer's projections need
        # standard strides (with_standard_strides says why)
        decoder_input = out[0] if out[0] is None else with_standard_strides(out[0])
        if (
            decoder_input is not None
            and self.config.recompute_granularity == "full"
            and torch.is_grad_enabled()
            and not decoder_input.requires_grad
        ):
            # A frozen embedding (LoRA) gives an input without grad. Megatron-Core's whole-layer
            # recompute is a reentrant autograd Function: with no input that requires grad, its output
            # does not either, and no gradient reaches the adapters inside the recomputed layers.
            decoder_input.requires_grad_(True)
        return (decoder_input, self.rotary_pos_emb.for_positions(position_ids), *out[2:])

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        *args,
        mtp_input_ids=None,
        mtp_labels=None,
        mtp_loss_mask=None,
        **kwargs,
    ):
        """``GPTModel.forward``; with ``mtp_input_ids`` (a model built with MTP) the MTP layer runs
        too and the output gains a first dimension: ``[LM, MTP]`` logits, per-token losses or
        masked loss sums (:func:`relax_gdn.model.mtp.mtp_postprocess`). ``mtp_input_ids``: each
        position's next token in its document; ``mtp_labels`` / ``mtp_loss_mask``: the MTP targets,
        given with ``labels`` / ``loss_mask``."""
        if mtp_input_ids is not None and getattr(self, "mtp", None) is None:
            raise ValueError("mtp_input_ids given to a model built without an MTP layer (Qwen3_5Options.mtp)")
        self._mtp_inputs = (
            None if mtp_input_ids is None else MTPInputs(mtp_input_ids, mtp_labels, mtp_loss_mask)
        )
        try:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        finally:
            self._mtp_inputs = None

    def _postprocess(self, hidden_states, *args, **kwargs):
        if self._mtp_inputs is not None:
            return mtp_postprocess(self, hidden_states, self._mtp_inputs, self._lm_output, kwargs)
        return self._lm_output(hidden_states, *args, **kwargs)

    def _lm_output(self, hidden_states, *args, **kwargs):
        # With labels and loss_mask the model returns Σ per-token loss × loss_mask (fp32 scalar).
        # model.fused_cross_entropy: the output layer + loss in token chunks (no full-vocabulary
        # logits); the vocabulary split of TP > 1 keeps Megatron-Core's vocab-parallel loss
        loss_mask = kwargs.get("loss_mask") if kwargs.get("labels") is not None else None
        if (
            self.fusion.cross_entropy
            and kwargs.get("labels") is not None
            and kwargs.get("output_processor") is None
            and not self.config.mtp_num_layers
            and self.pg_collection.tp.size() == 1
        ):
            kwargs["output_processor"] = functools.partial(fused_output_loss, kernels=self.loss_kernels)
            return super()._postprocess(hidden_states, *args, **kwargs)
        out = super()._postprocess(hidden_states, *args, **kwargs)
        return out if loss_mask is None else (out.float() * loss_mask).sum()


def _process_groups(pg_collection: ProcessGroupCollection | None) -> ProcessGroupCollection:
    if pg_collection is None:
        return ProcessGroupCollection.use_mpu_process_groups()
    missing = [name for name in ("tp", "cp", "pp", "embd") if getattr(pg_collection, name, None) is None]
    if missing:
        raise ValueError(
            f"pg_collection lacks {missing}: GPTModel needs tp, cp, pp (size 1) and embd groups; "
            "build them with torch.distributed.new_group or pass pg_collection=None after "
            "parallel_state.initialize_model_parallel(...)"
        )
    return pg_collection


def _ensure_global_memory_buffer() -> None:
    # Sequence-parallel all-gathers write into Megatron-Core's global buffer, which
    # initialize_model_parallel creates; with explicit process groups nobody has.
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def build_qwen3_5_model(
    config: TransformerConfig,
    options: Qwen3_5Options,
    pg_collection: ProcessGroupCollection | None = None,
) -> Qwen3_5Model:
    """The Qwen3.5 ``GPTModel`` for ``config`` (from :func:`qwen3_5_config`) built as ``options`` say.

    ``pg_collection``: explicit groups (``tp``, ``cp``, ``pp`` of size 1, ``embd``); None uses
    Megatron-Core's ``parallel_state``.
    Forward: ``model(input_ids [1, t], position_ids [1, t], None, labels=..., packed_seq_params=...)``
    returns the per-token loss ``[1, t]`` (logits ``[t, 1, vocab/TP]`` without labels); given
    ``loss_mask=[1, t]`` as well, ``Σ loss × loss_mask`` (fp32 scalar; what training calls, which lets
    the fused loss form its gradients in forward).
    """
    pgs = _process_groups(pg_collection)
    tp_size = _check_parallel_sizes(config, pgs)
    # Fail before building anything on a GDN setting that cannot work.
    check_gdn_cp_config(config, options.gdn, tp_size, options.gdn.max_cp_size or pgs.cp.size())
    if config.sequence_parallel:
        _ensure_global_memory_buffer()
    config, provider = _config_for_provider(config, options, pgs)
    lora = _checked_lora(options, provider)
    spec = qwen3_5_block_spec(config, options, tp_group=pgs.tp)
    model = Qwen3_5Model(
        config,
        spec,
        options.vocab_size,
        options.max_sequence_length,
        rotary_percent=options.rotary_percent,
        rotary_base=options.rotary_base,
        pg_collection=pgs,
        parallel_output=options.parallel_output,
        fusion=options.fusion,
    )
    if options.mtp.num_layers:  # built after the decoder: the decoder's initial weights do not depend on it
        model.mtp = build_mtp_block(
            config,
            options.mtp,
            mtp_attention_layer_spec(config, options, pgs.tp),
            pg_collection=pgs,
            fusion=options.fusion,
        )
    if lora is not None:  # after the MTP layer: its projections get adapters too
        from relax_gdn.model.lora import add_lora_adapters

        add_lora_adapters(model, lora)
    if options.fp8 is not None:  # last: the MTP layer's and the adapted layers' linears get it too
        from relax_gdn.model.fp8.plan import install_fp8

        install_fp8(
            model, options.fp8, spec_provider=provider, fused_cross_entropy=options.fusion.cross_entropy
        )
    return model


def _config_for_provider(
    config: TransformerConfig, options: Qwen3_5Options, pgs: ProcessGroupCollection
) -> tuple[TransformerConfig, str]:
    """The spec provider ``options`` resolve to and ``config`` aligned with it (its
    ``transformer_impl``; with Transformer Engine, the CP size its attention joins)."""
    provider = resolve_spec_provider(options.spec_provider)
    if options.mtp.num_layers and provider == "te":
        raise ValueError(
            "the MTP layer is built from the local specs; use spec_provider='local' (or 'auto') "
            "with Qwen3_5Options.mtp (model.mtp.num_layers > 0)"
        )
    impl = "transformer_engine" if provider == "te" else "local"
    aligned = {"transformer_impl": impl}
    if provider == "te":
        # TEDotProductAttention joins its CP group only when config.context_parallel_size > 1.
        # (Not on the local path: there Megatron-Core's config check would demand GDN heads
        # divisible by TP x CP, which only headwise needs.)
        aligned["context_parallel_size"] = pgs.cp.size()
    if any(getattr(config, k) != v for k, v in aligned.items()):
        config = dataclasses.replace(config, **aligned)
    return config, provider


def _checked_lora(options: Qwen3_5Options, provider: str) -> LoRAOptions | None:
    """The adapters ``options`` ask for (None: none), refused as ``model.lora``'s rules say."""
    lora = options.lora if options.lora is not None and options.lora.enabled else None
    if lora is not None and (
        problems := lora_problems(
            lora.rank,
            lora.alpha,
            lora.dropout,
            list(lora.modules),
            spec_provider=provider,
            fused_cross_entropy=options.fusion.cross_entropy,
        )
    ):
        raise ValueError("; ".join(problems))
    return lora


def _check_parallel_sizes(config: TransformerConfig, pgs: ProcessGroupCollection) -> int:
    """The TP size, after refusing what the model cannot run: pipeline parallelism, a config whose
    TP size is not the group's, sequence parallelism without TP."""
    pp_size = pgs.pp.size()
    if pp_size > 1 or config.pipeline_model_parallel_size > 1:
        raise ValueError(_PP_MESSAGE.format(pp=max(pp_size, config.pipeline_model_parallel_size)))
    tp_size = pgs.tp.size()
    if config.tensor_model_parallel_size != tp_size:
        raise ValueError(
            f"config.tensor_model_parallel_size={config.tensor_model_parallel_size} but the TP group has "
            f"{tp_size} ranks; pass tensor_model_parallel_size={tp_size} to qwen3_5_config"
        )
    if config.sequence_parallel and tp_size == 1:
        raise ValueError("sequence_parallel=True needs tensor parallelism (tp > 1); turn it off for tp=1")
    return tp_size


def build_qwen3_5_preset_model(
    preset: str | Qwen3_5Preset,
    config: TransformerConfig | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    **fields,
) -> Qwen3_5Model:
    """:func:`build_qwen3_5_model` with ``Qwen3_5Options.for_preset(preset, **fields)`` (the
    vocabulary, sequence length and RoPE of ``preset`` unless ``fields`` give them); ``config``
    defaults to ``qwen3_5_config(preset)``."""
    p = qwen3_5_preset(preset)
    options = Qwen3_5Options.for_preset(p, **fields)
    return build_qwen3_5_model(config if config is not None else qwen3_5_config(p), options, pg_collection)


__all__ = [
    "Qwen3_5Model",
    "Qwen3_5Options",
    "build_qwen3_5_model",
    "build_qwen3_5_preset_model",
    "qwen3_5_config",
]
