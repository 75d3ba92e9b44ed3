"""The mapping plan: one :class:`TensorRule` per Megatron-Core tensor, saying which HF tensors
it is made of, how to merge them (and split back), and how tensor parallelism cuts it
(:class:`TPSplit`, :func:`shard_for_tp`). Pure shape arithmetic on :class:`Qwen3_5Dims`.


Layout facts (checked against transformers 5.23 ``modeling_qwen3_5`` and Megatron-Core 0.19.2):

* Attention. HF ``q_proj`` emits, per query head, ``[query (D), gate (D)]``; ``k_proj``/``v_proj``
  one D block per KV head. Megatron's ``linear_qkv`` with ``attention_output_gate`` is grouped by
  KV head (query group): ``[q of its heads, gate of its heads, k, v]`` per group. Column-parallel
  TP takes contiguous rows of that grouped weight (whole groups per rank when groups >= TP; when
  groups < TP Megatron all-gathers the rows and slices, so contiguous rows are still right).
* GDN. HF ``in_proj_qkv`` (q, k, v), ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` stack into
  Megatron's ``in_proj`` in that order; TP cuts each of the six sections by heads. ``conv1d`` runs
  over the q, k, v channels (same order in both), cut per section; ``A_log``/``dt_bias`` by heads.
  Value head j reads key head ``j // (HV/H)`` in both (``repeat_interleave``), so heads need no
  reordering.
* Norms. HF's decoder/final/QK norms compute ``x_hat * (1 + w)`` (w init 0), the GDN gated norm
  ``x_hat * w`` (w init 1). Megatron's ``layernorm_zero_centered_gamma`` norms store the same
  ``w`` as HF's ``(1 + w)`` ones; what the model's GDN ``out_norm`` does depends on the spec that
  built it, so the loader PROBES each norm kind of the model (:func:`norm_conventions_of`) and
  the plan adds the difference (0 when the conventions agree, making import/export exact copies).
* MLP: ``linear_fc1 = [gate_proj; up_proj]`` (SwiGLU's first half is activated), cut per half.
* Embedding rows / ``output_layer`` rows are cut by vocabulary; a model vocabulary padded beyond
  the checkpoint's (Megatron pads to a TP multiple) is zero-filled on import and trimmed on export.
* MTP (``Qwen3_5Dims.mtp_num_layers``; vLLM's ``Qwen3_5MultiTokenPredictor`` reads the same names):
  Megatron-Core's ``eh_proj`` is ``mtp.fc`` (``[h, 2h]``, its input ``[embedding, hidden]`` on both
  sides; column-parallel), ``enorm`` / ``hnorm`` / ``final_layernorm`` are ``mtp.pre_fc_norm_embedding``
  / ``mtp.pre_fc_norm_hidden`` / ``mtp.norm`` (zero-centred, as the decoder's), and the
  gated-attention layer inside (``mtp_model_layer``) is ``mtp.layers.<i>``, mapped like a decoder
  attention layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from relax_gdn.model.hf_checkpoint.dims import (
    FULL_ATTENTION,
    HF_NORM_CONVENTIONS,
    LINEAR_ATTENTION,
    Qwen3_5Dims,
)


@dataclass(frozen=True)
class TPSplit:
    """How tensor parallelism cuts a full tensor: ``dim=None`` replicated; otherwise every section
    of ``sections`` (sizes along ``dim``; ``None``: one section, the whole dim) is cut into TP
    equal contiguous parts and rank r holds part r of each section, concatenated."""

    dim: int | None
    sections: tuple[int, ...] | None = None


REPLICATED = TPSplit(None)
COLUMN = TPSplit(0)  # column-parallel weight: output rows
ROW = TPSplit(1)  # row-parallel weight: input columns


@dataclass(frozen=True)
class TensorRule:
    """One Megatron-Core tensor and the HF tensors it is made of."""

    mcore: str
    hf: tuple[str, ...]  # text-layout names (``model.layers.3.self_attn.q_proj.weight``, ...)
    hf_shapes: tuple[tuple[int, ...], ...]
    mcore_shape: tuple[int, ...]  # full (TP = 1) shape
    merge: Callable[[list[torch.Tensor]], torch.Tensor]
    split: Callable[[torch.Tensor], list[torch.Tensor]]
    tp: TPSplit


def conversion_plan(dims: Qwen3_5Dims) -> list[TensorRule]:
    """Every tensor of the Megatron-Core model (local module names, unfused norms), in order: the
    embedding, the decoder layers, the final norm, the output layer, the MTP layers."""
    d, hidden = dims, dims.hidden_size
    plan = [_vocab_rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", d)]
    for i, kind in enumerate(d.layer_types):
        plan += _layer_rules(kind, f"model.layers.{i}.", f"decoder.layers.{i}.", d)
    plan.append(
        _norm_rule(
            "decoder.final_layernorm.weight", "model.norm.weight", hidden, True, d.norms.hidden_one_plus
        )
    )
    if not d.tie_word_embeddings:
        source = "model.embed_tokens.weight" if d.lm_head_from_embedding else "lm_head.weight"
        plan.append(_vocab_rule("output_layer.weight", source, d))
    for i in range(d.mtp_num_layers):
        plan += _mtp_rules(i, d)
    return plan


def _layer_rules(kind: str, hf: str, mc: str, d: Qwen3_5Dims) -> list[TensorRule]:
    """One decoder layer (``kind``: GDN or full attention) under the prefixes ``hf`` / ``mc``."""
    hidden, norms = d.hidden_size, d.norms
    rules = [
        _norm_rule(
            f"{mc}input_layernorm.weight",
            f"{hf}input_layernorm.weight",
            hidden,
            HF_NORM_CONVENTIONS.hidden_one_plus,
            norms.hidden_one_plus,
        )
    ]
    rules += (
        _gdn_rules(f"{hf}linear_attn.", f"{mc}self_attention.", d)
        if kind == LINEAR_ATTENTION
        else _attention_rules(f"{hf}self_attn.", f"{mc}self_attention.", d)
    )
    return rules + [
        _norm_rule(
            f"{mc}pre_mlp_layernorm.weight",
            f"{hf}post_attention_layernorm.weight",
            hidden,
            HF_NORM_CONVENTIONS.hidden_one_plus,
            norms.hidden_one_plus,
        ),
        _stack_rule(
            f"{mc}mlp.linear_fc1.weight",
            (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"),
            (d.ffn_hidden_size, d.ffn_hidden_size),
            hidden,
        ),
        _copy_rule(
            f"{mc}mlp.linear_fc2.weight", f"{hf}mlp.down_proj.weight", (hidden, d.ffn_hidden_size), ROW
        ),
    ]


def _gdn_rules(a: str, m: str, d: Qwen3_5Dims) -> list[TensorRule]:
    hidden = d.hidden_size
    qk, v, hv = (
        d.linear_num_key_heads * d.linear_key_head_dim,
        d.linear_num_value_heads * d.linear_value_head_dim,
        d.linear_num_value_heads,
    )
    return [
        _stack_rule(
            f"{m}in_proj.weight",
            tuple(f"{a}{n}.weight" for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
            (2 * qk + v, v, hv, hv),
            hidden,
            tp_sections=(qk, qk, v, v, hv, hv),
        ),
        _copy_rule(
            f"{m}conv1d.weight",
            f"{a}conv1d.weight",
            (2 * qk + v, 1, d.linear_conv_kernel_dim),
            TPSplit(0, (qk, qk, v)),
        ),
        _copy_rule(f"{m}dt_bias", f"{a}dt_bias", (hv,), COLUMN),
        _copy_rule(f"{m}A_log", f"{a}A_log", (hv,), COLUMN),
        _norm_rule(
            f"{m}out_norm.weight",
            f"{a}norm.weight",
            d.linear_value_head_dim,
            HF_NORM_CONVENTIONS.gdn_out_one_plus,
            d.norms.gdn_out_one_plus,
        ),
        _copy_rule(f"{m}out_proj.weight", f"{a}out_proj.weight", (hidden, v), ROW),
    ]


def _attention_rules(a: str, m: str, d: Qwen3_5Dims) -> list[TensorRule]:
    qk_norm = (HF_NORM_CONVENTIONS.qk_one_plus, d.norms.qk_one_plus)
    return [
        _gated_qkv_rule(f"{m}linear_qkv.weight", a, d),
        _norm_rule(f"{m}q_layernorm.weight", f"{a}q_norm.weight", d.head_dim, *qk_norm),
        _norm_rule(f"{m}k_layernorm.weight", f"{a}k_norm.weight", d.head_dim, *qk_norm),
        _copy_rule(
            f"{m}linear_proj.weight",
            f"{a}o_proj.weight",
            (d.hidden_size, d.num_attention_heads * d.head_dim),
            ROW,
        ),
    ]


# Megatron-Core's MTP layer -> Qwen3.5's ``mtp.*`` (vLLM ``Qwen3_5MultiTokenPredictor``): the input
# fusion ``eh_proj`` is ``mtp.fc`` (input [embedding, hidden] on both sides), its norms the
# ``pre_fc_norm_*`` ones, the gated-attention layer inside ``mtp.layers.<i>``, the norm before the
# shared output layer ``mtp.norm``.
_MTP_NORMS = (
    ("enorm", "pre_fc_norm_embedding"),
    ("hnorm", "pre_fc_norm_hidden"),
    ("final_layernorm", "norm"),
)


def _mtp_rules(i: int, d: Qwen3_5Dims) -> list[TensorRule]:
    """MTP layer ``i`` (Qwen3.5 has one; its HF names hold one ``fc`` and ``norm`` per layer)."""
    hidden, mc = d.hidden_size, f"mtp.layers.{i}."
    rules = [_copy_rule(f"{mc}eh_proj.weight", "mtp.fc.weight", (hidden, 2 * hidden), COLUMN)]
    rules += [
        _norm_rule(
            f"{mc}{ours}.weight",
            f"mtp.{theirs}.weight",
            hidden,
            HF_NORM_CONVENTIONS.hidden_one_plus,
            d.norms.hidden_one_plus,
        )
        for ours, theirs in _MTP_NORMS
    ]
    return rules + _layer_rules(FULL_ATTENTION, f"mtp.layers.{i}.", f"{mc}mtp_model_layer.", d)


def _copy_rule(mcore: str, hf: str, shape: tuple[int, ...], tp: TPSplit) -> TensorRule:
    return TensorRule(mcore, (hf,), (shape,), shape, lambda ts: ts[0], lambda t: [t], tp)


def _norm_rule(mcore: str, hf: str, width: int, hf_one_plus: bool, mcore_one_plus: bool) -> TensorRule:
    """A norm weight; the ``*_one_plus`` flags say whether each side computes ``x_hat * (1 + w)``."""
    # x_hat * (a + w_hf) == x_hat * (b + w_mcore)  =>  w_mcore = w_hf + a - b
    offset = int(hf_one_plus) - int(mcore_one_plus)
    if offset == 0:
        return _copy_rule(mcore, hf, (width,), REPLICATED)
    return TensorRule(
        mcore, (hf,), ((width,),), (width,), lambda ts: ts[0] + offset, lambda t: [t - offset], REPLICATED
    )


def _stack_rule(
    mcore: str,
    hf: tuple[str, ...],
    rows: tuple[int, ...],
    cols: int,
    tp_sections: tuple[int, ...] | None = None,
) -> TensorRule:
    """HF weights stacked along rows into one column-parallel weight. TP cuts each of
    ``tp_sections`` (default: each stacked weight) on its own: a fused HF weight such as
    ``in_proj_qkv`` holds several head-indexed sections that are cut separately."""
    return TensorRule(
        mcore,
        hf,
        tuple((r, cols) for r in rows),
        (sum(rows), cols),
        lambda ts: torch.cat(ts, dim=0),
        lambda t: list(t.split(rows, dim=0)),
        TPSplit(0, tp_sections or rows),
    )


def _vocab_rule(mcore: str, hf: str, d: Qwen3_5Dims) -> TensorRule:
    vocab, padded = d.vocab_size, d.model_vocab_size

    def merge(ts):
        if padded == vocab:
            return ts[0]
        pad = ts[0].new_zeros((padded - vocab, d.hidden_size))
        return torch.cat([ts[0], pad], dim=0)

    return TensorRule(
        mcore, (hf,), ((vocab, d.hidden_size),), (padded, d.hidden_size), merge, lambda t: [t[:vocab]], COLUMN
    )


def _gated_qkv_rule(mcore: str, prefix: str, d: Qwen3_5Dims) -> TensorRule:
    heads, groups, dim, hidden = d.num_attention_heads, d.num_query_groups, d.head_dim, d.hidden_size
    per_group = heads // groups
    hf = (f"{prefix}q_proj.weight", f"{prefix}k_proj.weight", f"{prefix}v_proj.weight")

    def merge(ts):
        q_proj, k_proj, v_proj = ts
        query_gate = q_proj.reshape(groups, per_group, 2, dim, hidden)  # HF: per head [query, gate]
        blocks = [
            query_gate[:, :, 0].reshape(groups, per_group * dim, hidden),
            query_gate[:, :, 1].reshape(groups, per_group * dim, hidden),
            k_proj.reshape(groups, dim, hidden),
            v_proj.reshape(groups, dim, hidden),
        ]
        return torch.cat(blocks, dim=1).reshape(-1, hidden)  # per group [q..., gate..., k, v]

    def split(t):
        grouped = t.reshape(groups, (2 * per_group + 2) * dim, hidden)
        query, gate, key, value = grouped.split([per_group * dim, per_group * dim, dim, dim], dim=1)
        q_proj = torch.stack(
            [query.reshape(groups, per_group, dim, hidden), gate.reshape(groups, per_group, dim, hidden)],
            dim=2,
        )
        return [q_proj.reshape(-1, hidden), key.reshape(-1, hidden), value.reshape(-1, hidden)]

    shapes = ((2 * heads * dim, hidden), (groups * dim, hidden), (groups * dim, hidden))
    return TensorRule(mcore, hf, shapes, ((2 * heads + 2 * groups) * dim, hidden), merge, split, COLUMN)


def shard_for_tp(
    tensor: torch.Tensor, split: TPSplit, tp_size: int, tp_rank: int, name: str = ""
) -> torch.Tensor:
    """This TP rank's part of a full tensor (see :class:`TPSplit`)."""
    if split.dim is None or tp_size == 1:
        return tensor
    parts = []
    for size, section in zip(_sections(split, tensor), tensor.split(_sections(split, tensor), dim=split.dim)):
        if size % tp_size:
            raise ValueError(
                f"{name or 'tensor'}: a section of {size} along dim {split.dim} does not split over "
                f"tensor parallel size {tp_size}; use a parallel.tp that divides the head/vocab counts"
            )
        parts.append(section.chunk(tp_size, dim=split.dim)[tp_rank])
    return torch.cat(parts, dim=split.dim).contiguous()


def unshard_from_tp(
    shards: list[torch.Tensor], split: TPSplit, full_sections: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Inverse of :func:`shard_for_tp` given every rank's shard in rank order."""
    if split.dim is None or len(shards) == 1:
        return shards[0]
    tp = len(shards)
    sections = split.sections if split.sections is not None else (shards[0].shape[split.dim] * tp,)
    local = [s // tp for s in sections]
    per_rank = [s.split(local, dim=split.dim) for s in shards]
    return torch.cat(
        [torch.cat([r[i] for r in per_rank], dim=split.dim) for i in range(len(local))], dim=split.dim
    )


def _sections(split: TPSplit, tensor: torch.Tensor) -> tuple[int, ...]:
    return split.sections if split.sections is not None else (tensor.shape[split.dim],)
