"""Qwen3.5's multi-token prediction (MTP) layer, trained beside the language-model head.

Built on Megatron-Core's :class:`~megatron.core.transformer.multi_token_prediction.MultiTokenPredictionBlock`
(its layer, spec and checkpoint keys), with Qwen3.5's pieces: the layer inside is the model's own
gated-attention ``TransformerLayer`` spec, the three norms are the model's zero-centred RMSNorm.
What one MTP layer computes at position ``i`` of a document (the published checkpoints' layout,
``mtp.*``, as vLLM's ``Qwen3_5MultiTokenPredictor`` and transformers' ``MtpModel`` read it;
:mod:`relax_gdn.model.mtp_reference` writes it out in plain torch):

    e_i = embedding(token i+1)                  the model's input embedding, shared
    x_i = fc([norm_e(e_i), norm_h(h_i)])        h_i: the decoder's output (after its final norm);
                                                embedding first (``mtp.fc`` [h, 2h])
    y_i = norm(attention layer(x))_i            ``mtp.layers.0.*``, ``mtp.norm``
    logits_i = output_layer(y_i)                the model's output layer, shared: predicts token i+2

The shift by one is the data's, not the model's: the caller gives each position's next token
(``mtp_input_ids``: the micro-batch's ``labels``, the next token of the same document and the
padding id after its last) and the MTP targets and loss mask (``relax_gdn.data``, built on the
whole packed sequence before the CP split). Megatron-Core's own layer rolls the ids inside the
forward, with point-to-point messages between CP ranks and a host sync per document; here a CP
rank's shard already holds everything it needs, which is what makes every CP mode, dynamic CP
and sequence parallelism right without a collective of its own. The attention inside runs on the
decoder's zigzag shard like every attention layer of the model (its RoPE angles are the
decoder's: positions shift by one for every token of a document alike, which RoPE does not see).

Megatron-Core's ``GPTModel`` would compute the MTP loss itself when ``config.mtp_num_layers`` is
set (rolling labels, a process-wide loss tracker, CUDA-only logging); the model keeps that unset
and gives the block a config of its own (:func:`mtp_config`), and
:meth:`relax_gdn.model.qwen3_5.Qwen3_5Model._postprocess` computes both losses
(:func:`mtp_postprocess`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import make_viewless_tensor

from relax_gdn.model.fusion import Fusion
from relax_gdn.model.norms import RMSNorm

# Qwen3.5's Hugging Face layout holds one MTP layer (one ``mtp.fc``, one ``mtp.norm``); Megatron-Core's
# layers of depth k > 1 each have their own projection and norms, which no published layout names.
MAX_MTP_LAYERS = 1


@dataclass(frozen=True)
class MTPOptions:
    """The multi-token-prediction layers a model is built with (``model.mtp.*``), fixed at build.

    Args:
        num_layers: 0: none; 1: Qwen3.5's one MTP layer.
        recompute_whole_layer: the MTP layer is recomputed whole in backward (full recompute
            without ``recompute.skip_unused``; :func:`relax_gdn.model.recompute.mtp_recompute`).
        recompute_core_attention: its core attention is recomputed (``core_attn`` under selective
            or mixed recompute).
    """

    num_layers: int = 0
    recompute_whole_layer: bool = False
    recompute_core_attention: bool = False

    def __post_init__(self):
        if not 0 <= self.num_layers <= MAX_MTP_LAYERS:
            raise ValueError(
                f"MTPOptions.num_layers={self.num_layers}: Qwen3.5 has at most {MAX_MTP_LAYERS} MTP layer "
                "(mtp.fc, mtp.layers.0, mtp.norm); use 0 or 1 (model.mtp.num_layers)"
            )


@dataclass(frozen=True)
class MTPInputs:
    """What a forward with the MTP layer is given besides the decoder's inputs (this rank's shard,
    ``[batch, local tokens]`` each, sharded like ``input_ids``)."""

    input_ids: torch.Tensor  # the next token of each position in its document (the padding id where none)
    labels: torch.Tensor | None  # the token after that one (None: logits only)
    loss_mask: torch.Tensor | None  # where the MTP loss counts (None: per-token losses)


class Qwen3_5MTPLayer(MultiTokenPredictionLayer):
    """Megatron-Core's MTP layer (same parameters, forward and checkpoint keys) given the next
    token of each position: it embeds ``input_ids`` as they are instead of rolling them over the
    sequence and the CP ranks (module docstring)."""

    def _get_embeddings(
        self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None, padding_mask=None
    ):
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        return input_ids, position_ids, padding_mask, decoder_input, hidden_states


def mtp_config(config: TransformerConfig, options: MTPOptions) -> TransformerConfig:
    """The MTP block's config: the model's with ``mtp_num_layers`` and the MTP layer's own
    recompute (the model's config keeps ``mtp_num_layers`` unset: module docstring)."""
    if options.recompute_whole_layer:
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif options.recompute_core_attention:
        recompute = dict(
            recompute_granularity="selective",
            recompute_method=None,
            recompute_num_layers=None,
            recompute_modules=["core_attn"],
        )
    else:
        recompute = dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    return dataclasses.replace(config, mtp_num_layers=options.num_layers, **recompute)


def mtp_block_spec(
    attention_layer: ModuleSpec, num_layers: int, fusion: Fusion
) -> MultiTokenPredictionBlockSubmodules:
    """``num_layers`` MTP layers around ``attention_layer`` (the model's gated-attention
    ``TransformerLayer`` spec) with the model's RMSNorm as the three norms and a column-parallel
    ``eh_proj`` (HF ``mtp.fc``), as Megatron-Core's local MTP spec builds them."""
    norm = functools.partial(RMSNorm, fusion=fusion)
    layer = ModuleSpec(
        module=Qwen3_5MTPLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm,
            hnorm=norm,
            layer_norm=norm,
            eh_proj=ColumnParallelLinear,
            mtp_model_layer=attention_layer,
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * num_layers)


def build_mtp_block(
    config: TransformerConfig,
    options: MTPOptions,
    attention_layer: ModuleSpec,
    *,
    pg_collection,
    fusion: Fusion,
) -> MultiTokenPredictionBlock:
    """The model's ``mtp`` module (Megatron-Core's block of :class:`Qwen3_5MTPLayer`)."""
    if not options.num_layers:
        raise ValueError(
            "build_mtp_block with MTPOptions.num_layers=0: a model without MTP has no mtp module"
        )
    return MultiTokenPredictionBlock(
        config=mtp_config(config, options),
        spec=mtp_block_spec(attention_layer, options.num_layers, fusion),
        pg_collection=pg_collection,
    )


def check_mtp_inputs(inputs: MTPInputs, labels, loss_mask) -> None:
    """The MTP targets come with the model's: labels with labels, a loss mask with a loss mask."""
    if (labels is None) != (inputs.labels is None):
        raise ValueError(
            "mtp_labels must be given exactly when labels are (the MTP loss and the LM loss go together)"
        )
    if labels is not None and (loss_mask is None) != (inputs.loss_mask is None):
        raise ValueError(
            "mtp_loss_mask must be given exactly when loss_mask is (summed losses) and not otherwise"
        )


def mtp_postprocess(
    model, hidden_states: torch.Tensor, inputs: MTPInputs, lm_output, kwargs: dict
) -> torch.Tensor:
    """The language-model output and the MTP layers' outputs, stacked on a new first dimension
    (``[1 + num_layers, ...]``): logits without labels, per-token losses with labels, the masked
    loss sums (fp32) with loss masks. ``lm_output(hidden, **kwargs)`` is the model's output layer
    and loss on one set of hidden states; ``kwargs`` are ``GPTModel._postprocess``'s."""
    check_mtp_inputs(inputs, kwargs.get("labels"), kwargs.get("loss_mask"))
    stacked = model.mtp(
        input_ids=inputs.input_ids,
        position_ids=kwargs.get("position_ids"),
        hidden_states=hidden_states,
        attention_mask=kwargs.get("attention_mask"),
        padding_mask=kwargs.get("padding_mask"),
        rotary_pos_emb=kwargs.get("rotary_pos_emb"),
        rotary_pos_cos=kwargs.get("rotary_pos_cos"),
        rotary_pos_sin=kwargs.get("rotary_pos_sin"),
        packed_seq_params=kwargs.get("packed_seq_params"),
        sequence_len_offset=kwargs.get("sequence_len_offset"),
        embedding=model.embedding,
    )
    depths = stacked.chunk(1 + len(model.mtp.layers), dim=0)[1:]  # the block returns [decoder; mtp 1; ...]
    mtp_kwargs = {**kwargs, "labels": inputs.labels, "loss_mask": inputs.loss_mask}
    outputs = [lm_output(hidden_states, **kwargs)] + [lm_output(h, **mtp_kwargs) for h in depths]
    return torch.stack(outputs)


__all__ = [
    "MAX_MTP_LAYERS",
    "MTPInputs",
    "MTPOptions",
    "Qwen3_5MTPLayer",
    "build_mtp_block",
    "check_mtp_inputs",
    "mtp_block_spec",
    "mtp_config",
    "mtp_postprocess",
]
