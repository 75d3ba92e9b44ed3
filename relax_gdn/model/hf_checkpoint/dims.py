"""The sizes of a Qwen3.5 text model, read from either side: an HF ``config.json``
(:func:`dims_from_hf_config`, and :func:`hf_text_config` to write one) or a live Megatron-Core
model (:func:`dims_from_model`, which also probes how each kind of norm computes)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

LINEAR_ATTENTION = "linear_attention"
# how many MTP layers a Qwen3.5 config.json says the checkpoint holds (vLLM reads it; transformers keeps
# it as an unknown field)
MTP_CONFIG_KEY = "mtp_num_hidden_layers"
FULL_ATTENTION = "full_attention"
_LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)


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
    # multi-token-prediction layers (``mtp.*``; HF config ``mtp_num_hidden_layers``): 0 or Qwen3.5's 1
    mtp_num_layers: int = 0
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
    cfg = language_model_config(read_hf_config(hf_config))
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
        mtp_num_layers=int(cfg.get(MTP_CONFIG_KEY) or 0),
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
    cfg = dict(language_model_config(base)) if base is not None else {}
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
    cfg.pop(MTP_CONFIG_KEY, None)  # the base's count says nothing of this model's
    if dims.mtp_num_layers:
        cfg.update({MTP_CONFIG_KEY: dims.mtp_num_layers, "mtp_use_dedicated_embeddings": False})
    return cfg


def read_hf_config(hf_config: Mapping | str | os.PathLike) -> dict:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    path = Path(hf_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Qwen3.5 config.json at {path}")
    return json.loads(path.read_text())


def language_model_config(cfg: Mapping) -> Mapping:
    """The text part of a VLM (``Qwen3_5ForConditionalGeneration``) or text-only config."""
    text = cfg.get("text_config")
    if text is None:
        return cfg
    merged = dict(text)
    # a few top-level fields of the VLM config apply to the language model
    merged.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return merged


def dims_from_model(
    model: torch.nn.Module, vocab_size: int | None = None, probe_norms: bool = True
) -> Qwen3_5Dims:
    """:class:`Qwen3_5Dims` of a Megatron-Core Qwen3.5 ``GPTModel`` (global sizes).

    ``vocab_size`` is the HF vocabulary when the model's is padded beyond it (default: the model's).
    ``probe_norms=False`` leaves the norm conventions at their defaults instead of running each
    kind of norm (for shapes alone, e.g. on the meta device).
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
        norms=norm_conventions_of(model) if probe_norms else NormConventions(),
        rms_norm_eps=cfg.layernorm_epsilon,
        rope_theta=float(getattr(model, "rotary_base", 1e7)),
        partial_rotary_factor=float(getattr(model, "rotary_percent", 0.25)),
        max_position_embeddings=int(getattr(model, "max_sequence_length", 32768)),
        mtp_num_layers=len(model.mtp.layers) if getattr(model, "mtp", None) is not None else 0,
    )


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside training wrappers (DDP, ``Float16Module``: ``.module`` chains), whose
    state_dict names the plan uses."""
    while not hasattr(model, "decoder") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


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
