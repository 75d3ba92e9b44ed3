"""A drop-in export: the model written in the layout of the checkpoint the run started from, so it
replaces that checkpoint where it was served.

Every tensor of the source is in the export under its source name, shape and dtype, in the same
file it was in (same shard names, an index with the same map): the tensors the run trains are
written from the model (cast to the source's dtype; a float32 source tensor of a bf16 run comes
from the fp32 main parameters when they are at hand), the rest are copied bit for bit.
:func:`tensor_origins` is the one place that decides which is which, and refuses a source tensor
that is neither (it would be lost). ``config.json`` is the source's with only what training
changed; the source's other files (tokenizer, chat template, ``generation_config.json``,
processor files) are copied.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Collection, Iterable
from enum import StrEnum
from pathlib import Path

import torch
import torch.distributed as dist

from relax_gdn.model.hf_checkpoint.convert import (
    IGNORED_PREFIXES,
    MTP_PREFIXES,
    CheckpointMismatchError,
    text_layout_name,
)
from relax_gdn.model.hf_checkpoint.dims import (
    MTP_CONFIG_KEY,
    Qwen3_5Dims,
    dims_from_hf_config,
    dims_from_model,
    unwrap_model,
)
from relax_gdn.model.hf_checkpoint.files import (
    ExportReport,
    MainParams,
    _export_dims,
    _hf_names_of,
    export_ranks,
    fp32_main_copies,
    gathered_hf_tensors,
    write_safetensors,
)
from relax_gdn.model.hf_checkpoint.plan import conversion_plan
from relax_gdn.model.hf_checkpoint.source import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, HFCheckpoint


class Origin(StrEnum):
    """Where a drop-in export takes a source tensor from."""

    TRAINED = "trained"  # written from the run's model
    COPIED = "copied"  # copied bit for bit from the source


# Source tensors the run does not train, copied bit for bit: the vision tower and the
# multi-token-prediction layer. A name the run's plan writes is TRAINED whatever its prefix (the
# MTP layer of a run that trains one: its conversion plan writes ``mtp.*``).
COPIED_PREFIXES = IGNORED_PREFIXES
# a tied source (no lm_head) gets the run's untied output layer; a source without an MTP layer the
# run's trained one
ADDABLE = ("lm_head.weight",)
ADDABLE_PREFIXES = MTP_PREFIXES
# the files of a tokenizer (left out of the copy when the run trained with another one)
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",
        "chat_template.jinja",
        "chat_template.json",
    }
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = (SAFETENSORS_INDEX, "pytorch_model.bin.index.json")


def tensor_origins(
    source: HFCheckpoint, trained: dict[str, tuple[int, ...]], unchanged: Collection[str] = ()
) -> tuple[dict[str, Origin], list[str]]:
    """For each tensor of ``source``: :attr:`Origin.TRAINED` when the run writes its text-layout name
    (``trained``: HF text-layout name -> shape, every tensor the export plan writes, ``mtp.*`` too
    when the run trains an MTP layer), else :attr:`Origin.COPIED` for the vision tower and MTP
    prefixes and for ``unchanged`` (text-layout names of tensors the run kept as the source has
    them: a LoRA run's frozen base). Returns ``(origins by source name, trained names the source
    lacks and may gain: an untied output layer, an MTP layer)``. Raises
    :class:`CheckpointMismatchError` naming the source tensors it cannot place (they would be
    lost), a trained tensor whose shape differs from the source's, and trained tensors the source
    has no place for."""
    trained = {name: shape for name, shape in trained.items() if name not in unchanged}
    origins: dict[str, Origin] = {}
    lost, misshaped = [], []
    for name, tensor in source.tensors.items():
        text = text_layout_name(name)
        if text in unchanged:
            origins[name] = Origin.COPIED
        elif text in trained:
            origins[name] = Origin.TRAINED
            if tuple(trained[text]) != tensor.shape:
                misshaped.append(f"{name} {tensor.shape} (the run's: {tuple(trained[text])})")
        elif name.startswith(COPIED_PREFIXES):
            origins[name] = Origin.COPIED
        else:
            lost.append(name)
    covered = {text_layout_name(n) for n in source.tensors}
    missing = [n for n in trained if n not in covered]
    unplaced = [n for n in missing if n not in ADDABLE and not n.startswith(ADDABLE_PREFIXES)]
    where = f"the source checkpoint {source.directory}"
    problems = []
    if lost:
        problems.append(
            f"{len(lost)} tensor(s) of {where} are neither trained by the run nor copied (vision "
            f"tower, MTP), so the export would lose them: {lost[:5]}"
        )
    if misshaped:
        problems.append(
            f"{len(misshaped)} tensor(s) of {where} differ in shape from the run's: {misshaped[:5]}"
        )
    if unplaced:
        problems.append(f"the run has {len(unplaced)} tensor(s) {where} lacks: {unplaced[:5]}")
    if problems:
        raise CheckpointMismatchError(
            "; ".join(problems) + "; export with --like pointing at the checkpoint the "
            "run started from, or with --like none for the text layout"
        )
    return origins, missing


def drop_in_origins(
    source: HFCheckpoint, dims: Qwen3_5Dims, unchanged: Collection[str] = ()
) -> tuple[dict[str, Origin], list[str]]:
    """:func:`tensor_origins` of ``source`` for an export of a model of ``dims`` (every tensor its plan
    writes, lm_head included, but ``unchanged``); callable before any model exists, from the
    preset's dims."""
    trained = {
        name: shape
        for rule in conversion_plan(_export_dims(dims))
        for name, shape in zip(rule.hf, rule.hf_shapes)
    }
    return tensor_origins(source, trained, unchanged)


def save_drop_in_checkpoint(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    source_dir: str | os.PathLike,
    *,
    tp_group: dist.ProcessGroup | None = None,
    writer: bool | None = None,
    main_params: MainParams | None = None,
    keep_source_tokenizer: bool = True,
    unchanged: Collection[str] = (),
) -> ExportReport | None:
    """Write ``model`` in the layout of the HF checkpoint ``source_dir`` (module docstring).

    A collective over ``tp_group`` like :func:`~.files.save_hf_checkpoint`; ``main_params``: the fp32
    main parameters of a bf16 run (float32 source tensors are written from them where they are at
    hand). ``keep_source_tokenizer=False`` leaves the source's tokenizer files out (the caller writes
    the one the run trained with). ``unchanged``: text-layout names the run kept as the source has
    them (a LoRA run's frozen base), copied bit for bit instead of written. Raises :class:`CheckpointMismatchError` before writing anything
    when a source tensor cannot be placed. Returns what was written (None on ranks that do not write).
    """
    model, tp_group, writer = export_ranks(model, tp_group, writer)
    try:  # every rank: the dtypes decide which fp32 copies to fetch
        source = HFCheckpoint.read(source_dir)
    except FileNotFoundError as e:
        raise CheckpointMismatchError(f"the source checkpoint {source_dir} cannot be read: {e}") from e
    dims = _model_dims(model, source)
    unchanged = frozenset(unchanged)
    origins, added = drop_in_origins(source, dims, unchanged)
    dtype_of = {n: d for n, d in _written_dtypes(source, dims).items() if n not in unchanged}
    trained, by_text = list(dtype_of), source.by_text_name()
    # every rank, replicas included: fetching main parameters may be a collective over DP x CP
    main = fp32_main_copies(
        model, dims, lambda rule: any(dtype_of.get(n) == torch.float32 for n in rule.hf), main_params
    )
    if writer is None:
        return None
    out = Path(out_dir)
    shards = _ShardWriter(source, out, origins, added) if writer else None
    for _, text, tensor in gathered_hf_tensors(model, dims, tp_group, writer, main):
        if text not in unchanged:
            shards.add(by_text.get(text, text), tensor.to(dtype_of[text]))
    if not writer:
        return None
    report = ExportReport(
        out=out,
        architecture=(source.config.get("architectures") or ["?"])[0],
        files=shards.finish(),
        source=source.directory,
        trained=[n for n, o in origins.items() if o is Origin.TRAINED] + added,
        copied=[n for n, o in origins.items() if o is Origin.COPIED],
        added=added,
        config_changes=_write_config(source, out, added),
        copied_files=_copy_source_files(source.directory, out, keep_source_tokenizer),
    )
    narrow = next(unwrap_model(model).parameters()).dtype != torch.float32
    from_main = set(_hf_names_of(dims, main))
    fp32 = [t for t in trained if narrow and dtype_of[t] == torch.float32]
    report.fp32_from_main = [by_text.get(t, t) for t in trained if t in from_main]
    report.fp32_from_weights = [by_text.get(t, t) for t in fp32 if t not in from_main]
    return report


def _written_dtypes(source: HFCheckpoint, dims: Qwen3_5Dims) -> dict[str, torch.dtype]:
    """Text-layout name -> dtype written, for every tensor the export plan writes: the source
    tensor's (an added output layer takes the embedding's)."""
    by_text = source.by_text_name()
    embedding = source.tensors[by_text["model.embed_tokens.weight"]].dtype
    names = [name for rule in conversion_plan(_export_dims(dims)) for name in rule.hf]
    return {name: source.tensors[by_text[name]].dtype if name in by_text else embedding for name in names}


def _model_dims(model: torch.nn.Module, source: HFCheckpoint) -> Qwen3_5Dims:
    if source.config is None:
        raise CheckpointMismatchError(f"the source checkpoint {source.directory} has no config.json")
    vocab = dims_from_hf_config(source.config).vocab_size
    model_vocab = unwrap_model(model).vocab_size
    if model_vocab < vocab:
        raise CheckpointMismatchError(
            f"the model's vocabulary ({model_vocab}) is smaller than that of the source checkpoint "
            f"{source.directory} ({vocab}): it is not the checkpoint the run started from; export with "
            "--like pointing at that one, or with --like none for the text layout"
        )
    return dims_from_model(model, vocab_size=vocab)


class _ShardWriter:
    """Writes each of the source's files once all its trained tensors have arrived (peak memory:
    the files in progress), the copied tensors read from the source file as it is written."""

    def __init__(self, source: HFCheckpoint, out: Path, origins: dict[str, Origin], added: list[str]):
        if out.resolve() == source.directory.resolve():
            raise CheckpointMismatchError(
                f"the export directory {out} is the source checkpoint itself: write the export elsewhere"
            )
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("*.safetensors"), out / SAFETENSORS_INDEX]:
            stale.unlink(missing_ok=True)
        self.source, self.out, self.origins = source, out, origins
        self.file_of = {name: t.file for name, t in source.tensors.items()}
        self.file_of.update({name: source.files[-1] for name in added})
        self.waiting = {file: set() for file in source.files}
        for name, file in self.file_of.items():
            if name in added or origins[name] is Origin.TRAINED:
                self.waiting[file].add(name)
        self.pending: dict[str, dict[str, torch.Tensor]] = {file: {} for file in source.files}
        self.total_bytes = 0
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        file = self.file_of[name]
        self.pending[file][name] = tensor.clone()  # own storage: splits are views of one merged tensor
        self.waiting[file].discard(name)
        if not self.waiting[file]:
            self._write(file)

    def _write(self, file: str) -> None:
        from safetensors import safe_open

        tensors = self.pending.pop(file)
        copied = [n for n, f in self.file_of.items() if f == file and self.origins.get(n) is Origin.COPIED]
        if copied:
            with safe_open(self.source.directory / file, "pt") as f:
                tensors.update({n: f.get_tensor(n) for n in copied})
        write_safetensors(tensors, self.out / file)
        self.total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self.weight_map.update({n: file for n in tensors})

    def finish(self) -> list[str]:
        for file in list(self.pending):  # files holding only copied tensors
            if self.waiting[file]:
                raise RuntimeError(f"the export never received {sorted(self.waiting[file])[:5]} of {file}")
            self._write(file)
        if self.source.sharded:
            order = {name: i for i, name in enumerate(self.file_of)}
            index = {
                "metadata": {**self.source.index_metadata, "total_size": self.total_bytes},
                "weight_map": dict(sorted(self.weight_map.items(), key=lambda kv: order[kv[0]])),
            }
            (self.out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return list(self.source.files) if self.source.sharded else [SAFETENSORS_SINGLE]


def _write_config(source: HFCheckpoint, out: Path, added: Iterable[str]) -> dict[str, tuple]:
    """The source's config.json, changed only where training changed the model: an output layer
    added to a tied source unties it; an MTP layer added to a source without one is counted where
    the language model's sizes are (``text_config`` of a VLM). Returns the changes (key: (source,
    export))."""
    config = json.loads(json.dumps(source.config))
    changes: dict[str, tuple] = {}
    scopes = [("", config)] + ([("text_config.", config["text_config"])] if "text_config" in config else [])
    if "lm_head.weight" in added:  # HF's default is tied: say untied wherever the flag is read
        for scope, part in scopes:
            if part.get("tie_word_embeddings") is not False:
                changes[f"{scope}tie_word_embeddings"] = (part.get("tie_word_embeddings"), False)
                part["tie_word_embeddings"] = False
    mtp_layers = len({n.split(".")[2] for n in added if n.startswith("mtp.layers.")})
    scope, part = scopes[-1]
    if mtp_layers and part.get(MTP_CONFIG_KEY) != mtp_layers:
        changes[f"{scope}{MTP_CONFIG_KEY}"] = (part.get(MTP_CONFIG_KEY), mtp_layers)
        part[MTP_CONFIG_KEY] = mtp_layers
    if changes:
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    else:
        shutil.copyfile(source.directory / "config.json", out / "config.json")
    return changes


def _copy_source_files(source: Path, out: Path, keep_tokenizer: bool) -> list[str]:
    """Every top-level file of the source but the weights and config.json (tokenizer, chat template,
    generation and processor configs, README, licence), bit for bit."""
    copied = []
    for path in sorted(source.iterdir()):
        name = path.name
        if (
            not path.is_file()
            or name.startswith(".")
            or name == "config.json"
            or name in _WEIGHT_INDEXES
            or name.endswith(_WEIGHT_SUFFIXES)
            or (not keep_tokenizer and name in TOKENIZER_FILES)
        ):
            continue
        shutil.copyfile(path, out / name)
        copied.append(name)
    return copied
