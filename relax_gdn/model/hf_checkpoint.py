"""Qwen3.5 Hugging Face checkpoints <-> our Megatron-Core ``GPTModel`` (import for SFT, export to serve).

Three layers, each usable alone:

1. **The plan** (:func:`conversion_plan`): one :class:`TensorRule` per Megatron-Core tensor, saying
   which HF tensors it is made of, how to merge them (and split back), and how tensor parallelism
   cuts it. Pure shape arithmetic on :class:`Qwen3_5Dims`.
2. **Plain state dicts** (:func:`hf_to_mcore_state_dict`, :func:`mcore_to_hf_state_dict`): full
   (TP = 1) tensors in, full tensors out; no process group, no files.
3. **Model + files** (:func:`load_hf_checkpoint`, :func:`save_hf_checkpoint`): read safetensors
   lazily one rule at a time (peak memory: the largest merged tensor, not the checkpoint), cut
   this rank's TP shard (:func:`shard_for_tp`) and copy it into the parameter; or gather the
   shards over TP (:func:`gather_from_tp`) and write HF text-layout safetensors + ``config.json``.

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
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
_LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)

VLM_TEXT_PREFIX = "model.language_model."
TEXT_PREFIX = "model."
# Weights of the VLM checkpoint that text SFT does not use (vision tower, multi-token prediction).
IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


# ---------------------------------------------------------------------------------------------
# Model dimensions
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormConventions:
    """Whether the norms of each kind compute ``x_hat * (1 + w)`` (True) or ``x_hat * w``.

    HF Qwen3.5 is :data:`HF_NORM_CONVENTIONS`; a model's are found by :func:`norm_conventions_of`,
    and the plan converts ``w`` between the two where they differ.
    """

    hidden_one_plus: bool = True  # input / pre-MLP / final norms
    qk_one_plus: bool = True  # attention q_layernorm / k_layernorm
    gdn_out_one_plus: bool = False  # GDN gated output norm


HF_NORM_CONVENTIONS = NormConventions(hidden_one_plus=True, qk_one_plus=True, gdn_out_one_plus=False)


@dataclass(frozen=True)
class Qwen3_5Dims:
    """Everything the tensor mapping needs (global, unsharded sizes) plus the few facts that
    ``config.json`` needs on export."""

    hidden_size: int
    ffn_hidden_size: int
    vocab_size: int  # the checkpoint's vocabulary
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool = False  # the MODEL shares embedding and output weights
    # the CHECKPOINT has no lm_head (tied): an untied model's output layer starts as the embedding
    lm_head_from_embedding: bool = False
    padded_vocab_size: int | None = None  # the model's vocabulary when padded (None: same)
    norms: NormConventions = field(default_factory=NormConventions)
    # config.json facts only (no tensor depends on them)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768

    def __post_init__(self):
        bad = [t for t in self.layer_types if t not in _LAYER_TYPES]
        if bad:
            raise ValueError(f"unknown layer type(s) {sorted(set(bad))}: use {_LAYER_TYPES}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"the model's vocabulary ({self.padded_vocab_size}) is smaller than the checkpoint's "
                f"({self.vocab_size}); build the model with vocab_size >= {self.vocab_size}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def model_vocab_size(self) -> int:
        return self.padded_vocab_size or self.vocab_size


def dims_from_hf_config(hf_config: Mapping | str | os.PathLike) -> Qwen3_5Dims:
    """:class:`Qwen3_5Dims` from a Qwen3.5 ``config.json`` (text config, or VLM with ``text_config``),
    given as a dict, the file, or its directory."""
    cfg = _text_config(_read_config(hf_config))
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias=true is not Qwen3.5 and is not mapped (Megatron add_qkv_bias)")
    num_layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = cfg.get("full_attention_interval", 4)
        layer_types = [
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ValueError(f"config.json has {len(layer_types)} layer_types for num_hidden_layers={num_layers}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return Qwen3_5Dims(
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        linear_num_key_heads=cfg["linear_num_key_heads"],
        linear_num_value_heads=cfg["linear_num_value_heads"],
        linear_key_head_dim=cfg["linear_key_head_dim"],
        linear_value_head_dim=cfg["linear_value_head_dim"],
        linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
        layer_types=tuple(layer_types),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        norms=HF_NORM_CONVENTIONS,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        partial_rotary_factor=rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
    )


def qwen3_5_config_from_hf(hf_config: Mapping | str | os.PathLike) -> tuple[dict, dict]:
    """``(transformer_config_overrides, gpt_model_kwargs)`` describing a checkpoint's text model.

    The first are ``TransformerConfig`` fields (sizes, heads, eps, the GDN/attention layer
    pattern), to lay over a preset of ``relax_gdn.model.qwen3_5``; the second are ``GPTModel``
    arguments (vocabulary, RoPE, length). Presets stay in ``qwen3_5.py``: this only says what
    the checkpoint fixes.
    """
    d = dims_from_hf_config(hf_config)
    pattern = [1 if t == LINEAR_ATTENTION else 0 for t in d.layer_types]
    overrides = dict(
        num_layers=d.num_layers,
        hidden_size=d.hidden_size,
        ffn_hidden_size=d.ffn_hidden_size,
        num_attention_heads=d.num_attention_heads,
        num_query_groups=d.num_query_groups,
        kv_channels=d.head_dim,
        linear_num_key_heads=d.linear_num_key_heads,
        linear_num_value_heads=d.linear_num_value_heads,
        linear_key_head_dim=d.linear_key_head_dim,
        linear_value_head_dim=d.linear_value_head_dim,
        linear_conv_kernel_dim=d.linear_conv_kernel_dim,
        linear_attention_freq=_linear_attention_freq(pattern),
        layernorm_epsilon=d.rms_norm_eps,
    )
    model_kwargs = dict(
        vocab_size=d.vocab_size,
        max_sequence_length=d.max_position_embeddings,
        rotary_base=d.rope_theta,
        rotary_percent=d.partial_rotary_factor,
    )
    return overrides, model_kwargs


def _linear_attention_freq(pattern: list[int]) -> int | list[int]:
    """Megatron's ``linear_attention_freq``: N when full attention is every N-th layer, else the list."""
    for n in range(1, len(pattern) + 1):
        if pattern == [0 if (i + 1) % n == 0 else 1 for i in range(len(pattern))]:
            return n
    return pattern


def hf_text_config(dims: Qwen3_5Dims, base: Mapping | None = None) -> dict:
    """A ``Qwen3_5ForCausalLM`` ``config.json`` for ``dims``; ``base`` (e.g. the original checkpoint's
    config, VLM or text) contributes the fields the model does not know (token ids, ...)."""
    cfg = dict(_text_config(base)) if base is not None else {}
    for key in ("text_config", "vision_config", "auto_map", "torch_dtype"):
        cfg.pop(key, None)
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update(rope_theta=dims.rope_theta, partial_rotary_factor=dims.partial_rotary_factor)
    rope.setdefault("rope_type", "default")
    cfg.update(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        vocab_size=dims.vocab_size,
        hidden_size=dims.hidden_size,
        intermediate_size=dims.ffn_hidden_size,
        num_hidden_layers=dims.num_layers,
        num_attention_heads=dims.num_attention_heads,
        num_key_value_heads=dims.num_query_groups,
        head_dim=dims.head_dim,
        linear_num_key_heads=dims.linear_num_key_heads,
        linear_num_value_heads=dims.linear_num_value_heads,
        linear_key_head_dim=dims.linear_key_head_dim,
        linear_value_head_dim=dims.linear_value_head_dim,
        linear_conv_kernel_dim=dims.linear_conv_kernel_dim,
        layer_types=list(dims.layer_types),
        tie_word_embeddings=dims.tie_word_embeddings,
        rms_norm_eps=dims.rms_norm_eps,
        max_position_embeddings=dims.max_position_embeddings,
        rope_parameters=rope,
        hidden_act="silu",
        attention_bias=False,
    )
    return cfg


def _read_config(hf_config: Mapping | str | os.PathLike) -> dict:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    path = Path(hf_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Qwen3.5 config.json at {path}")
    return json.loads(path.read_text())


def _text_config(cfg: Mapping) -> Mapping:
    """The text part of a VLM (``Qwen3_5ForConditionalGeneration``) or text-only config."""
    text = cfg.get("text_config")
    if text is None:
        return cfg
    merged = dict(text)
    # a few top-level fields of the VLM config apply to the language model
    merged.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return merged


# ---------------------------------------------------------------------------------------------
# The plan: one rule per Megatron-Core tensor
# ---------------------------------------------------------------------------------------------


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


def conversion_plan(dims: Qwen3_5Dims) -> list[TensorRule]:
    """Every tensor of the Megatron-Core model (local module names, unfused norms), in order."""
    d, hidden = dims, dims.hidden_size
    norms = d.norms
    plan = [_vocab_rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", d)]
    qk, v, hv = (
        d.linear_num_key_heads * d.linear_key_head_dim,
        d.linear_num_value_heads * d.linear_value_head_dim,
        d.linear_num_value_heads,
    )
    for i, kind in enumerate(d.layer_types):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        plan.append(
            _norm_rule(
                f"{mc}input_layernorm.weight",
                f"{hf}input_layernorm.weight",
                hidden,
                HF_NORM_CONVENTIONS.hidden_one_plus,
                norms.hidden_one_plus,
            )
        )
        if kind == LINEAR_ATTENTION:
            a, m = f"{hf}linear_attn.", f"{mc}self_attention."
            plan += [
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
                    norms.gdn_out_one_plus,
                ),
                _copy_rule(f"{m}out_proj.weight", f"{a}out_proj.weight", (hidden, v), ROW),
            ]
        else:
            a, m = f"{hf}self_attn.", f"{mc}self_attention."
            plan += [
                _gated_qkv_rule(f"{m}linear_qkv.weight", a, d),
                _norm_rule(
                    f"{m}q_layernorm.weight",
                    f"{a}q_norm.weight",
                    d.head_dim,
                    HF_NORM_CONVENTIONS.qk_one_plus,
                    norms.qk_one_plus,
                ),
                _norm_rule(
                    f"{m}k_layernorm.weight",
                    f"{a}k_norm.weight",
                    d.head_dim,
                    HF_NORM_CONVENTIONS.qk_one_plus,
                    norms.qk_one_plus,
                ),
                _copy_rule(
                    f"{m}linear_proj.weight",
                    f"{a}o_proj.weight",
                    (hidden, d.num_attention_heads * d.head_dim),
                    ROW,
                ),
            ]
        plan += [
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
    plan.append(
        _norm_rule("decoder.final_layernorm.weight", "model.norm.weight", hidden, True, norms.hidden_one_plus)
    )
    if not d.tie_word_embeddings:
        source = "model.embed_tokens.weight" if d.lm_head_from_embedding else "lm_head.weight"
        plan.append(_vocab_rule("output_layer.weight", source, d))
    return plan


# ---------------------------------------------------------------------------------------------
# Plain state dicts (full tensors, no process groups)
# ---------------------------------------------------------------------------------------------


class CheckpointMismatchError(ValueError):
    """A checkpoint tensor is missing, mis-shaped or unknown; the message names it."""


def hf_text_name(name: str) -> str | None:
    """The text-layout name of a checkpoint key (VLM ``model.language_model.x`` -> ``model.x``),
    or None for weights text SFT ignores (vision tower, MTP)."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    if name.startswith(VLM_TEXT_PREFIX):
        return TEXT_PREFIX + name[len(VLM_TEXT_PREFIX) :]
    return name


def _check_shape(what: str, name: str, tensor: torch.Tensor, expected: tuple[int, ...], fix: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise CheckpointMismatchError(
            f"{what} tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}; {fix}"
        )


_HF_FIX = (
    "the checkpoint does not match the model's dimensions (compare its config.json with the model config)"
)


def _merge(rule: TensorRule, fetch: Callable[[str], torch.Tensor]) -> torch.Tensor:
    tensors = []
    for name, shape in zip(rule.hf, rule.hf_shapes):
        tensor = fetch(name)
        _check_shape("checkpoint", name, tensor, shape, _HF_FIX)
        tensors.append(tensor)
    return rule.merge(tensors)


def _split(rule: TensorRule, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    _check_shape(
        "model", rule.mcore, tensor, rule.mcore_shape, "the model does not match the dimensions given"
    )
    return {name: t.contiguous() for name, t in zip(rule.hf, rule.split(tensor))}


def hf_to_mcore_state_dict(
    hf_state: Mapping[str, torch.Tensor], dims: Qwen3_5Dims
) -> dict[str, torch.Tensor]:
    """Full Megatron-Core state dict from an HF Qwen3.5 state dict (text or VLM layout).

    Vision/MTP weights are ignored; a missing, mis-shaped or unknown text tensor raises
    :class:`CheckpointMismatchError` naming it.
    """
    text = _TextView(hf_state.keys())
    out = {rule.mcore: _merge(rule, lambda n: hf_state[text.lookup(n)]) for rule in conversion_plan(dims)}
    text.check_all_used()
    return out


def mcore_to_hf_state_dict(
    mcore_state: Mapping[str, torch.Tensor], dims: Qwen3_5Dims
) -> dict[str, torch.Tensor]:
    """HF text-layout state dict (``Qwen3_5ForCausalLM``) from a full Megatron-Core state dict."""
    plan = conversion_plan(replace(dims, lm_head_from_embedding=False))  # export always writes lm_head
    known = {rule.mcore for rule in plan}
    extra = sorted(k for k in mcore_state if k not in known and not k.endswith("_extra_state"))
    if extra:
        raise CheckpointMismatchError(f"model tensor(s) with no HF counterpart: {extra[:5]}")
    out: dict[str, torch.Tensor] = {}
    for rule in plan:
        if rule.mcore not in mcore_state:
            raise CheckpointMismatchError(f"model state dict lacks {rule.mcore!r}")
        out.update(_split(rule, mcore_state[rule.mcore]))
    return out


class _TextView:
    """Checkpoint keys seen through :func:`hf_text_name`; remembers which were used."""

    def __init__(self, keys):
        self.by_text: dict[str, str] = {}
        for key in keys:
            text = hf_text_name(key)
            if text is None:
                continue
            if text in self.by_text:
                raise CheckpointMismatchError(
                    f"checkpoint holds {text!r} twice (as {self.by_text[text]!r} and {key!r}): "
                    "mixed VLM and text layouts"
                )
            self.by_text[text] = key
        self.used: set[str] = set()

    def lookup(self, text_name: str) -> str:
        key = self.by_text.get(text_name)
        if key is None:
            vlm = (
                f" (or {VLM_TEXT_PREFIX + text_name[len(TEXT_PREFIX) :]!r} in the VLM layout)"
                if text_name.startswith(TEXT_PREFIX)
                else ""
            )
            raise CheckpointMismatchError(
                f"checkpoint lacks tensor {text_name!r}{vlm}; is it a Qwen3.5 checkpoint with the model's "
                "number of layers and layer types?"
            )
        self.used.add(text_name)
        return key

    def check_all_used(self) -> None:
        left = sorted(set(self.by_text) - self.used)
        if left:
            raise CheckpointMismatchError(
                f"checkpoint has {len(left)} text tensor(s) the model has no place for, e.g. "
                f"{[self.by_text[n] for n in left[:5]]}; the model is smaller than the checkpoint "
                "(layers, tied embeddings) or the checkpoint is not Qwen3.5"
            )


# ---------------------------------------------------------------------------------------------
# Tensor parallelism
# ---------------------------------------------------------------------------------------------


def _sections(split: TPSplit, tensor: torch.Tensor) -> tuple[int, ...]:
    return split.sections if split.sections is not None else (tensor.shape[split.dim],)


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


def gather_from_tp(local: torch.Tensor, split: TPSplit, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor from every TP rank's shard (a collective: every rank of ``tp_group`` calls it)."""
    tp_size = _group_size(tp_group)
    if split.dim is None or tp_size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(shards, local.contiguous(), group=tp_group)
    return unshard_from_tp(shards, split)


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# ---------------------------------------------------------------------------------------------
# The model side
# ---------------------------------------------------------------------------------------------

# Transformer Engine fuses the pre-attention / pre-MLP norms into the next linear
# (``layer_norm_weight``); the local spec keeps separate norm modules. Same tensor either way.
_FUSED_NORM_ALIASES = (
    (
        re.compile(r"^(decoder\.layers\.\d+\.)input_layernorm\.weight$"),
        (r"\1self_attention.linear_qkv.layer_norm_weight", r"\1self_attention.in_proj.layer_norm_weight"),
    ),
    (
        re.compile(r"^(decoder\.layers\.\d+\.)pre_mlp_layernorm\.weight$"),
        (r"\1mlp.linear_fc1.layer_norm_weight",),
    ),
)


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}


def _resolve_names(plan: list[TensorRule], tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Plan name -> the model's name for it; errors on model tensors the plan does not cover."""
    resolved = {}
    for rule in plan:
        name = rule.mcore
        if name not in tensors:
            for pattern, aliases in _FUSED_NORM_ALIASES:
                if pattern.match(name):
                    name = next((a for a in (pattern.sub(x, name) for x in aliases) if a in tensors), name)
        if name not in tensors:
            raise CheckpointMismatchError(
                f"model has no tensor {rule.mcore!r} (from {rule.hf[0]!r}); the model's layer pattern "
                "or modules differ from the Qwen3.5 layout this mapping knows"
            )
        resolved[rule.mcore] = name
    unknown = sorted(set(tensors) - set(resolved.values()))
    if unknown:
        raise CheckpointMismatchError(
            f"model tensor(s) with no HF checkpoint source: {unknown[:5]}; extend conversion_plan"
        )
    return resolved


def _first(model: torch.nn.Module, suffix: str) -> torch.nn.Module | None:
    return next((m for n, m in model.named_modules() if n.endswith(suffix)), None)


def _norm_adds_one(norm: torch.nn.Module) -> bool:
    """Whether ``norm`` computes ``x_hat * (1 + w)``: run it with ``w = 0`` on a constant input."""
    weight = norm.weight
    with torch.no_grad():
        saved = weight.detach().clone()
        weight.zero_()
        try:
            y = norm(torch.ones(2, weight.shape[-1], device=weight.device, dtype=weight.dtype))
        finally:
            weight.copy_(saved)
    return bool(y.float().abs().max() > 0.5)


def norm_conventions_of(model: torch.nn.Module) -> NormConventions:
    """Each norm kind's convention as the model actually computes it (fused TE norms, which cannot
    run alone, follow ``config.layernorm_zero_centered_gamma``)."""
    model = unwrap_model(model)
    default = bool(getattr(model.config, "layernorm_zero_centered_gamma", False))

    def probe(suffix: str) -> bool:
        norm = _first(model, suffix)
        if norm is None or not isinstance(getattr(norm, "weight", None), torch.Tensor):
            return default
        return _norm_adds_one(norm)

    return NormConventions(
        hidden_one_plus=probe("decoder.final_layernorm"),
        qk_one_plus=probe("self_attention.q_layernorm"),
        gdn_out_one_plus=probe("self_attention.out_norm"),
    )


def dims_from_model(model: torch.nn.Module, vocab_size: int | None = None) -> Qwen3_5Dims:
    """:class:`Qwen3_5Dims` of a Megatron-Core Qwen3.5 ``GPTModel`` (global sizes).

    ``vocab_size`` is the HF vocabulary when the model's is padded beyond it (default: the model's).
    """
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    model = unwrap_model(model)
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise NotImplementedError(
            "HF checkpoint conversion needs the whole model on one rank (no pipeline parallelism)"
        )
    cfg = model.config
    layer_types = tuple(
        LINEAR_ATTENTION if isinstance(layer.self_attention, _GDNBase) else FULL_ATTENTION
        for layer in model.decoder.layers
    )
    model_vocab = model.vocab_size
    vocab = model_vocab if vocab_size is None else vocab_size
    return Qwen3_5Dims(
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        vocab_size=vocab,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=cfg.kv_channels,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        layer_types=layer_types,
        tie_word_embeddings=bool(model.share_embeddings_and_output_weights),
        padded_vocab_size=model_vocab if model_vocab != vocab else None,
        norms=norm_conventions_of(model),
        rms_norm_eps=cfg.layernorm_epsilon,
        rope_theta=float(getattr(model, "rotary_base", 1e7)),
        partial_rotary_factor=float(getattr(model, "rotary_percent", 0.25)),
        max_position_embeddings=int(getattr(model, "max_sequence_length", 32768)),
    )


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside training wrappers (DDP, ``Float16Module``: ``.module`` chains), whose
    state_dict names the plan uses."""
    while not hasattr(model, "decoder") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _model_tp_group(model: torch.nn.Module, tp_group):
    if tp_group is not None:
        return tp_group
    pgs = getattr(model, "pg_collection", None)
    group = getattr(pgs, "tp", None)
    if group is None or not dist.is_initialized():
        return None
    return group


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


class _SafetensorsReader:
    """Lazy tensor access to a checkpoint directory (single file or sharded with an index)."""

    def __init__(self, checkpoint_dir: str | os.PathLike):
        from safetensors import safe_open

        self.dir = Path(checkpoint_dir)
        index = self.dir / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SAFETENSORS_SINGLE).is_file():
            with safe_open(self.dir / SAFETENSORS_SINGLE, "pt") as f:
                weight_map = {k: SAFETENSORS_SINGLE for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.dir} has neither {SAFETENSORS_INDEX} nor {SAFETENSORS_SINGLE}: "
                "not an HF safetensors checkpoint"
            )
        self.weight_map: dict[str, str] = weight_map
        self._open = safe_open
        self._files: dict[str, object] = {}

    def keys(self):
        return self.weight_map.keys()

    def __getitem__(self, key: str) -> torch.Tensor:
        file = self.weight_map[key]
        handle = self._files.get(file)
        if handle is None:
            path = self.dir / file
            if not path.is_file():
                raise FileNotFoundError(
                    f"{SAFETENSORS_INDEX} puts {key!r} in {file}, which is missing from {self.dir}"
                )
            handle = self._files[file] = self._open(path, "pt").__enter__()
        return handle.get_tensor(key)

    def close(self) -> None:
        for handle in self._files.values():
            handle.__exit__(None, None, None)
        self._files.clear()


def read_hf_state_dict(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory (small checkpoints and tests)."""
    reader = _SafetensorsReader(checkpoint_dir)
    try:
        return {k: reader[k] for k in reader.keys()}
    finally:
        reader.close()


def load_hf_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike, *, tp_group: dist.ProcessGroup | None = None
) -> Qwen3_5Dims:
    """Copy an HF Qwen3.5 checkpoint (text or VLM layout) into ``model``'s parameters, this TP rank's
    shard of each. Every rank of the model reads the files; TP defaults to ``model.pg_collection.tp``.

    Returns the dimensions used (with the checkpoint's vocabulary). Raises
    :class:`CheckpointMismatchError` naming the tensor when one is missing, mis-shaped, or unknown.
    """
    model = unwrap_model(model)
    tp_group = _model_tp_group(model, tp_group)
    tp_size, tp_rank = _group_size(tp_group), _group_rank(tp_group)
    reader = _SafetensorsReader(checkpoint_dir)
    try:
        text = _TextView(reader.keys())
        dims = _dims_for_checkpoint(model, reader, text, Path(checkpoint_dir))
        tensors = _model_tensors(model)
        plan = conversion_plan(dims)
        names = _resolve_names(plan, tensors)
        with torch.no_grad():
            for rule in plan:
                full = _merge(rule, lambda n: reader[text.lookup(n)])
                local = shard_for_tp(full, rule.tp, tp_size, tp_rank, rule.mcore)
                target = tensors[names[rule.mcore]]
                _check_shape(
                    f"TP-{tp_rank}/{tp_size} shard of",
                    rule.mcore,
                    local,
                    tuple(target.shape),
                    "the model's tensor parallel size or sizes differ from what the checkpoint implies",
                )
                target.copy_(local)
        text.check_all_used()
    finally:
        reader.close()
    return dims


# config.json fields that must equal the model's, with the TransformerConfig field to fix
_CONFIG_FIELDS = {
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "head_dim": "kv_channels",
    "linear_num_key_heads": "linear_num_key_heads",
    "linear_num_value_heads": "linear_num_value_heads",
    "linear_key_head_dim": "linear_key_head_dim",
    "linear_value_head_dim": "linear_value_head_dim",
    "linear_conv_kernel_dim": "linear_conv_kernel_dim",
    "layer_types": "linear_attention_freq",
}


def _dims_for_checkpoint(
    model, reader: _SafetensorsReader, text: _TextView, checkpoint_dir: Path
) -> Qwen3_5Dims:
    """The model's dimensions with the checkpoint's vocabulary and lm_head tying; when the checkpoint
    has a config.json, its sizes must be the model's (one clear error instead of many tensor ones)."""
    has_lm_head = "lm_head.weight" in text.by_text
    if (checkpoint_dir / "config.json").is_file():
        hf = dims_from_hf_config(checkpoint_dir)
        dims = dims_from_model(model, vocab_size=hf.vocab_size)
        wrong = [
            f"{name}: checkpoint {getattr(hf, name)!r}, model {getattr(dims, name)!r} "
            f"(TransformerConfig.{fix})"
            for name, fix in _CONFIG_FIELDS.items()
            if getattr(hf, name) != getattr(dims, name)
        ]
        if wrong:
            raise CheckpointMismatchError(
                f"{checkpoint_dir}/config.json does not describe this model: "
                + "; ".join(wrong)
                + "; build the model from qwen3_5_config_from_hf(checkpoint_dir)"
            )
        tied = hf.tie_word_embeddings and not has_lm_head
    else:
        key = text.by_text.get("model.embed_tokens.weight")
        dims = dims_from_model(model, vocab_size=None if key is None else reader[key].shape[0])
        tied = not has_lm_head
    return replace(dims, lm_head_from_embedding=tied and not dims.tie_word_embeddings)


def save_hf_checkpoint(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    base_config: Mapping | str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    writer: bool | None = None,
) -> Qwen3_5Dims | None:
    """Write ``model`` as an HF ``Qwen3_5ForCausalLM`` checkpoint (text layout, safetensors + config.json).

    A collective over ``tp_group`` (default ``model.pg_collection.tp``): every TP rank calls it; the
    shards are gathered and ``writer`` (default: global rank 0) writes. ``vocab_size`` trims a padded
    vocabulary; ``base_config`` (the original checkpoint dir or its config dict) keeps fields the
    model does not know (token ids). Files larger than ``max_shard_bytes`` are split with an index.
    """
    from safetensors.torch import save_file

    model = unwrap_model(model)
    tp_group = _model_tp_group(model, tp_group)
    if writer is None:
        writer = not dist.is_initialized() or dist.get_rank() == 0
    if _group_size(tp_group) > 1 and not _any_in_group(writer, tp_group, next(model.parameters()).device):
        return None  # a data/context-parallel replica: its TP group need not gather anything
    if vocab_size is None and base_config is not None:
        vocab_size = _text_config(_read_config(base_config))["vocab_size"]
    dims = dims_from_model(model, vocab_size=vocab_size)
    tensors = _model_tensors(model)
    plan = conversion_plan(dims)
    names = _resolve_names(plan, tensors)

    out = Path(out_dir)
    pending: dict[str, torch.Tensor] = {}
    files: list[tuple[str, list[str]]] = []
    pending_bytes = 0
    total_bytes = 0

    def flush():
        nonlocal pending, pending_bytes
        if pending:
            name = f"model-part-{len(files):05d}.safetensors"
            save_file(pending, str(out / name), metadata={"format": "pt"})
            files.append((name, list(pending)))
        pending, pending_bytes = {}, 0

    if writer:
        out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for rule in plan:
            full = gather_from_tp(tensors[names[rule.mcore]].detach(), rule.tp, tp_group)
            if not writer:
                continue
            full = full.to("cpu", dtype=dtype or full.dtype)
            for name, tensor in _split(rule, full).items():
                size = tensor.numel() * tensor.element_size()
                if pending and pending_bytes + size > max_shard_bytes:
                    flush()
                pending[name] = tensor.clone()  # own storage: splits are views of one merged tensor
                pending_bytes += size
                total_bytes += size
    if not writer:
        return None
    flush()
    _finish_files(out, files, total_bytes)
    config = hf_text_config(dims, None if base_config is None else _read_config(base_config))
    config["dtype"] = str(dtype or next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dims


def _any_in_group(flag: bool, group, device) -> bool:
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def _finish_files(out: Path, files: list[tuple[str, list[str]]], total_bytes: int) -> None:
    """HF names: one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index."""
    for stale in [out / SAFETENSORS_SINGLE, out / SAFETENSORS_INDEX, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if len(files) == 1:
        os.replace(out / files[0][0], out / SAFETENSORS_SINGLE)
        return
    weight_map = {}
    for i, (name, keys) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(out / name, out / final)
        weight_map.update({k: final for k in keys})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


__all__ = [
    "HF_NORM_CONVENTIONS",
    "CheckpointMismatchError",
    "NormConventions",
    "Qwen3_5Dims",
    "TPSplit",
    "TensorRule",
    "conversion_plan",
    "dims_from_hf_config",
    "dims_from_model",
    "gather_from_tp",
    "hf_text_config",
    "hf_text_name",
    "hf_to_mcore_state_dict",
    "load_hf_checkpoint",
    "mcore_to_hf_state_dict",
    "norm_conventions_of",
    "qwen3_5_config_from_hf",
    "read_hf_state_dict",
    "save_hf_checkpoint",
    "shard_for_tp",
    "unshard_from_tp",
    "unwrap_model",
]
