"""An HF checkpoint directory as its files describe it, before any tensor is read: every tensor's
file, dtype and shape (safetensors headers), the shard layout and ``config.json``
(:class:`HFCheckpoint`); and what a run started from it (``model.hf_checkpoint``) takes from it:
the vocabulary, with every other dimension checked against the preset (:func:`run_vocab_size`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax_gdn.errors import ConfigError
from relax_gdn.model.hf_checkpoint.convert import text_layout_name
from relax_gdn.model.hf_checkpoint.dims import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    Qwen3_5Dims,
    dims_from_hf_config,
)
from relax_gdn.model.presets import PRESETS, Qwen3_5Preset, qwen3_5_preset

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
EMBEDDING = "model.embed_tokens.weight"  # text-layout name

# safetensors header dtype names (the format's spec) -> torch
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class SourceTensor:
    """Where a checkpoint tensor lives and what it is."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class HFCheckpoint:
    """An HF safetensors checkpoint directory (one ``model.safetensors``, or shards with
    ``model.safetensors.index.json``), read from the headers only."""

    directory: Path
    tensors: dict[str, SourceTensor]  # every tensor by its checkpoint name, in file order
    files: tuple[str, ...]  # the safetensors files, in order
    sharded: bool  # written with an index (else one model.safetensors)
    index_metadata: dict[str, Any]  # the index's "metadata" (total_size, ...); {} without an index
    config: dict[str, Any] | None  # config.json, None when absent

    @classmethod
    def read(cls, directory: str | Path) -> HFCheckpoint:
        """Raises ``FileNotFoundError`` naming what is missing."""
        from safetensors import safe_open

        directory = Path(directory)
        index = directory / SAFETENSORS_INDEX
        if index.is_file():
            parsed = json.loads(index.read_text())
            weight_map, metadata = parsed["weight_map"], dict(parsed.get("metadata") or {})
            files = tuple(dict.fromkeys(weight_map.values()))
        elif (directory / SAFETENSORS_SINGLE).is_file():
            weight_map, metadata, files = None, {}, (SAFETENSORS_SINGLE,)
        else:
            raise FileNotFoundError(
                f"{directory} has neither {SAFETENSORS_INDEX} nor {SAFETENSORS_SINGLE}: "
                "not an HF safetensors checkpoint"
            )
        tensors: dict[str, SourceTensor] = {}
        for file in files:
            path = directory / file
            if not path.is_file():
                raise FileNotFoundError(f"{SAFETENSORS_INDEX} of {directory} names {file}, which is missing")
            with safe_open(path, "pt") as f:
                for name in f.keys():
                    if weight_map is not None and weight_map.get(name) != file:
                        continue  # the index decides which file holds a name
                    view = f.get_slice(name)
                    tensors[name] = SourceTensor(
                        file, SAFETENSORS_DTYPES[view.get_dtype()], tuple(view.get_shape())
                    )
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(tensors))
            if missing:
                raise FileNotFoundError(
                    f"{SAFETENSORS_INDEX} of {directory} names {len(missing)} tensor(s) its "
                    f"files lack, e.g. {missing[:3]}"
                )
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else None
        return cls(directory, tensors, files, weight_map is not None, metadata, config)

    def by_text_name(self) -> dict[str, str]:
        """Text-layout name -> checkpoint name (VLM ``model.language_model.x`` is ``model.x``)."""
        return {text_layout_name(name): name for name in self.tensors}

    def embedding_rows(self) -> int | None:
        name = self.by_text_name().get(EMBEDDING)
        return None if name is None else self.tensors[name].shape[0]

    def mtp_layers(self) -> int:
        """How many multi-token-prediction layers the checkpoint holds (``mtp.layers.<i>.*``), by
        its tensors (what a run can load), whatever its config says."""
        return len({name.split(".")[2] for name in self.tensors if name.startswith("mtp.layers.")})


# ---------------------------------------------------------------------------------------------
# a run started from a checkpoint (model.hf_checkpoint)
# ---------------------------------------------------------------------------------------------

# the sizes a checkpoint must share with the preset that builds the run's model (the vocabulary
# is the checkpoint's; tied embeddings and max_position_embeddings change no tensor of the model)
_MATCHED_FIELDS = (
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "rms_norm_eps",
    "num_layers",
    "layer_types",
    "rope_theta",
    "partial_rotary_factor",
)


def preset_layer_types(preset: Qwen3_5Preset) -> tuple[str, ...]:
    """The GDN / attention pattern of a preset (``linear_attention_freq``: N or a 0/1 list)."""
    n, freq = preset.config["num_layers"], preset.config["linear_attention_freq"]
    linear = [bool(x) for x in freq] if isinstance(freq, list) else [(i + 1) % freq != 0 for i in range(n)]
    return tuple(LINEAR_ATTENTION if x else FULL_ATTENTION for x in linear)


def preset_dims(preset: str | Qwen3_5Preset, vocab_size: int, mtp_num_layers: int = 0) -> Qwen3_5Dims:
    """:class:`Qwen3_5Dims` of the model ``preset`` builds, with ``vocab_size`` and ``mtp_num_layers``
    MTP layers."""
    p = qwen3_5_preset(preset)
    c = p.config
    return Qwen3_5Dims(
        hidden_size=c["hidden_size"],
        ffn_hidden_size=c["ffn_hidden_size"],
        vocab_size=vocab_size,
        num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_query_groups"],
        head_dim=c["kv_channels"],
        linear_num_key_heads=c["linear_num_key_heads"],
        linear_num_value_heads=c["linear_num_value_heads"],
        linear_key_head_dim=c["linear_key_head_dim"],
        linear_value_head_dim=c["linear_value_head_dim"],
        linear_conv_kernel_dim=c["linear_conv_kernel_dim"],
        layer_types=preset_layer_types(p),
        rms_norm_eps=c["layernorm_epsilon"],
        rope_theta=p.rotary_base,
        partial_rotary_factor=p.rotary_percent,
        max_position_embeddings=p.max_sequence_length,
        mtp_num_layers=mtp_num_layers,
    )


def preset_mismatches(dims: Qwen3_5Dims, preset: str | Qwen3_5Preset) -> list[str]:
    """``"<field>: checkpoint X, preset Y"`` for every size of ``dims`` the preset builds otherwise."""
    built = preset_dims(preset, dims.vocab_size)
    wrong = [
        (name, getattr(dims, name), getattr(built, name))
        for name in _MATCHED_FIELDS
        if getattr(dims, name) != getattr(built, name)
    ]
    if any(name == "num_layers" for name, _, _ in wrong):  # then the pattern differs too: say it once
        wrong = [w for w in wrong if w[0] != "layer_types"]
    return [f"{name}: checkpoint {_short(a)}, preset {_short(b)}" for name, a, b in wrong]


def _short(value) -> str:
    if isinstance(value, tuple) and len(value) > 4:
        kinds = "".join("L" if t == LINEAR_ATTENTION else "F" for t in value)
        return f"{len(value)} layers {kinds} (L: linear_attention, F: full_attention)"
    return repr(value)


def run_vocab_size(checkpoint_dir: str | Path, preset: str, tokenizer_vocab_size: int, tp: int) -> int:
    """The vocabulary of a run started from ``model.hf_checkpoint=checkpoint_dir``: the checkpoint's
    (``config.json`` and its embedding agree), after checking that every other dimension is the
    preset's and that the tokenizer's ids and tensor parallelism fit it. Raises
    :class:`~relax_gdn.errors.ConfigError` naming the keys to change."""
    key = f"model.hf_checkpoint={str(checkpoint_dir)!r}"
    try:
        source = HFCheckpoint.read(checkpoint_dir)
    except FileNotFoundError as e:
        raise ConfigError(f"{key}: {e}") from e
    if source.config is None:
        raise ConfigError(f"{key} has no config.json: a Hugging Face checkpoint directory holds one")
    try:
        dims = dims_from_hf_config(source.config)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{key}: its config.json is not a Qwen3.5 config ({type(e).__name__}: {e})") from e
    rows = source.embedding_rows()
    if rows is not None and rows != dims.vocab_size:
        raise ConfigError(
            f"{key}: config.json says vocab_size={dims.vocab_size} but its {EMBEDDING} has {rows} "
            "rows; the checkpoint is inconsistent"
        )
    wrong = preset_mismatches(dims, preset)
    if wrong:
        fits = [name for name, p in PRESETS.items() if not preset_mismatches(dims, p)]
        fix = (
            f"use model.preset={fits[0]}"
            if fits
            else "no preset has these sizes (relax_gdn/model/presets.py holds them)"
        )
        raise ConfigError(f"{key} does not match model.preset={preset}: " + "; ".join(wrong) + f"; {fix}")
    if tokenizer_vocab_size > dims.vocab_size:
        raise ConfigError(
            f"data.tokenizer has {tokenizer_vocab_size} tokens, more than the {dims.vocab_size} of "
            f"{key}: use the tokenizer the checkpoint was trained with (data.tokenizer=<its directory>)"
        )
    if dims.vocab_size % tp:
        raise ConfigError(
            f"the vocabulary of {key} ({dims.vocab_size}) does not split over parallel.tp={tp}; "
            "use a parallel.tp that divides it"
        )
    return dims.vocab_size
