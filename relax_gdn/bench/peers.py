"""The same SFT batches through Hugging Face transformers (+ peft) and through relax-gdn, in one
process: what a user who trains Qwen3.5 with LLaMA-Factory, ms-swift or axolotl gains by switching.

    python -m relax_gdn.bench.peers --preset qwen3_5_9b --doc-tokens 8192 --out peers_8k.json    # 1 GPU
    python -m relax_gdn.bench.peers --preset qwen3_5_9b --doc-tokens 32768 --out peers_32k.json
    python -m relax_gdn.bench.peers --preset qwen3_5_tiny --steps 3                              # CPU

Both sides start from one Hugging Face checkpoint: ``--hf-checkpoint DIR`` (text layout,
``Qwen3_5ForCausalLM``), or a random ``Qwen3_5ForCausalLM`` of the preset's sizes written once into
``--init-dir`` and reused by later runs (HF's initialisation; the norms, ``A_log`` and ``dt_bias``,
which HF sets to constants, moved by seeded noise so that every tensor shapes the loss). HF loads
it with ``from_pretrained``, relax-gdn through ``model.hf_checkpoint``.

Data: every step is ``--docs-per-step`` random-token SFT documents of ``--doc-tokens`` tokens (a
prompt without loss, then the response; ``relax_gdn.data.length_matched_samples``), the same
documents on both sides: the global batch of step ``s`` is ``relax_gdn.data.global_batch_at_step``'s.
HF runs one document per forward (batch 1, no padding: neither padding nor packing work is
counted on its side); relax-gdn runs one document per micro-batch (``train.max_tokens_per_gpu`` = the
document), and the ``packed`` row packs every document of a step into one micro-batch.

Workloads (``--workloads``): ``full`` (every weight trains) and ``lora`` (PEFT's LoRA on HF, r
``--lora-rank`` with alpha 2 x r on the targets of relax-gdn's ``model.lora`` default: every
projection of the GDN and attention layers and the MLPs). The optimizer is AdamW on both sides
(HF's default fused AdamW with relax-gdn's ``optim.*``), or, where the memory model says Adam's
state does not fit the GPU (the full 9B on one GPU), forward + backward without an update on
both (``--optimizer`` overrides).

Rows (``--rows``, ``;``-separated, each run for every workload): ``hf`` and its settings
(``relax_gdn.bench.hf_peer.HFSettings``: ``ckpt`` activation checkpointing, ``liger`` Liger's
kernels, ``fp8`` / ``fp8=<recipe>`` torchao float8 with ``torch.compile`` per decoder block,
``compile``, ``attn=<impl>``), or ``relax`` and settings in ``bench.train_e2e``'s variant syntax
(``recompute=full``, ``mt=``, ``fused=off``, any ``<group.key>=<value>``, e.g.
``model.fp8.recipe=tensorwise``), plus ``recompute=best`` (what a bare ``relax`` row runs: no
recompute where the memory model fits it on this GPU, else selective, else ``mixed`` with its
fewest whole layers) and ``packed``. Default: ``hf``, ``hf,ckpt`` (the peer most runs fit in),
``hf,ckpt,liger``, ``hf,fp8``, ``relax`` (best) and ``relax,recompute=full`` (the checkpointing
HF's ``ckpt`` does: each layer keeps its input only), plus ``relax,packed`` with several documents
per step. A row whose package is missing or that cannot run on this device is listed with why.

Same model, proved: before any row, one untimed HF step (``hf,ckpt``; ``hf,ckpt,liger`` where that
runs out of memory, :data:`REFERENCE_ROWS`) on the first batch gives the reference loss (mean per
loss token of the batch) and gradient norm (fp32, before clipping, over what trains). Every row's
first step must equal it (:data:`LOSS_RTOL`: 1e-5 in fp32 on CPU, 1e-3 in bf16; rows with float8
linears 1e-2; the gradient norm 1e-2, 1e-1 with float8; a relax-gdn row without an optimizer has no
gradient norm to compare); a row that disagrees is shown as such, without its timing.

Per row: medians over the steps after ``--skip`` of tokens/s, MFU (``relax_gdn.train.flops``, the
same count for both sides), the peak GPU memory over its steps (``max_memory_allocated``), and its
tok/s over ``--baseline-row``'s (HF with checkpointing unless named) and over the fastest HF row.
A row that runs out of memory shows ``OOM`` with the memory it asked for (and the steps it ran);
one the memory model refuses shows the estimate. ``--out X.json`` writes the JSON (``meta``,
``workloads`` with their reference step and rows: ``records`` in the schema of metrics.jsonl,
``summary``, ``agreement``) after every row and ``X.md`` (the tables) at the end; the rich tables
(each row's note under its table) are printed last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relax_gdn.bench.hf_peer import (
    Batches,
    HFSettings,
    existing_init_problem,
    init_marker,
    out_of_memory,
    parse_hf_settings,
)
from relax_gdn.bench.needs import add_cuda_alloc_conf, apply_cuda_alloc_conf, require_gpus, resolve_skip
from relax_gdn.config import RunConfig

WORKLOADS = ("lora", "full")
BASE_ROWS = ("hf", "hf,ckpt", "hf,ckpt,liger", "hf,fp8", "relax", "relax,recompute=full")
# the HF rows that give the reference step, in order: the next only where the one before ran out of
# memory (hf,ckpt at 32k on an 80 GB card, with its 32k x 248k fp32 logits); liger's fused linear
# cross-entropy never holds those logits, and agrees with hf,ckpt to 2e-5 in loss and 2e-3 in
# gradient norm where both fit (one H200, 32k: docs/benchmarks.md)
REFERENCE_ROWS = ("hf,ckpt", "hf,ckpt,liger")
LOSS_RTOL = {"fp32": 1e-5, "bf16": 1e-3, "fp8": 1e-2}
GRAD_NORM_RTOL = {"fp32": 1e-2, "bf16": 1e-2, "fp8": 1e-1}
CPU_PRESET = "qwen3_5_tiny"
LOG_WIDTH = 240  # columns of the table printed where stdout is not a terminal


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One ``--rows`` entry: its text, its side and that side's settings."""

    spec: str
    side: str  # "hf" or "relax"
    hf: HFSettings | None = None  # hf rows
    overrides: dict = field(
        default_factory=dict
    )  # config overrides (relax rows); recompute "best" resolved later

    @property
    def fp8(self) -> bool:
        if self.side == "hf":
            return self.hf.fp8 is not None
        return any(
            k.startswith("model.fp8") and v not in (None, False, "none", "off")
            for k, v in self.overrides.items()
        )


def default_rows(docs_per_step: int) -> list[str]:
    return list(BASE_ROWS) + (["relax,packed"] if docs_per_step > 1 else [])


def parse_row(spec: str, packed_tokens: int) -> Row:
    """A :class:`Row` of ``spec``; ``packed_tokens``: the micro-batch of ``packed`` (one step's documents).
    ``ValueError`` naming what is wrong."""
    from relax_gdn.bench.train_e2e import variant_overrides, variant_settings

    side, *words = variant_settings(spec) or [""]
    if side == "hf":
        return Row(spec, "hf", hf=parse_hf_settings(words))
    if side != "relax":
        raise ValueError(f"row {spec!r}: a row starts with hf or relax")
    overrides: dict = {"recompute.granularity": "best"}
    rest = []
    for word in words:
        if word == "packed":
            overrides["train.max_tokens_per_gpu"] = packed_tokens
        elif word == "recompute=best":
            continue
        else:
            rest.append(word)
    try:
        return Row(spec, "relax", overrides=overrides | variant_overrides(",".join(rest), 1))
    except ValueError as e:
        raise ValueError(f"row {spec!r}: {e}") from None


def precision(row: Row, device: torch.device) -> str:
    return "fp8" if row.fp8 else ("bf16" if device.type == "cuda" else "fp32")


def agreement(first: dict | None, reference: dict | None, kind: str) -> dict:
    """How a row's first step compares with the HF reference step (``kind``: fp32 / bf16 / fp8)."""
    out = {"loss_rtol": LOSS_RTOL[kind], "grad_norm_rtol": GRAD_NORM_RTOL[kind]}
    if first is None:
        return out | {"agrees": None, "why": "no first step"}
    if reference is None:
        return out | {"agrees": None, "why": "no HF reference step"}
    loss_rel = abs(first["loss"] - reference["loss"]) / abs(reference["loss"])
    out |= {"loss": first["loss"], "loss_rel": loss_rel, "grad_norm": first.get("grad_norm")}
    problems = (
        [f"loss {first['loss']:.6g} vs HF {reference['loss']:.6g} (rel {loss_rel:.1e} > {LOSS_RTOL[kind]:g})"]
        if not loss_rel <= LOSS_RTOL[kind]
        else []
    )
    if first.get("grad_norm") is not None and reference.get("grad_norm"):
        grad_rel = abs(first["grad_norm"] - reference["grad_norm"]) / reference["grad_norm"]
        out["grad_norm_rel"] = grad_rel
        if not grad_rel <= GRAD_NORM_RTOL[kind]:
            problems.append(
                f"grad norm {first['grad_norm']:.6g} vs HF {reference['grad_norm']:.6g} "
                f"(rel {grad_rel:.1e} > {GRAD_NORM_RTOL[kind]:g})"
            )
    return out | {"agrees": not problems, "why": "; ".join(problems) or None}


# ---------------------------------------------------------------------------------------------
# the relax-gdn side: configurations
# ---------------------------------------------------------------------------------------------


def base_config(args, checkpoint: str, device: torch.device) -> RunConfig:
    """The run configuration every relax-gdn row starts from."""
    from relax_gdn.data import padded_length

    return RunConfig().with_overrides(
        {
            "model.preset": args.preset,
            "model.hf_checkpoint": checkpoint,
            "model.mtp.num_layers": 0,
            "train.steps": args.steps,
            "train.global_batch_size": args.docs_per_step,
            "train.max_tokens_per_gpu": padded_length(args.doc_tokens, 1),
            "train.device": device.type,
            "train.seed": args.seed,
            "data.num_samples": args.docs_per_step * args.steps,
            "data.max_sample_tokens": None,
            "optim.warmup_steps": 1,
            "optim.lr": args.lr,
            "optim.min_lr": args.lr / 10,
            # no sync debug mode (a check per CUDA call) that the HF rows would run without
            "logging.console": False,
            "logging.jsonl": False,
            "logging.count_host_syncs": False,
        }
    )


def workload_overrides(workload: str, lora_rank: int) -> dict:
    return {"model.lora.rank": lora_rank if workload == "lora" else 0}


def _memory(cfg, vocab: int, optimizer: str, **change) -> float:
    """The memory model's estimate (bytes) of ``cfg`` on one bf16 GPU, with ``change``."""
    from relax_gdn.config import ParallelDims
    from relax_gdn.train.build import memory_inputs
    from relax_gdn.train.memory import estimate_memory

    shape, settings = memory_inputs(cfg, ParallelDims(1, 1, 1), True, vocab)
    return estimate_memory(shape, **{**settings, "optimizer": optimizer, **change}).total


def workload_optimizer(cfg, device: torch.device, vocab: int, requested: str) -> tuple[str, str]:
    """``("adam" | "none", why)``: Adam where its state fits the GPU under full recompute (the least
    memory), the same for every row of the workload, HF's included."""
    if requested != "auto":
        return requested, "requested"
    if device.type != "cuda":
        return "adam", "no GPU memory to fit"
    from relax_gdn.train.build import device_memory_bytes
    from relax_gdn.train.memory import GIB

    need, have = _memory(cfg, vocab, "adam", recompute="full"), device_memory_bytes(device)
    if need <= have:
        return "adam", "fits"
    return "none", (
        f"Adam state does not fit: estimate {need / GIB:.0f} GiB > {have / GIB:.0f} GiB; forward + "
        "backward without an update on both sides"
    )


def best_recompute(cfg, device: torch.device, vocab: int, optimizer: str) -> str:
    """``recompute=best``: none where the memory model fits it on this GPU, else selective, else
    mixed (whose whole layers the run picks); none without a GPU."""
    if device.type != "cuda":
        return "none"
    from relax_gdn.train.build import device_memory_bytes
    from relax_gdn.train.memory import MIXED_HEADROOM

    budget = device_memory_bytes(device) * MIXED_HEADROOM
    for granularity in ("none", "selective"):
        if _memory(cfg, vocab, optimizer, recompute=granularity, full_layers=0) <= budget:
            return granularity
    return "mixed"


def relax_row_config(
    base, workload_keys: dict, row: Row, *, device: torch.device, vocab: int, optimizer: str
):
    """The configuration of a relax-gdn row (``recompute=best`` resolved) and its overrides."""
    overrides = {**workload_keys, **row.overrides}
    cfg = base.with_overrides({k: v for k, v in overrides.items() if k != "recompute.granularity"})
    if overrides["recompute.granularity"] == "best":
        overrides["recompute.granularity"] = best_recompute(cfg, device, vocab, optimizer)
    return cfg.with_overrides({"recompute.granularity": overrides["recompute.granularity"]}), overrides


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bench:
    """What every row of a run shares."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    checkpoint: Path
    vocab: int
    batches: Batches
    base: RunConfig  # what every relax-gdn row starts from
    runtime: object  # the process's relax_gdn.runtime.Runtime (the relax-gdn rows run in it)


def run_hf(bench: Bench, name: str, settings: HFSettings, *, lora, optimizer: str, steps: int) -> dict:
    from relax_gdn.bench.hf_peer import run_hf_row
    from relax_gdn.model import qwen3_5_config
    from relax_gdn.train.flops import ModelShape

    shape = ModelShape.from_transformer_config(qwen3_5_config(bench.args.preset), bench.vocab, lora=lora)
    return run_hf_row(
        name,
        settings,
        checkpoint=bench.checkpoint,
        lora=lora,
        batches=bench.batches,
        steps=steps,
        skip=bench.args.skip,
        optimizer=optimizer,
        optim=bench.base.optim,
        shape=shape,
        device=bench.device,
        dtype=bench.dtype,
    )


def run_relax(bench: Bench, row: Row, workload_keys: dict, optimizer: str) -> dict:
    from relax_gdn.bench import train_e2e

    cfg, overrides = relax_row_config(
        bench.base, workload_keys, row, device=bench.device, vocab=bench.vocab, optimizer=optimizer
    )
    variant_args = argparse.Namespace(
        optimizer=optimizer, profile=False, skip=bench.args.skip, trace_dir=None
    )
    data = (train_e2e.VocabularyOnly(bench.vocab), bench.batches.dataset())
    entry = train_e2e.run_variant(
        row.spec, cfg, variant_args, 1, bench.device, data=data, runtime=bench.runtime
    )
    entry |= {"side": "relax", "config": overrides}
    error = entry["summary"].get("error")
    if error and (oom := out_of_memory(error)):
        entry["summary"]["oom"] = oom | {"step": None}
    return entry


def reference_step(run_step) -> dict:
    """The HF reference step from the first of :data:`REFERENCE_ROWS` that runs it (``run_step(spec)``
    -> the row's entry), moving on only where a row ran out of memory: ``row``, ``loss``,
    ``grad_norm``, and ``instead_of`` (what the rows before it said) where it is not the first; with
    no row left, ``loss`` None and ``error``."""
    said = []
    for spec in REFERENCE_ROWS:
        entry = run_step(spec)
        first = entry["records"][0] if entry["records"] else None
        if first:
            return {"row": spec, "loss": first["loss"], "grad_norm": first["grad_norm"]} | (
                {"instead_of": "; ".join(said)} if said else {}
            )
        said.append(f"{spec}: {note(entry, None)}")
        if "oom" not in entry["summary"]:  # a failure other than memory would fail the next row too
            break
    return {"row": REFERENCE_ROWS[0], "loss": None, "grad_norm": None, "error": "; ".join(said)}


def run_workload(bench: Bench, workload: str, rows: list[Row], emit) -> dict:
    """Every row of ``workload`` after its HF reference step; ``emit(workload result, entry)`` after
    the reference step (entry None) and after each row."""
    args = bench.args
    keys = workload_overrides(workload, args.lora_rank)
    cfg = bench.base.with_overrides(keys)
    optimizer, why = workload_optimizer(cfg, bench.device, bench.vocab, args.optimizer)
    lora = cfg.lora_options
    reference = reference_step(
        lambda spec: run_hf(
            bench,
            f"{spec} (reference step)",
            parse_hf_settings(spec.split(",")[1:]),
            lora=lora,
            optimizer="none",
            steps=1,
        )
    )
    out = {
        "name": workload,
        "optimizer": optimizer,
        "optimizer_note": why,
        "lora": lora.as_dict() if lora is not None else None,
        "reference": reference,
        "rows": [],
    }
    checked_against = reference if reference["loss"] is not None else None
    emit(out, None)
    for row in rows:
        if row.side == "hf":
            entry = run_hf(bench, row.spec, row.hf, lora=lora, optimizer=optimizer, steps=args.steps)
        else:
            entry = run_relax(bench, row, keys, optimizer)
        records = entry.get("records") or []
        entry["agreement"] = agreement(
            records[0] if records else None, checked_against, precision(row, bench.device)
        )
        out["rows"].append(entry)
        emit(out, entry)
    return out


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------

COLUMNS = (
    "row",
    "tok/s",
    "÷ {baseline}",
    "÷ fastest HF",
    "MFU",
    "peak GiB",
    "first loss",
    "rel Δ loss",
    "first grad norm",
    "rel Δ grad",
    "note",
)
# the console's table fits a terminal: without the first step's values (its title gives the
# reference's; the deviations stay), and the notes under it, one line per row that has one
CONSOLE_COLUMNS = tuple(c for c in COLUMNS if c not in ("first loss", "first grad norm", "note"))


def timed(entry: dict) -> float | None:
    """The row's tok/s, or None where it has none to show (it failed, was refused, or disagrees)."""
    s = entry["summary"]
    if "tokens_per_s" not in s or (entry.get("agreement") or {}).get("agrees") is False:
        return None
    return s["tokens_per_s"]


def _oom_note(oom: dict, summary: dict) -> str:
    where = f" at step {oom['step']}" if oom.get("step") else ""
    asked = f": asked {oom['asked']}" if oom.get("asked") else ""
    in_use = f" with {oom['in_use']} in use" if oom.get("in_use") else ""
    ran = summary.get("step_tokens_per_s") or []
    before = (
        f" (steps before: {', '.join(f'{t:,.0f}' for t in ran)} tok/s, peak {summary['peak_mem_gib']:.1f} GiB)"
        if ran and summary.get("peak_mem_gib")
        else ""
    )
    return f"OOM{where}{asked}{in_use}{before}"


def note(entry: dict, fastest_hf: float | None) -> str:
    """What a row's last column says: why it has no timing, or who wins."""
    s, agreement_ = entry["summary"], entry.get("agreement") or {}
    if "cannot_run" in s:
        return f"cannot run: {s['cannot_run']}"
    if "refused" in s:
        return (
            f"REFUSED by the memory model: {s['memory_estimate_gib']['total']:.1f} GiB > {s['capacity_gib']:.1f} "
            f"GiB; fits: {'; '.join(s['fits']) or 'nothing tried'}"
        )
    if "oom" in s:
        return _oom_note(s["oom"], s)
    if "error" in s:
        return f"FAILED: {s['error'][:200]}"
    if agreement_.get("agrees") is False:
        return f"DISAGREES with HF's first step: {agreement_['why']}"
    parts = [f"unchecked: {agreement_['why']}"] if agreement_.get("agrees") is None else []
    if s.get("params_without_gradient"):
        parts.append(
            f"NOT A VALID ROW: {len(s['params_without_gradient'])} trainable parameters got no gradient"
        )
    if s.get("fp8"):
        parts.append(s["fp8"])
    if entry["side"] == "relax" and fastest_hf and timed(entry) and timed(entry) < fastest_hf:
        parts.append("an HF row is faster")
    return "; ".join(parts)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_rows(workload: dict, baseline: str) -> list[list[str]]:
    """The cells of ``workload``'s table, one list per row (:data:`COLUMNS`)."""
    rows = workload["rows"]
    base = next((timed(e) for e in rows if e["name"] == baseline), None)
    hf = [t for e in rows if e["side"] == "hf" and (t := timed(e))]
    fastest = max(hf, default=None)
    cells = []
    for entry in rows:
        tok_s, s, a = timed(entry), entry["summary"], entry.get("agreement") or {}
        label = entry["name"]
        if entry["side"] == "relax" and "recompute=" not in entry["name"]:
            granularity = entry["config"]["recompute.granularity"]
            whole = (
                f", {entry['full_layers']} layers whole"
                if granularity == "mixed" and entry.get("full_layers")
                else ""
            )
            label += f" (recompute={granularity}{whole})"
        cells.append(
            [
                label,
                _fmt(tok_s, ",.0f"),
                _fmt(tok_s / base if tok_s and base else None, ".2f"),
                _fmt(tok_s / fastest if tok_s and fastest else None, ".2f"),
                _fmt(s.get("mfu") if tok_s else None, ".3f"),
                _fmt((s.get("peak_mem_gib") or None) if tok_s else None, ".1f"),
                _fmt(a.get("loss"), ".6g"),
                _fmt(a.get("loss_rel"), ".1e"),
                _fmt(a.get("grad_norm"), ".6g"),
                _fmt(a.get("grad_norm_rel"), ".1e"),
                note(entry, fastest),
            ]
        )
    return cells


def workload_title(workload: dict, meta: dict) -> str:
    lora = workload["lora"]
    what = f"LoRA r={lora['rank']} alpha={lora['alpha']:g}" if lora else "full fine-tuning"
    update = "AdamW" if workload["optimizer"] == "adam" else "forward + backward, no update"
    ref = workload["reference"]
    proof = (
        f"HF reference step ({ref['row']}): loss {ref['loss']:.6g}, grad norm {ref['grad_norm']:.6g}"
        + (f" ({ref['instead_of']})" if ref.get("instead_of") else "")
        if ref["loss"] is not None
        else f"no HF reference step: {ref['error']}"
    )
    docs = f"{meta['docs_per_step']} x {meta['doc_tokens']}-token document{'s' if meta['docs_per_step'] > 1 else ''}"
    first, last = meta["skip"] + 1, meta["steps"]
    timed_steps = f"step {last}" if first == last else f"steps {first}-{last}"
    return f"{meta['preset']}, {what}, {update}; {docs} per step, medians of {timed_steps}; {proof}"


def markdown(result: dict) -> str:
    meta = result["meta"]
    header = [c.format(baseline=meta["baseline_row"]) for c in COLUMNS]
    lines = [
        f"`{meta['command']}` — commit {meta['commit']}, {meta['date_utc']}, {meta['device']} "
        f"(torch {meta['versions'].get('torch')}, transformers {meta['versions'].get('transformers')}, "
        f"peft {meta['versions'].get('peft')}, liger-kernel {meta['versions'].get('liger-kernel')}, "
        f"torchao {meta['versions'].get('torchao')}, fla-core {meta['versions'].get('fla-core')})",
        "",
    ]
    for workload in result["workloads"]:
        cells = table_rows(workload, meta["baseline_row"])
        lines += [
            workload_title(workload, meta),
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" if i in (0, len(header) - 1) else "---:" for i in range(len(header))) + "|",
        ]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells] + [""]
    return "\n".join(lines)


def print_tables(result: dict, stream=None) -> None:
    """The rich tables, one per workload (the last thing the benchmark prints)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    stream = stream or sys.stdout
    meta = result["meta"]
    console = Console(file=stream)
    if not console.is_terminal:  # a log or a pipe: one line per row, whatever the terminal was
        console = Console(file=stream, width=LOG_WIDTH)
    keep = [COLUMNS.index(c) for c in CONSOLE_COLUMNS]
    for workload in result["workloads"]:
        cells = table_rows(workload, meta["baseline_row"])
        notes = [f"{row[0]}: {row[-1]}" for row in cells if row[-1]]
        table = Table(
            title=workload_title(workload, meta),
            title_justify="left",
            caption_justify="left",
            caption=Text("\n".join(notes)) if notes else None,
        )  # plain text: "[peers]" is no markup
        for i, column in enumerate(CONSOLE_COLUMNS):
            table.add_column(
                column.format(baseline=meta["baseline_row"]), justify="right" if i else "left", no_wrap=True
            )
        for row in cells:
            table.add_row(*(Text(row[i]) for i in keep))
        console.print(table)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m relax_gdn.bench.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="qwen3_5_9b")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {WORKLOADS}")
    parser.add_argument("--rows", help="';'-separated rows, each run for every workload (default: see above)")
    parser.add_argument("--baseline-row", default=REFERENCE_ROWS[0], help="the row the '÷' column divides by")
    parser.add_argument(
        "--doc-tokens", type=int, help=f"tokens per document (default 8192; 256 for {CPU_PRESET})"
    )
    parser.add_argument("--docs-per-step", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--skip",
        type=int,
        help="steps left out of the medians (default 2; at least 1: the first "
        "step is the agreement check and compiles and tunes kernels)",
    )
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument(
        "--hf-checkpoint", help="a Hugging Face Qwen3.5 checkpoint (text layout) both sides start from"
    )
    parser.add_argument(
        "--init-dir",
        help="where the random-init checkpoint is written once and reused "
        "(default outputs/peers/init_<preset>_seed<seed>_<dtype>)",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=1e-5, help="both sides' learning rate (AdamW)")
    parser.add_argument("--optimizer", choices=("auto", "adam", "none"), default="auto")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--out", help="write the results here as JSON (after every row) and beside it as .md")
    add_cuda_alloc_conf(parser)  # both sides' rows run in this one process under it
    return parser


def _device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_args(args, parser: argparse.ArgumentParser, device: torch.device) -> list[str]:
    """Complete ``args`` (defaults that depend on others) and refuse bad ones before anything runs;
    returns the rows."""
    from relax_gdn.model.presets import PRESETS

    if args.preset not in PRESETS:
        parser.error(f"--preset {args.preset}: one of {', '.join(PRESETS)}")
    if device.type == "cpu" and args.preset != CPU_PRESET:
        parser.error(
            f"--preset {args.preset} on CPU: only {CPU_PRESET} trains there in reasonable time "
            f"(--preset {CPU_PRESET}), or run it on a GPU host"
        )
    args.doc_tokens = args.doc_tokens or (256 if args.preset == CPU_PRESET else 8192)
    limit = PRESETS[args.preset].max_sequence_length
    if not 2 <= args.doc_tokens <= limit:
        parser.error(f"--doc-tokens {args.doc_tokens} must be in [2, {limit}] for {args.preset}")
    resolve_skip(parser, args, "step 1 checks agreement")
    if not 1 <= args.skip < args.steps:
        parser.error(f"--skip {args.skip} must be at least 1 and below --steps {args.steps}")
    for name in ("docs_per_step", "lora_rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        parser.error(
            f"--workloads {','.join(args.workloads)}: a comma-separated subset of {','.join(WORKLOADS)}"
        )
    specs = (
        [s.strip() for s in args.rows.split(";") if s.strip()]
        if args.rows
        else default_rows(args.docs_per_step)
    )
    if args.baseline_row not in specs:
        parser.error(f"--baseline-row {args.baseline_row} is not one of the rows ({'; '.join(specs)})")
    return specs


def _checkpoint_problem(args, dtype: torch.dtype) -> tuple[Path, str | None]:
    """The checkpoint directory of the run and why it cannot be used (None: it can)."""
    if args.hf_checkpoint:
        path = Path(args.hf_checkpoint)
        config = path / "config.json"
        if config.is_file() and "text_config" in json.loads(config.read_text()):
            return path, (
                f"--hf-checkpoint {path} is in the VLM layout (text_config): the HF side trains "
                "Qwen3_5ForCausalLM; save its text model, or leave --hf-checkpoint out"
            )
        return path, None
    marker = init_marker(args.preset, args.seed, dtype)
    path = Path(
        args.init_dir or Path("outputs") / "peers" / f"init_{args.preset}_seed{args.seed}_{marker['dtype']}"
    )
    return path, existing_init_problem(path, marker)


def _check_relax_row(base: RunConfig, row: Row, workload: str, args) -> None:
    """Refuse (:class:`~relax_gdn.errors.ConfigError`) a relax-gdn row that cannot run ``workload``:
    its configuration breaks a rule, or its micro-batch cannot hold one document."""
    from relax_gdn.config import validate
    from relax_gdn.data import padded_length
    from relax_gdn.errors import ConfigError

    overrides = {**workload_overrides(workload, args.lora_rank), **row.overrides}
    best = overrides["recompute.granularity"] == "best"  # chosen on the GPU; any choice validates alike
    overrides |= {"recompute.granularity": "full"} if best else {}
    try:  # (the random-init checkpoint is written later; a given one is checked on its own)
        cfg = base.with_overrides({**overrides, "model.hf_checkpoint": None})
        validate(cfg, 1)
    except ConfigError as e:
        raise ConfigError([f"row {row.spec!r} ({workload}): {p}" for p in e.problems]) from None
    if padded_length(args.doc_tokens, 1) > cfg.train.max_tokens_per_gpu:
        raise ConfigError(
            f"row {row.spec!r}: train.max_tokens_per_gpu={cfg.train.max_tokens_per_gpu} holds less "
            f"than one {args.doc_tokens}-token document; raise it or lower --doc-tokens"
        )


def plan(args, specs: list[str], device: torch.device) -> tuple[list[Row], Path]:
    """The rows and the checkpoint directory, every row's configuration validated: a
    :class:`~relax_gdn.errors.ConfigError` names what to change before anything is built or written."""
    from relax_gdn.data import padded_length
    from relax_gdn.errors import ConfigError
    from relax_gdn.model.hf_checkpoint import run_vocab_size

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    checkpoint, problem = _checkpoint_problem(args, dtype)
    if problem is not None:
        raise ConfigError(problem)
    if args.hf_checkpoint:
        run_vocab_size(checkpoint, args.preset, 0, 1)  # missing, or of other sizes than the preset's
    try:
        rows = [parse_row(spec, padded_length(args.doc_tokens, 1) * args.docs_per_step) for spec in specs]
    except ValueError as e:
        raise ConfigError(f"--rows: {e}") from None
    base = base_config(args, str(checkpoint), device)
    for workload in args.workloads:
        for row in (r for r in rows if r.side == "relax"):
            _check_relax_row(base, row, workload, args)
    return rows, checkpoint


def _versions() -> dict:
    found = {"torch": torch.__version__}
    for package in (
        "transformers",
        "peft",
        "liger-kernel",
        "torchao",
        "fla-core",
        "flash-linear-attention",
        "causal-conv1d",
        "megatron-core",
        "flash-attn-4",
    ):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def _process_settings(runtime, device: torch.device) -> None:
    """Process-wide changes of the benchmark, each undone when the Runtime closes: no loading
    progress bars; on CPU, transformers' pure-torch GDN functions instead of FLA's Triton kernels,
    and one compute thread."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from transformers.utils import logging as hf_logging

    from relax_gdn.compat.transformers_kernels import KERNEL_HANDLES
    from relax_gdn.model.hf_checkpoint import use_torch_kernels_in_transformers

    if hf_logging.is_progress_bar_enabled():
        hf_logging.disable_progress_bar()
        runtime.adopt(hf_logging.enable_progress_bar)
    if device.type == "cpu":
        bound = {name: getattr(modeling, name) for name in KERNEL_HANDLES}
        use_torch_kernels_in_transformers()
        runtime.adopt(lambda: [setattr(modeling, name, fn) for name, fn in bound.items()])
        # the tiny model's ops are too small to share between threads: more threads only add their
        # synchronisation (and contend with whatever else the machine runs)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        runtime.adopt(lambda: torch.set_num_threads(threads))


def _write(result: dict, out: str | None, tables: bool) -> None:
    if not out:
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    if tables:
        path.with_suffix(".md").write_text(markdown(result))


def _progress(result: dict, out: str | None):
    """``emit(workload, entry)``: one line per finished row, and the JSON so far (a run cut short
    keeps what it measured)."""

    def emit(workload: dict, entry: dict | None) -> None:
        if workload not in result["workloads"]:
            result["workloads"].append(workload)
        _write(result, out, tables=False)
        if entry is None:
            ref = workload["reference"]
            said = (
                f"loss {ref['loss']:.6g}, grad norm {ref['grad_norm']:.6g}"
                if ref["loss"] is not None
                else f"none: {ref['error']}"
            )
            print(f"[peers] {workload['name']}: HF reference step ({ref['row']}): {said}", flush=True)
            return
        tok_s = timed(entry)
        said = f"{tok_s:,.0f} tok/s" if tok_s else "no timing"
        print(
            f"[peers] {workload['name']} / {entry['name']}: {said}; {note(entry, None) or 'agrees'}",
            flush=True,
        )

    return emit


def _run(args, rows: list[Row], checkpoint: Path, device: torch.device, runtime) -> dict:
    from relax_gdn.bench.hf_peer import write_random_checkpoint
    from relax_gdn.bench.provenance import tree_commit
    from relax_gdn.data import LengthProfile, length_matched_samples
    from relax_gdn.model.hf_checkpoint import run_vocab_size
    from relax_gdn.parallel.default_group import init_distributed

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    created = init_distributed(device)
    _process_settings(runtime, device)
    if not args.hf_checkpoint:
        checkpoint = write_random_checkpoint(checkpoint, args.preset, args.seed, dtype, device)
    vocab = run_vocab_size(checkpoint, args.preset, 0, 1)
    count, length = args.docs_per_step * args.steps, args.doc_tokens
    profile = LengthProfile(
        mean_tokens=length, sigma=0.0, min_tokens=length, max_tokens=length, prompt_tokens=min(96, length - 1)
    )
    samples = length_matched_samples(
        count, vocab_size=vocab, seed=args.seed, profile=profile, lengths=[length] * count, eos_id=1
    )
    bench = Bench(
        args,
        device,
        dtype,
        checkpoint,
        vocab,
        Batches(samples, args.docs_per_step, args.seed),
        base_config(args, str(checkpoint), device),
        runtime,
    )
    result = {
        "meta": {
            "command": "python -m relax_gdn.bench.peers " + " ".join(args.argv),
            "preset": args.preset,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "versions": _versions(),
            "commit": tree_commit(),
            "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "checkpoint": str(checkpoint),
            "vocab_size": vocab,
            "doc_tokens": length,
            "docs_per_step": args.docs_per_step,
            "steps": args.steps,
            "skip": args.skip,
            "baseline_row": args.baseline_row,
            "dtype": str(dtype).removeprefix("torch."),
            "args": {k: v for k, v in vars(args).items() if k != "argv"},
        },
        "workloads": [],
    }
    emit = _progress(result, args.out)
    for workload in args.workloads:
        run_workload(bench, workload, rows, emit)
    _write(result, args.out, tables=True)
    print()
    print_tables(result)
    if created:
        import torch.distributed as dist

        dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = argv
    apply_cuda_alloc_conf(parser, args.cuda_alloc_conf)
    if args.device == "cuda":
        require_gpus("relax_gdn.bench.peers")
    device = _device(args.device)
    specs = check_args(args, parser, device)

    from relax_gdn.errors import ConfigError, RecipeError, report_user_error
    from relax_gdn.runtime import Runtime

    try:
        rows, checkpoint = plan(args, specs, device)
    except ConfigError as e:
        report_user_error(e)
    try:
        with Runtime() as runtime:  # after the checks: a refused run builds and writes nothing
            return _run(args, rows, checkpoint, device, runtime)
    except RecipeError as e:  # what only the run finds (a relax-gdn row's data): one message, exit 2
        report_user_error(e)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
