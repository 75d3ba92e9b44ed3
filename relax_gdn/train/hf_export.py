"""A run's model as a Hugging Face directory, with the tokenizer it trained with: the one function
that ``checkpoint.export_hf_final`` and ``python -m relax_gdn.export_hf`` both call.

Two layouts (docs/checkpoints.md, "What an export holds"):

* the run started from ``model.hf_checkpoint=DIR`` (or ``export_hf --like DIR``): DIR's layout,
  a drop-in replacement (:func:`relax_gdn.model.hf_checkpoint.save_drop_in_checkpoint`);
* otherwise the text layout ``Qwen3_5ForCausalLM`` with the vocabulary trimmed to the tokenizer's
  (:func:`relax_gdn.model.hf_checkpoint.save_hf_checkpoint`).

Either way OUT holds a tokenizer that ``transformers.AutoTokenizer`` loads: the source's, a local
``data.tokenizer`` directory's, or the embedded byte tokenizer written as a Hugging Face one; and a
``generation_config.json`` whose end-of-turn token stops ``generate()``.

A LoRA run (``model.lora``) exports either way people use it (docs/lora.md): the merged model
(:func:`write_merged_lora_export`, the export above with ``W + scaling · B·A``) or the adapters
alone as a PEFT adapter directory for the base (:func:`write_adapter_export`).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_gdn.data.tokenizer import BYTE_TOKENIZER_NAMES, ByteChatTokenizer
from relax_gdn.errors import RecipeError
from relax_gdn.model.hf_checkpoint import (
    ExportReport,
    MainParams,
    save_drop_in_checkpoint,
    save_hf_checkpoint,
)

logger = logging.getLogger("relax_gdn.train")

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class HFExportSpec:
    """What a run's export writes besides the model's weights."""

    vocab_size: int  # the model's vocabulary (padded beyond the tokenizer's in a run started from scratch)
    tokenizer_vocab_size: int | None  # the text layout trims the vocabulary to it
    tokenizer: str | None  # data.tokenizer: the embedded one ("embedded", "byte", None) or a local directory
    like: Path | None = None  # the checkpoint whose layout the export keeps; None: the text layout
    dtype: torch.dtype | None = None  # text layout: the dtype written (None: the model's); drop-in: unused


def export_spec(
    manifest: dict, *, like: Path | None | str = "recorded", dtype: torch.dtype | None = None
) -> HFExportSpec:
    """The export of the run a checkpoint manifest (or a run's ``manifest_base``) describes:
    ``like="recorded"`` keeps the layout of the checkpoint the run started from (the manifest's
    ``model.hf_checkpoint``), a path another checkpoint's, None the text layout."""
    model = manifest["model"]
    source = model.get("hf_checkpoint")
    if like == "recorded":
        like = Path(source) if source else None
    return HFExportSpec(
        vocab_size=model["vocab_size"],
        # a run started from a checkpoint has its vocabulary, unpadded: nothing to trim
        tokenizer_vocab_size=None if source else (manifest.get("tokenizer") or {}).get("vocab_size"),
        tokenizer=manifest["config"]["data"]["tokenizer"],
        like=like,
        dtype=dtype,
    )


def local_tokenizer_dir(tokenizer_key: str | None) -> str | None:
    """``data.tokenizer`` when it is a local HF tokenizer directory (what an export can copy)."""
    if tokenizer_key and tokenizer_key not in BYTE_TOKENIZER_NAMES and Path(tokenizer_key).is_dir():
        return tokenizer_key
    return None


def write_hf_export(
    model,
    out: Path,
    spec: HFExportSpec,
    *,
    main_params: MainParams | None = None,
    unchanged: Collection[str] = (),
    writer: bool | None = None,
) -> ExportReport | None:
    """Write the export (module docstring): a collective over the model's TP group, ``writer``
    (default: global rank 0) writes and gets the report (None elsewhere). ``main_params``: the fp32
    main parameters of a bf16 run, for the tensors written in float32; ``unchanged``: the HF tensors
    (text-layout names) the run kept as its source has them, which a drop-in export copies."""
    tokenizer_dir = local_tokenizer_dir(spec.tokenizer)
    if spec.like is not None:
        same_tokenizer = tokenizer_dir is not None and Path(tokenizer_dir).resolve() == spec.like.resolve()
        report = save_drop_in_checkpoint(
            model,
            out,
            spec.like,
            main_params=main_params,
            writer=writer,
            keep_source_tokenizer=same_tokenizer,
            unchanged=unchanged,
        )
    else:
        same_tokenizer = False
        vocab = min(spec.tokenizer_vocab_size or spec.vocab_size, spec.vocab_size)
        report = save_hf_checkpoint(
            model, out, vocab_size=vocab, dtype=spec.dtype, main_params=main_params, writer=writer
        )
    if report is None:  # not the writer
        return None
    if not same_tokenizer:
        written, note = _write_tokenizer(out, spec.tokenizer)
        report.notes.append(note)
        if not written:
            return report
    if not (out / GENERATION_CONFIG).is_file():
        report.notes.append(_write_generation_config(out, tokenizer_dir))
    return report


def write_merged_lora_export(
    model, out: Path, spec: HFExportSpec, writer: bool | None = None
) -> ExportReport | None:
    """A LoRA run's model with its adapters merged (``W + scaling · B·A``) as the export of
    :func:`write_hf_export`: in a drop-in export the tensors no adapter changed are copied from the
    source bit for bit. Takes the adapters out of ``model`` (a collective like the export)."""
    from relax_gdn.model.hf_checkpoint import dims_from_model
    from relax_gdn.model.hf_checkpoint.plan import conversion_plan
    from relax_gdn.model.lora_export import merge_lora_adapters

    changed = {f"{module}.weight" for module in merge_lora_adapters(model)}
    dims = dims_from_model(model, probe_norms=False)
    unchanged = {name for rule in conversion_plan(dims) for name in rule.hf if name not in changed}
    return write_hf_export(model, out, spec, unchanged=unchanged, writer=writer)


def write_adapter_export(
    model, out: Path, spec: HFExportSpec, dropout: float = 0.0, writer: bool | None = None
):
    """A LoRA run's adapters as a PEFT adapter directory for the Hugging Face base the run started
    from (``spec.like``); a collective over the model's TP groups, the report on global rank 0."""
    from relax_gdn.model.hf_checkpoint.peft import save_peft_adapter

    if spec.like is None:
        raise RecipeError(
            "the run's base is the preset's seeded initialisation (no model.hf_checkpoint), which no "
            "Hugging Face model holds, so a PEFT adapter has nothing to load onto: export the merged "
            "model instead (without --adapter)"
        )
    return save_peft_adapter(model, out, spec.like, dropout=dropout, writer=writer)


def write_run_export(model, out: Path, spec: HFExportSpec, *, lora, main_params: MainParams | None) -> None:
    """``checkpoint.export_hf_final``: the run's export into ``out`` (a collective), logged by the
    writing rank. A LoRA run (``lora``: its ``LoRAOptions``) writes the merged model there, and on a
    Hugging Face base first its PEFT adapters into ``hf_adapter`` beside it. Each directory is
    renamed into place once whole."""
    if lora is None:
        _log_export(_written_whole(out, lambda d: write_hf_export(model, d, spec, main_params=main_params)))
        return
    if spec.like is not None:  # the adapters for the HF base, then (which takes them out) merged
        _log_export(
            _written_whole(
                out.with_name("hf_adapter"),
                lambda d: write_adapter_export(model, d, spec, dropout=lora.dropout),
            )
        )
    _log_export(_written_whole(out, lambda d: write_merged_lora_export(model, d, spec)))


def _log_export(report) -> None:
    if report is not None:
        for line in ["Hugging Face export:", *report.lines()]:
            logger.info("%s", line)


def _written_whole(out: Path, write: Callable[[Path], Any]):
    """``write(directory)`` into a directory beside ``out``, renamed to ``out`` once whole: a
    directory named ``out`` is always a complete export. Its report (None on ranks that do not write)."""
    partial = out.with_name(f".{out.name}.partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    report = write(partial)
    if report is not None:  # the writing rank
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
        report.out = out
    return report


def _write_tokenizer(out: Path, tokenizer: str | None) -> tuple[bool, str]:
    """The tokenizer the run trained with into ``out``: (whether one was written, a note)."""
    if tokenizer is None or tokenizer in BYTE_TOKENIZER_NAMES:
        ByteChatTokenizer().save_pretrained(out)
        return True, "tokenizer: the embedded byte tokenizer the run trained with, as a Hugging Face one"
    if local_tokenizer_dir(tokenizer) is None:  # a relative path, exported from another directory
        return False, (
            f"tokenizer: NOT written: data.tokenizer={tokenizer} is not a directory from here; "
            f"copy its tokenizer files into {out}"
        )
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tokenizer, local_files_only=True).save_pretrained(out)
    return True, f"tokenizer: data.tokenizer={tokenizer} (the one the run trained with)"


def _write_generation_config(out: Path, tokenizer_dir: str | None) -> str:
    """The tokenizer directory's generation_config.json (a model directory used as the tokenizer
    has one), else one naming the tokenizer's end-of-turn and padding tokens."""
    if tokenizer_dir is not None and (Path(tokenizer_dir) / GENERATION_CONFIG).is_file():
        shutil.copyfile(Path(tokenizer_dir) / GENERATION_CONFIG, out / GENERATION_CONFIG)
        return f"{GENERATION_CONFIG}: from {tokenizer_dir}"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad}
    (out / GENERATION_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    eos = f"eos_token_id={config['eos_token_id']} ({tokenizer.eos_token})"
    return f"{GENERATION_CONFIG}: {eos}, pad_token_id={pad}"
