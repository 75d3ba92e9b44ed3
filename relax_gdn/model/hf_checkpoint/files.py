"""Model <-> files: :func:`load_hf_checkpoint` reads safetensors lazily one rule at a time (peak
memory: the largest merged tensor, not the checkpoint), cuts this rank's TP shard and copies it
into the parameter; :func:`save_hf_checkpoint` gathers the shards over TP and writes HF
text-layout safetensors + ``config.json`` (:mod:`.drop_in` writes the layout of a source
checkpoint instead, with the same gathering: :func:`gathered_hf_tensors`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_gdn.model.hf_checkpoint.convert import (
    IGNORED_PREFIXES,
    MTP_PREFIXES,
    VISION_PREFIXES,
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
from relax_gdn.model.hf_checkpoint.plan import (
    TensorRule,
    TPSplit,
    conversion_plan,
    shard_for_tp,
    unshard_from_tp,
)
from relax_gdn.model.hf_checkpoint.source import SAFETENSORS_INDEX, SAFETENSORS_SINGLE


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

    A model with an MTP layer takes the checkpoint's ``mtp.*`` tensors; from a checkpoint without
    any, its MTP layer keeps its initial weights (the returned dimensions then say
    ``mtp_num_layers=0``: what was loaded).

    Returns the dimensions used (with the checkpoint's vocabulary). Raises
    :class:`CheckpointMismatchError` naming the tensor when one is missing, mis-shaped, or unknown.
    """
    model = unwrap_model(model)
    tp_group = _model_tp_group(model, tp_group)
    tp_size, tp_rank = _group_size(tp_group), _group_rank(tp_group)
    reader = _SafetensorsReader(checkpoint_dir)
    try:
        has_mtp = getattr(model, "mtp", None) is not None and any(
            k.startswith(MTP_PREFIXES) for k in reader.keys()
        )
        text = TextKeys(reader.keys(), VISION_PREFIXES if has_mtp else IGNORED_PREFIXES)
        dims = _dims_for_checkpoint(model, reader, text, Path(checkpoint_dir))
        dims = dims if has_mtp else replace(dims, mtp_num_layers=0)
        tensors = {k: v for k, v in model_tensors(model).items() if has_mtp or not k.startswith("mtp.")}
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


# Given model tensors by state-dict name (every rank the same names, in the same order: it may be a
# collective), this rank's fp32 main copies of those that have one (TP shards, like the parameters).
MainParams = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


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
    main_params: MainParams | None = None,
) -> ExportReport | None:
    """Write ``model`` as an HF ``Qwen3_5ForCausalLM`` checkpoint (text layout, safetensors + config.json).

    A collective over ``tp_group`` (default ``model.pg_collection.tp``): every TP rank calls it; the
    shards are gathered and ``writer`` (default: global rank 0) writes. ``vocab_size`` trims a padded
    vocabulary; ``base_config`` (the original checkpoint dir or its config dict) keeps fields the
    model does not know (token ids). Files larger than ``max_shard_bytes`` are split with an index.
    ``dtype`` (default: the model's) is written from ``main_params`` where it is float32 and the
    parameters are narrower. Returns what was written (None on the ranks that do not write).
    """
    model, tp_group, writer = export_ranks(model, tp_group, writer)
    if vocab_size is None and base_config is not None:
        vocab_size = language_model_config(read_hf_config(base_config))["vocab_size"]
    dims = dims_from_model(model, vocab_size=vocab_size)
    model_dtype = next(model.parameters()).dtype
    target = dtype or model_dtype
    # every rank, replicas included: fetching main parameters may be a collective over DP x CP
    main = fp32_main_copies(model, dims, lambda rule: target == torch.float32, main_params)
    if writer is None:
        return None  # a data/context-parallel replica: its TP group need not gather anything

    out = Path(out_dir)
    shards = _SizedShards(out, max_shard_bytes) if writer else None
    for _, name, tensor in gathered_hf_tensors(model, dims, tp_group, writer, main):
        shards.add(name, tensor.to(target))
    if not writer:
        return None
    files = shards.finish()
    config = hf_text_config(dims, None if base_config is None else read_hf_config(base_config))
    config["dtype"] = str(target).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    written = [name for _, keys in shards.files for name in keys]
    from_main = _hf_names_of(dims, main)
    rounded = (
        set(written) - set(from_main) if target == torch.float32 and model_dtype != torch.float32 else ()
    )
    return ExportReport(
        out=out,
        architecture=config["architectures"][0],
        files=files,
        trained=written,
        fp32_from_main=from_main,
        fp32_from_weights=sorted(rounded),
    )


class _SizedShards:
    """Tensors into ``model-part-*`` files of at most ``max_bytes`` (one tensor larger goes alone),
    renamed to HF's names at the end (:func:`_finish_files`)."""

    def __init__(self, out: Path, max_bytes: int):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = self.total_bytes = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.clone()  # own storage: splits are views of one merged tensor
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        if self.pending:
            name = f"model-part-{len(self.files):05d}.safetensors"
            write_safetensors(self.pending, self.out / name)
            self.files.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        self._flush()
        return _finish_files(self.out, self.files, self.total_bytes)


@dataclass
class ExportReport:
    """What an export wrote, for the person who runs it (:meth:`lines`)."""

    out: Path
    architecture: str
    files: list[str]  # the safetensors files
    trained: list[str]  # HF tensors written from the run
    copied: list[str] = field(default_factory=list)  # copied bit for bit from the source
    added: list[str] = field(default_factory=list)  # trained tensors the source has no place for yet
    fp32_from_main: list[str] = field(default_factory=list)  # fp32, from the fp32 main parameters
    fp32_from_weights: list[str] = field(default_factory=list)  # fp32, from narrower weights (rounded)
    source: Path | None = None  # the checkpoint whose layout was kept
    config_changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # key: (source, export)
    copied_files: list[str] = field(default_factory=list)  # non-weight files from the source
    notes: list[str] = field(default_factory=list)  # set by the caller (tokenizer, ...)

    def lines(self) -> list[str]:
        like = f" in the layout of {self.source}" if self.source is not None else " (text layout)"
        out = [
            f"wrote {self.out}: {self.architecture}{like}, {len(self.files)} safetensors file(s)",
            f"  written from the run: {len(self.trained)} tensors ({_by_prefix(self.trained)})",
        ]
        if self.copied:
            copied = _by_prefix(self.copied)
            out.append(f"  copied bit for bit from the source: {len(self.copied)} tensors ({copied})")
        if self.added:
            out.append(f"  added (the source has none): {_by_prefix(self.added)}")
        if self.fp32_from_main:
            out.append(
                f"  float32 from the fp32 main parameters: {len(self.fp32_from_main)} tensors "
                f"({_by_prefix(self.fp32_from_main)})"
            )
        if self.fp32_from_weights:
            out.append(
                f"  float32 from the run's lower-precision weights (no fp32 main parameters at hand): "
                f"{len(self.fp32_from_weights)} tensors ({_by_prefix(self.fp32_from_weights)})"
            )
        if self.source is not None:
            changes = (
                "; ".join(
                    f"{k}: {a!r} -> {b!r}" for k, a, b in ((k, *v) for k, v in self.config_changes.items())
                )
                or "unchanged"
            )
            out.append(f"  config.json from the source: {changes}")
        if self.copied_files:
            out.append(f"  files copied from the source: {', '.join(self.copied_files)}")
        return out + [f"  {note}" for note in self.notes]


def _by_prefix(names: list[str]) -> str:
    """``model.visual.*: 16, mtp.*: 4, lm_head.weight``: names counted by their module prefix (the
    first part, two under ``model.``); a name alone under its prefix is written out."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        depth = 2 if parts[0] == "model" else 1
        groups.setdefault(".".join(parts[:depth]) + ".*" if len(parts) > depth + 1 else name, []).append(name)
    return ", ".join(f"{k}: {len(v)}" if len(v) > 1 else v[0] for k, v in groups.items())


def export_ranks(model: torch.nn.Module, tp_group, writer: bool | None):
    """``(model, tp_group, writer)`` of an export collective: the unwrapped model, its TP group and
    whether this rank writes (default: global rank 0); ``writer`` None on ranks whose TP group has no
    writer (data/context-parallel replicas: nothing to gather)."""
    model = unwrap_model(model)
    tp_group = _model_tp_group(model, tp_group)
    if writer is None:
        writer = not dist.is_initialized() or dist.get_rank() == 0
    if _group_size(tp_group) > 1 and not _any_in_group(writer, tp_group, next(model.parameters()).device):
        return model, tp_group, None
    return model, tp_group, writer


def fp32_main_copies(
    model: torch.nn.Module,
    dims: Qwen3_5Dims,
    wants_fp32: Callable[[TensorRule], bool],
    main_params: MainParams | None,
) -> dict[str, torch.Tensor]:
    """Plan name -> this rank's fp32 main copy, for the rules ``wants_fp32`` whose parameter is
    narrower than fp32 and that ``main_params`` has (on every rank alike: it may be a collective)."""
    if main_params is None:
        return {}
    tensors = model_tensors(model)
    plan = conversion_plan(_export_dims(dims))
    names = resolve_model_names(plan, tensors)
    wanted = {
        names[rule.mcore]: rule.mcore
        for rule in plan
        if wants_fp32(rule) and tensors[names[rule.mcore]].dtype != torch.float32
    }
    if not wanted:
        return {}
    found = main_params({name: tensors[name] for name in wanted})
    return {wanted[name]: tensor for name, tensor in found.items()}


def gathered_hf_tensors(
    model: torch.nn.Module, dims: Qwen3_5Dims, tp_group, writer: bool, main: Mapping[str, torch.Tensor]
) -> Iterator[tuple[TensorRule, str, torch.Tensor]]:
    """``(rule, HF text-layout name, full tensor on the CPU)`` for every tensor of the export plan
    (lm_head always written), yielded on the writer; every TP rank must run it to its end (the
    gathers are collectives). ``main``: fp32 copies to write instead of the parameters, by plan name."""
    tensors = model_tensors(model)
    plan = conversion_plan(_export_dims(dims))
    names = resolve_model_names(plan, tensors)
    with torch.no_grad():
        for rule in plan:
            local = main.get(rule.mcore, tensors[names[rule.mcore]]).detach()
            full = gather_from_tp(local.reshape(tensors[names[rule.mcore]].shape), rule.tp, tp_group)
            if writer:
                for name, tensor in split_rule(rule, full.to("cpu")).items():
                    yield rule, name, tensor


def _export_dims(dims: Qwen3_5Dims) -> Qwen3_5Dims:
    return replace(dims, lm_head_from_embedding=False)  # an export always writes lm_head: it trains apart


def _hf_names_of(dims: Qwen3_5Dims, main: Mapping[str, torch.Tensor]) -> list[str]:
    return [name for rule in conversion_plan(_export_dims(dims)) if rule.mcore in main for name in rule.hf]


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``path`` written whole or not at all, readable as the umask allows (safetensors itself
    creates its files 0600)."""
    from safetensors.torch import save_file

    partial = path.with_name(f".{path.name}.partial")
    save_file(tensors, str(partial), metadata={"format": "pt"})
    os.chmod(partial, 0o666 & ~_umask())
    os.replace(partial, path)


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


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


def _final_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _finish_files(out: Path, files: list[tuple[str, list[str]]], total_bytes: int) -> list[str]:
    """HF names: one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index; returns them."""
    for stale in [out / SAFETENSORS_SINGLE, out / SAFETENSORS_INDEX, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if len(files) == 1:
        os.replace(out / files[0][0], out / SAFETENSORS_SINGLE)
        return [SAFETENSORS_SINGLE]
    weight_map = {}
    for i, (name, keys) in enumerate(files):
        final = _final_name(i, len(files))
        os.replace(out / name, out / final)
        weight_map.update({k: final for k in keys})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [_final_name(i, len(files)) for i in range(len(files))]
