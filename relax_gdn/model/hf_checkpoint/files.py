"""Model <-> files: :func:`load_hf_checkpoint` reads safetensors lazily one rule at a time (peak
memory: the largest merged tensor, not the checkpoint), cuts this rank's TP shard and copies it
into the parameter; :func:`save_hf_checkpoint` gathers the shards over TP and writes HF
text-layout safetensors + ``config.json``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from relax_gdn.model.hf_checkpoint.convert import (
    CheckpointMismatchError,
    TextKeys,
    check_shape,
    merge_rule,
    model_tensors,
    resolve_model_names,
    split_rule,
)
from relax_gdn.model.hf_checkpoint.dims import (
    Qwen3_5Dims,
    dims_from_hf_config,
    dims_from_model,
    hf_text_config,
    language_model_config,
    read_hf_config,
    unwrap_model,
)
from relax_gdn.model.hf_checkpoint.plan import TPSplit, conversion_plan, shard_for_tp, unshard_from_tp


SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


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
        text = TextKeys(reader.keys())
        dims = _dims_for_checkpoint(model, reader, text, Path(checkpoint_dir))
        tensors = model_tensors(model)
        plan = conversion_plan(dims)
        names = resolve_model_names(plan, tensors)
        with torch.no_grad():
            for rule in plan:
                full = merge_rule(rule, lambda n: reader[text.lookup(n)])
                local = shard_for_tp(full, rule.tp, tp_size, tp_rank, rule.mcore)
                target = tensors[names[rule.mcore]]
                check_shape(
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
    model, reader: _SafetensorsReader, text: TextKeys, checkpoint_dir: Path
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
        vocab_size = language_model_config(read_hf_config(base_config))["vocab_size"]
    dims = dims_from_model(model, vocab_size=vocab_size)
    tensors = model_tensors(model)
    plan = conversion_plan(dims)
    names = resolve_model_names(plan, tensors)

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
            for name, tensor in split_rule(rule, full).items():
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
    config = hf_text_config(dims, None if base_config is None else read_hf_config(base_config))
    config["dtype"] = str(dtype or next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dims


def gather_from_tp(local: torch.Tensor, split: TPSplit, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor from every TP rank's shard (a collective: every rank of ``tp_group`` calls it)."""
    tp_size = _group_size(tp_group)
    if split.dim is None or tp_size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(shards, local.contiguous(), group=tp_group)
    return unshard_from_tp(shards, split)


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


def _model_tp_group(model: torch.nn.Module, tp_group):
    if tp_group is not None:
        return tp_group
    pgs = getattr(model, "pg_collection", None)
    group = getattr(pgs, "tp", None)
    if group is None or not dist.is_initialized():
        return None
    return group


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


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
