"""End-to-end training throughput of whole-model variants side by side, in one process group.

    python -m relax_gdn.bench.train_e2e --preset qwen3_5_9b --max-tokens-per-gpu 8192 \\
        --variants "baseline,recompute=full;recompute=full;recompute=selective;recompute=none" \\
        --profile --out e2e.json                                      # 1 GPU, full 9B
    torchrun --nproc-per-node 2 -m relax_gdn.bench.train_e2e --preset qwen3_5_9b \\
        --variants "static:chunkwise,recompute=selective;static:headwise,recompute=selective"
    python -m relax_gdn.bench.train_e2e --preset qwen3_5_tiny --steps 3 --skip 1 \\
        --mean-tokens 60 --min-tokens 16 --max-tokens 200 --max-tokens-per-gpu 256   # CPU smoke

Each variant is a short ``run_training`` of the same global batches (same seed): ``;`` separates
variants, ``,`` the settings of one; ``--grid 'mt=32768/65536;recompute=full/mixed;
model.attention_backend=varlen/fa4'`` adds every combination of the axes (the long-context table in
one run; ratios are then to the first variant of each micro-batch size). A setting is a shorthand
or any dotted config key:

``static:<mode>`` / ``dynamic:<mode>``  ``parallel.cp`` = world size with ``gdn.cp_mode=<mode>``
                                         (dynamic: ``parallel.dynamic_cp`` with ``max_cp`` = world)
``recompute=<full|selective|none>``      ``recompute.granularity``
``fused=<on|off>``                       every ``model.fused_*`` switch (norms, cross-entropy, SwiGLU,
                                         gradient accumulation)
``baseline``                             Megatron-Core's own forms: ``fused=off`` and
                                         ``recompute.skip_unused=false`` (what the targets compare to)
``mt=<tokens>``                          ``train.max_tokens_per_gpu``
``mtp=<layers>``                         ``model.mtp.num_layers`` (1: Qwen3.5's multi-token-prediction layer)
``fp8=<recipe|off>``                     ``model.fp8.recipe`` (tensorwise, rowwise, rowwise_gw_hp; docs/fp8.md)
``profile``                              this variant's profiled step (``--profile`` for one variant)
``<group.key>=<value>``                  any config key (``true``/``false``/numbers parsed; a list in
                                         brackets: ``recompute.modules=[mlp_act,gdn_core]``)

Data: random-token SFT samples whose lengths follow a log-normal distribution (default mean
3,000 tokens, σ 0.8, clipped to 128-16,384: the shape of long chain-of-thought SFT sets such as
OpenMathReasoning; ``relax_gdn.data.LengthProfile``), or the lengths listed in ``--lengths-file``
(one ``length`` or ``length count`` per line); ``--mean-fraction f`` draws each variant's lengths
with mean ``f`` x its micro-batch, up to the micro-batch. Samples longer than one micro-batch
(``max_tokens_per_gpu x cp``) are cut to it. The vocabulary is the preset's (248,320 for the 9B,
padded to a multiple of 1024), so the output layer and the loss cost what they cost in training.

A variant the memory model refuses (:class:`~relax_gdn.errors.MemoryFitError`) is reported as
refused, with the estimate and the settings that would fit, and the run goes on with the next.
One that fails while it runs (out of memory, a kernel's error) is reported as failed with the
error, and the next starts after a collection; an error that leaves the CUDA context unusable (an
illegal memory access) fails the later variants of the process too, which is why
``relax_gdn/bench/long_context.sh`` runs each variant in a process of its own.
``recompute=mixed`` without ``recompute.full_layers`` takes the memory model's choice for the GPU.

Optimizer: Megatron-Core's distributed Adam when the memory model
(:mod:`relax_gdn.train.memory`) says it fits the GPU; otherwise (``--optimizer auto``, e.g. the full
9B on one GPU) forward + backward + DDP gradient reduction without an update
(``optim.name=none``), and the summary says so.

Warm-up: the variants share Triton's autotuning and compile caches, keyed partly by shape, and a
global batch of new lengths can trigger more tuning or compiling after ``--skip`` (FLA's gated
norm compiles once per row-block count): without a warm-up the first variant of a run was slower
than the same variant run again last, and a fused variant after ``fused=off`` compiled inside its
timed steps (docs/benchmarks.md, "Figures behind code comments"). So every variant first
runs once, untimed, over the same batches, the profiled step's included (repeats that differ only
in ``train.seed`` share one pass); ``--no-warm-up-every-variant`` warms up the first variant only,
``--no-warm-up-pass`` none.

Per variant: medians over the steps after ``--skip`` warm-up steps (compile, autotune, caches) of
tokens/s (and per GPU), MFU in Megatron-Core's and Relax's accounting (``relax_gdn.train.flops``),
step time and optimizer time; the peak memory (``torch.cuda.max_memory_allocated`` over the
variant's steps), the memory still allocated from earlier variants as it starts
(``memory_at_start_gib``, said when above 0.5 GiB), the most host syncs in one step, the memory
model's estimate; with ``--profile``, one more step under ``torch.profiler`` (left out of the
medians) split into kernel categories (GEMM / elementwise / copy / GDN / attention /
communication) and idle GPU time (under the profiler, and estimated for an unprofiled step: the
profiler's host cost inflates the former; the estimate takes the profiled step's FLOPs at the
timed steps' FLOP rate), the longest kernels with their calls, mean time and the host ops that
launched them, with those ops' input shapes (``top_kernels``; which ``aten::mm`` of which node and
shapes runs a slow cuBLAS kernel) and the caching allocator's retries (``alloc_retries``: a full
cache freed and the GPU drained to find room; ``--cuda-alloc-conf expandable_segments:True`` is the
usual cure). ``--out`` writes ``{"meta": ..., "variants": [{"name", "config", "records",
"summary"}]}`` (the record schema of metrics.jsonl); the table gives ratios to the first variant.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import itertools
import json
import os
import re
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from relax_gdn.bench import trace_launchers
from relax_gdn.bench.needs import add_cuda_alloc_conf, apply_cuda_alloc_conf, require_gpus, resolve_skip
from relax_gdn.bench.provenance import tree_commit
from relax_gdn.train.gpu_memory import release_gpu_memory

CP_MODES = ("chunkwise", "headwise", "all_gather")
KERNEL_CATEGORIES = ("gemm", "gdn", "attention", "communication", "copy", "elementwise")


# ---------------------------------------------------------------------------------------------
# variants
# ---------------------------------------------------------------------------------------------


def variant_settings(variant: str) -> list[str]:
    """The settings of one variant: split at the commas outside ``[...]``, so a list value keeps its
    own (``recompute.modules=[mlp_act,gdn_core]``). ``ValueError`` for an unbalanced bracket."""
    settings, depth, start = [], 0, 0
    for i, char in enumerate(variant):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            break
        if char == "," and depth == 0:
            settings.append(variant[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"variant {variant!r}: a '[' without its ']' (or the other way round)")
    settings.append(variant[start:])
    return [s.strip() for s in settings if s.strip()]


def _parse_value(text: str):
    stripped = text.strip()
    if stripped.startswith("[") and stripped.endswith("]"):  # a list: its items parsed alike
        return [_parse_value(item) for item in variant_settings(stripped[1:-1])]
    lowered = stripped.lower()
    if lowered in ("true", "on", "yes"):
        return True
    if lowered in ("false", "off", "no"):
        return False
    if lowered == "null":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def variant_overrides(variant: str, world: int) -> dict:
    """Config overrides of one ``--variants`` entry (see the module docstring)."""
    overrides: dict = {}
    for setting in variant_settings(variant):
        if setting == "baseline":
            overrides |= {**variant_overrides("fused=off", world), "recompute.skip_unused": False}
            continue
        if setting == "profile":  # this variant's extra profiled step (profiled_variant), no config key
            continue
        kind, colon, mode = setting.partition(":")
        if colon and kind in ("static", "dynamic"):
            if mode not in CP_MODES:
                raise ValueError(f"variant setting {setting!r}: the mode must be one of {CP_MODES}")
            overrides |= {"gdn.cp_mode": mode, "parallel.cp": world}
            if kind == "dynamic":
                overrides |= {"parallel.dynamic_cp.enabled": True, "parallel.dynamic_cp.max_cp": world}
            continue
        key, eq, value = setting.partition("=")
        if not eq:
            raise ValueError(
                f"variant setting {setting!r}: want baseline, static|dynamic:<mode>, recompute=, fused=, "
                "mt=, mtp=, fp8= or <group.key>=<value>"
            )
        key = key.strip()
        if key == "recompute":
            overrides["recompute.granularity"] = value.strip()
        elif key == "fused":
            on = _parse_value(value)
            overrides |= {
                "model.fused_norms": on,
                "model.fused_cross_entropy": on,
                "model.fused_swiglu": on,
                "model.fused_grad_accumulation": on,
            }
        elif key == "mt":
            overrides["train.max_tokens_per_gpu"] = int(value)
        elif key == "mtp":
            overrides["model.mtp.num_layers"] = int(value)
        elif key == "fp8":
            overrides["model.fp8.recipe"] = (
                None if value.strip() in ("off", "none", "null") else value.strip()
            )
        elif "." in key:
            overrides[key] = _parse_value(value)
        else:
            raise ValueError(f"variant setting {setting!r}: unknown shorthand {key!r}")
    return overrides


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VocabularyOnly:
    """What the training loop asks of a tokenizer when the samples are already token ids."""

    vocab_size: int
    pad_id: int = 0
    eos_id: int = 1


def profiled_variant(variant: str) -> bool:
    """Whether ``variant`` asks for the profiled step itself (setting ``profile``), as ``--profile``
    does for every variant."""
    return "profile" in variant_settings(variant)


def grid_variants(grid: str) -> list[str]:
    """Every combination of the axes of ``grid``: axes separated by ``;``, each ``key=v1/v2/...``
    (any variant setting: ``mt=32768/65536;recompute=full/mixed;model.attention_backend=varlen/fa4``),
    the first axis varying slowest."""
    axes = []
    for axis in filter(None, (a.strip() for a in grid.split(";"))):
        key, eq, values = axis.partition("=")
        if not eq or not values:
            raise ValueError(f"--grid axis {axis!r}: want key=value1/value2/...")
        axes.append([f"{key.strip()}={v.strip()}" for v in values.split("/") if v.strip()])
    return [",".join(combo) for combo in itertools.product(*axes)] if axes else []


def warm_up_variants(variants: list[str], world: int, every: bool) -> list[str]:
    """The variants given a warm-up pass: the first, or with ``every`` each variant whose settings
    other than ``train.seed`` differ from those of an earlier one."""
    if not every:
        return variants[:1]
    chosen, seen = [], []
    for variant in variants:
        settings = {k: v for k, v in variant_overrides(variant, world).items() if k != "train.seed"}
        if settings not in seen:
            seen.append(settings)
            chosen.append(variant)
    return chosen


def read_length_file(path: str) -> list[int]:
    """Lengths from a file of ``length`` or ``length count`` lines (``#`` comments allowed)."""
    lengths: list[int] = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            length, count = int(fields[0]), int(fields[1]) if len(fields) > 1 else 1
        except ValueError:
            raise ValueError(f"{path}:{line_no}: want 'length' or 'length count', got {line!r}") from None
        if length < 2 or count < 0:
            raise ValueError(f"{path}:{line_no}: length must be >= 2 and count >= 0, got {line!r}")
        lengths += [length] * count
    if not lengths:
        raise ValueError(f"{path} lists no lengths")
    return lengths


def benchmark_data(args, vocab_size: int, capacity: int, num_samples: int):
    """``(tokenizer, dataset)`` of random-token samples with the benchmark's length distribution."""
    import numpy as np

    from relax_gdn.data import LengthProfile, SFTDataset, SkipCounts, length_matched_samples

    mean, low, high = args.mean_tokens, args.min_tokens, args.max_tokens
    if (
        args.mean_fraction
    ):  # every micro-batch size its own lengths: mean this fraction of it, up to all of it
        mean, high = args.mean_fraction * capacity, capacity
        low = min(low, high)
    profile = LengthProfile(
        mean_tokens=mean, sigma=args.sigma, min_tokens=low, max_tokens=high, prompt_tokens=min(96, low - 1)
    )
    if args.lengths_file:
        pool = read_length_file(args.lengths_file)
        lengths = np.random.default_rng(args.seed).choice(pool, size=num_samples).tolist()
    else:
        lengths = profile.sample_lengths(num_samples, args.seed)
    lengths = [min(int(n), capacity) for n in lengths]
    samples = length_matched_samples(
        num_samples, vocab_size=vocab_size, seed=args.seed, profile=profile, lengths=lengths, eos_id=1
    )
    counts = SkipCounts(total=num_samples, kept=num_samples)
    return VocabularyOnly(vocab_size), SFTDataset(
        samples=samples, source="lognormal" if not args.lengths_file else args.lengths_file, counts=counts
    )


# ---------------------------------------------------------------------------------------------
# profile -> kernel categories
# ---------------------------------------------------------------------------------------------

_CATEGORY_PATTERNS = (  # first match wins; lower-case substrings of kernel names
    ("communication", ("nccl",)),
    (
        "gdn",
        (
            "chunk_",
            "gated_delta",
            "causal_conv",
            "conv1d",
            "kkt",
            "solve_tril",
            "recompute_w_u",
            "l2norm",
            "tilelang",
            "fla_",
            "wy_fast",
            "cumsum",
        ),
    ),
    ("attention", ("flash", "fmha", "attn", "varlen")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma", "splitk")),
    ("copy", ("copy", "memcpy", "memset", "cat", "index", "gather", "scatter", "fill", "transpose")),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, patterns in _CATEGORY_PATTERNS:
        if any(p in lowered for p in patterns):
            return category
    return "elementwise"  # element-wise / reductions / norms / softmax


GAP_BUCKETS_US = (10.0, 100.0, 1000.0)  # idle gaps: launch-bound (< 100 µs) vs stalls (≥ 1 ms)


def idle_gaps(intervals: list[tuple[float, float, str]], top: int = 8, host_window=None) -> dict:
    """Where the GPU idles between the kernels of one step (``(start_us, end_us, name)``): seconds
    of idle per gap size (``< 10 µs``, ``< 100 µs``, ``< 1 ms``, ``≥ 1 ms``: many short gaps mean
    the host launches too slowly, a few long ones mean it stalls), the idle seconds before each
    kernel name (``late_kernels``: whose launch the GPU waited for) and the ``top`` longest gaps
    as ``[gap ms, ms into the step, kernel before, kernel after]``, followed, when
    ``host_window(before, after)`` is given, by the longest host ops between the two launches."""
    labels = [f"<{int(b)}us" for b in GAP_BUCKETS_US] + [f">={int(GAP_BUCKETS_US[-1])}us"]
    seconds = dict.fromkeys(labels, 0.0)
    late: dict[str, float] = {}
    gaps = []
    first, end, last = None, float("-inf"), None
    for interval in sorted(intervals, key=lambda iv: iv[:2]):
        start, stop, name = interval[:3]
        if first is None:
            first = start
        if start > end and last is not None:
            gap = start - end
            bucket = next((lab for lab, b in zip(labels, GAP_BUCKETS_US) if gap < b), labels[-1])
            seconds[bucket] += gap / 1e6
            late[name[:80]] = late.get(name[:80], 0.0) + gap / 1e6
            gaps.append((gap, end - first, last, interval))
        if stop > end:
            end, last = stop, interval
    longest = []
    for g, at, before, after in sorted(gaps, key=lambda x: -x[0])[:top]:
        row = [round(g / 1e3, 3), round(at / 1e3, 3), before[2][:80], after[2][:80]]
        if host_window is not None:
            row.append(host_window(before, after))
        longest.append(row)
    return {
        "seconds_by_gap": {k: round(v, 6) for k, v in seconds.items()},
        "late_kernels": [[n, round(t, 5)] for n, t in sorted(late.items(), key=lambda kv: -kv[1])[:top]],
        "longest": longest,
    }


def _host_ops_between(cpu_ops: list[tuple[float, float, str]], launch_ts: dict):
    """``host_window`` for :func:`idle_gaps`: the three longest host (``cpu_op``) events that
    start between the launches of the kernels before and after a gap, as ``"name ms"``."""

    def window(before, after) -> list[str]:
        t0, t1 = launch_ts.get(before[3]), launch_ts.get(after[3])
        if t0 is None or t1 is None:
            return []
        inside = [(dur, name) for ts, dur, name in cpu_ops if t0 <= ts < t1]
        return [f"{name[:60]} {dur / 1e3:.3f}ms" for dur, name in sorted(inside, reverse=True)[:3]]

    return window


TOP_KERNELS = 40  # kernels listed in kernel_split's top_kernels (by total time)
LAUNCHERS_PER_KERNEL = 3  # launchers kept per listed kernel (by their kernels' time)


def _read_trace_events(trace_path: Path) -> list[dict]:
    """A chrome trace's ``traceEvents``; ``.gz`` read as gzip (what ``--trace-dir`` keeps)."""
    opener = gzip.open if str(trace_path).endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def _top_kernels(stats: dict[str, dict], top: int = TOP_KERNELS) -> list[list]:
    """``kernel_split``'s ``top_kernels``: ``[name, seconds, category, calls, mean_s, launchers]``
    per kernel name, the longest in total first (the first three fields are the older entries').
    ``launchers``: the host ops that launched that kernel (:mod:`relax_gdn.bench.trace_launchers`),
    each a dict of ``op``, ``context``, ``input_dims``, ``input_types``, ``input_strides``,
    ``launch_found``, ``calls`` and ``seconds``, the most time first."""
    rows = []
    for name, st in sorted(stats.items(), key=lambda kv: -kv[1]["seconds"])[:top]:
        launchers = []
        for launcher, (calls, secs) in sorted(st["launchers"].items(), key=lambda kv: -kv[1][1])[
            :LAUNCHERS_PER_KERNEL
        ]:
            where = trace_launchers.NOT_FOUND if launcher is None else launcher.as_dict()
            launchers.append({**where, "calls": calls, "seconds": round(secs, 5)})
        rows.append(
            [
                name,
                round(st["seconds"], 5),
                kernel_category(name),
                st["calls"],
                round(st["seconds"] / st["calls"], 7),
                launchers,
            ]
        )
    return rows


def kernel_split(trace_path: Path, step_time_s: float, unprofiled_step_s: float | None = None) -> dict:
    """Seconds of GPU time per kernel category in a chrome trace of ONE step, and the idle time
    (step wall time minus the union of kernel intervals; :func:`idle_gaps` says where it falls
    between kernels). The profiler's own host cost stretches that step, so ``unprofiled_step_s``
    (the same step's tokens at the timed steps' rate) gives ``idle_unprofiled_s``, the idle time
    of an ordinary step. ``top_kernels`` (:func:`_top_kernels`) says which host ops, with which
    input shapes, launched the longest kernels."""
    events = _read_trace_events(trace_path)
    launched_by = trace_launchers.launchers_by_correlation(events)  # correlation id -> Launcher
    seconds = dict.fromkeys(KERNEL_CATEGORIES, 0.0)
    # kernel name -> seconds, calls, {Launcher (None: launch not found) -> [calls, seconds]}
    by_name: dict[str, dict] = {}
    intervals = []
    cpu_ops, launch_ts = [], {}  # host ops; correlation id -> when the host launched it
    count = 0
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "cpu_op":
            cpu_ops.append((float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", "")))
            continue
        if e.get("cat") in trace_launchers.LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = float(e["ts"])
            continue
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        category = "copy" if e["cat"] != "kernel" else kernel_category(e.get("name", ""))
        seconds[category] += dur / 1e6
        name = e.get("name", "")[:240]  # C++ kernels name their functor late
        correlation = e.get("args", {}).get("correlation")
        st = by_name.setdefault(name, {"seconds": 0.0, "calls": 0, "launchers": {}})
        st["seconds"] += dur / 1e6
        st["calls"] += 1
        tally = st["launchers"].setdefault(launched_by.get(correlation), [0, 0.0])
        tally[0] += 1
        tally[1] += dur / 1e6
        intervals.append((start, start + dur, name, correlation))
        count += 1
    busy, end = 0.0, float("-inf")
    for a, b, *_ in sorted(
        intervals, key=lambda iv: iv[:2]
    ):  # union of the intervals (kernels on several streams overlap)
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    busy_s = busy / 1e6
    return {
        "seconds": {k: round(v, 6) for k, v in seconds.items()},
        "kernels": count,
        "busy_s": round(busy_s, 6),
        "idle_s": round(max(step_time_s - busy_s, 0.0), 6),
        "step_time_s": round(step_time_s, 4),
        "idle_unprofiled_s": (
            round(max(unprofiled_step_s - busy_s, 0.0), 6) if unprofiled_step_s is not None else None
        ),
        "idle_gaps": idle_gaps(intervals, host_window=_host_ops_between(cpu_ops, launch_ts)),
        "top_kernels": _top_kernels(by_name),
    }


# ---------------------------------------------------------------------------------------------
# one variant
# ---------------------------------------------------------------------------------------------


def _file_stem(variant: str) -> str:
    """A variant's overrides as a file name (``recompute=full,train.seed=1`` -> ``recompute-full_train.seed-1``)."""
    return (
        re.sub(r"[^A-Za-z0-9._-]+", "_", variant.replace("=", "-").replace(",", "_")).strip("_") or "variant"
    )


def _median(records, key):
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(records: list[dict], skip: int, world: int) -> dict:
    timed = [r for r in records[skip:] if not r.get("profiled")] or records
    tok_s = _median(timed, "tokens_per_s")
    return {
        "steps_timed": len(timed),
        "tokens_per_s": tok_s,
        # the steps' batches differ in size: all their tokens over all their time weighs them fairly
        "tokens_per_s_total": sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed),
        "tokens_per_s_per_gpu": tok_s / world if tok_s else None,
        "mfu": _median(timed, "mfu"),
        "mfu_relax": _median(timed, "mfu_relax"),
        "tflops_per_gpu": _median(timed, "tflops_per_gpu"),
        "step_time_s": _median(timed, "step_time_s"),
        "optimizer_time_s": _median(timed, "optimizer_time_s"),
        "peak_mem_gib": max((r["peak_mem_gb"] or 0.0 for r in timed), default=None),
        "host_syncs_max": max((r["host_syncs"] or 0 for r in timed), default=None),
        "loss_last": timed[-1]["loss"],
        "mtp_loss_last": timed[-1].get("mtp_loss"),
        "tokens_per_step": _median(timed, "tokens"),
    }


def _memory_estimate(cfg, world: int, bf16: bool, vocab_size: int, optimizer: str):
    from relax_gdn.config import ParallelDims
    from relax_gdn.train.build import memory_estimate

    dims = ParallelDims(world, cfg.parallel.tp, cfg.parallel.cp)
    return memory_estimate(cfg, dims, bf16=bf16, vocab_size=vocab_size, optimizer=optimizer)


def _unprofiled_step_s(records: list[dict], summary: dict) -> float | None:
    """The profiled step's time at the timed steps' rate: its FLOPs at their FLOP rate (its
    documents' lengths, hence its attention share, differ from theirs), else its tokens at their
    token rate."""
    last, rate = records[-1], summary.get("tflops_per_gpu")
    if rate and last.get("tflops_per_gpu"):
        return last["tflops_per_gpu"] * last["step_time_s"] / rate
    tok_rate = summary.get("tokens_per_s_total")
    return last["tokens"] / tok_rate if tok_rate else None


def _alloc_retries(device: torch.device) -> int | None:
    """cudaMalloc retries so far (the caching allocator freed its cache and synchronised to find
    room: a stall of the GPU's queue)."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries") if device.type == "cuda" else None


def _memory_left_over(device: torch.device, name: str) -> float | None:
    """GiB still allocated on the GPU as a variant starts (after a collection): what earlier
    variants of this process left behind, which would count in this one's peak; said when > 0.5."""
    if device.type != "cuda":
        return None
    release_gpu_memory(device)
    left = torch.cuda.memory_allocated(device) / 2**30
    if left > 0.5 and dist.get_rank() == 0:
        print(
            f"[train_e2e] {name}: {left:.2f} GiB still allocated from earlier variants as it starts",
            flush=True,
        )
    return round(left, 3)


def run_variant(name: str, cfg, args, world: int, device: torch.device, data=None, *, runtime) -> dict:
    """One variant: ``run_training`` of ``cfg`` on the benchmark's samples (``data``: a prepared
    ``(tokenizer, SFTDataset)`` pair instead, as ``bench.peers`` gives) in ``runtime``, summarised; a
    refusal by the memory model or a failure while it runs is reported in the summary, not raised."""
    from relax_gdn.model import qwen3_5_preset
    from relax_gdn.train import run_training
    from relax_gdn.train.build import padded_vocab_size
    from relax_gdn.train.memory import GIB

    vocab = qwen3_5_preset(cfg.model.preset).vocab_size
    padded_vocab = padded_vocab_size(cfg, vocab, cfg.parallel.tp)
    bf16 = device.type == "cuda"
    optimizer, why = args.optimizer, "requested"
    if optimizer == "auto":
        optimizer, why = "adam", "fits"
        if device.type == "cuda":
            need = _memory_estimate(cfg, world, bf16, padded_vocab, "adam").total
            have = torch.cuda.get_device_properties(device).total_memory
            if need > have:
                optimizer = "none"
                why = (
                    f"Adam state does not fit: estimate {need / GIB:.0f} GiB > {have / GIB:.0f} GiB; "
                    "forward + backward + DDP gradient reduction, no update"
                )
    capacity = cfg.train.max_tokens_per_gpu * cfg.parallel.cp
    cfg = cfg.with_overrides({"optim.name": optimizer, "data.max_sample_tokens": capacity})
    from relax_gdn.config import ParallelDims
    from relax_gdn.train.build import resolve_full_layers

    # recompute.full_layers=null: the memory model's choice, here as in the loop (same GPU)
    cfg = resolve_full_layers(
        cfg, ParallelDims(world, cfg.parallel.tp, cfg.parallel.cp), device, bf16, padded_vocab
    )
    estimate = _memory_estimate(cfg, world, bf16, padded_vocab, optimizer)
    data = data if data is not None else benchmark_data(args, vocab, capacity, cfg.data.num_samples)
    from relax_gdn.data import length_stats
    from relax_gdn.errors import MemoryFitError, RecipeError

    entry = {
        "name": name,
        "optimizer": optimizer,
        "optimizer_note": why,
        "lengths": length_stats(data[1].lengths()),
        "full_layers": cfg.recompute.full_layers,
        "memory_at_start_gib": _memory_left_over(device, name),
    }
    retries_before = _alloc_retries(device)
    with tempfile.TemporaryDirectory() as tmp:
        steps = cfg.train.steps
        run_dir = None
        if args.profile:  # one more step under the profiler, left out of the medians
            cfg = cfg.with_overrides(
                {"train.steps": steps + 1, "logging.profile_steps": [steps + 1, steps + 1]}
            )
            run_dir = Path(tmp) / name.replace("/", "_")
        try:
            result = run_training(cfg, run_dir, runtime=runtime, data=data)
        except MemoryFitError as e:  # refused before anything was built: report it, go on
            entry |= {
                "records": [],
                "summary": {
                    "refused": str(e),
                    "memory_estimate_gib": e.estimate_gib,
                    "capacity_gib": e.capacity_gib,
                    "fits": e.fits,
                },
            }
            return entry
        except RecipeError:  # a wrong setting: every variant would need fixing
            raise
        except Exception as e:  # noqa: BLE001 - one variant failing (e.g. out of memory) must not end the rest
            entry |= {"records": [], "summary": {"error": f"{type(e).__name__}: {e}"[:2000]}}
            return entry
        finally:  # a failed variant's memory, its exception gone (run_training frees a finished one)
            release_gpu_memory(device)
        records = result.records
        if args.profile and records:
            records[-1]["profiled"] = True
        summary = summarize(records, args.skip, world)
        summary["memory_estimate_gib"] = estimate.as_gib()
        if result.fp8:  # which layers ran their GEMMs in FP8 (the run summary's line)
            summary["fp8"] = result.fp8
        if result.params_without_gradient:  # the row did not train what it names (train/gradient_check.py)
            summary["params_without_gradient"] = result.params_without_gradient
        if retries_before is not None:
            summary["alloc_retries"] = _alloc_retries(device) - retries_before
        trace = (
            result.run_dir / "traces" / f"rank0_steps{steps + 1}-{steps + 1}.json" if result.run_dir else None
        )
        if trace is not None and trace.exists() and dist.get_rank() == 0:
            summary["kernel_split"] = kernel_split(
                trace, records[-1]["step_time_s"], _unprofiled_step_s(records, summary)
            )
            if args.trace_dir:  # the run directory is temporary: keep the trace for a closer look
                kept = Path(args.trace_dir) / f"{_file_stem(name)}.json.gz"
                kept.parent.mkdir(parents=True, exist_ok=True)
                with trace.open("rb") as src, gzip.open(kept, "wb", compresslevel=6) as dst:
                    shutil.copyfileobj(src, dst)
                summary["kernel_split"]["trace"] = str(kept)
    entry |= {"records": records, "summary": summary}
    return entry


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _micro_batch_tokens(variant: dict) -> object:
    return (variant.get("config") or {}).get("train.max_tokens_per_gpu")


def _top_kernel_lines(top_kernels: list[list], kernels: int = 5, launchers: int = 2) -> list[str]:
    """The longest kernels of a profiled step, each with the host ops that launched it:
    ``1.510 s = 72 x 20.972 ms  gemm  nvjet_...`` then ``72 x MmBackward0 > aten::mm [8192,4096] [4096,8] bf16``.
    Entries of older results (``[name, seconds, category]``) print without calls or launchers."""
    if not top_kernels:
        return []
    lines = ["    top kernels (total = calls x mean, category, name; then calls x launcher > op input dims):"]
    for name, secs, category, *more in top_kernels[:kernels]:
        calls, mean_s, found = (more + [None, None, []])[:3]
        count = f" = {calls} x {mean_s * 1e3:.3f} ms" if calls else ""
        lines.append(f"      {secs:.3f} s{count}  {category}  {name[:90]}")
        for launcher in found[:launchers]:
            lines.append(f"        {launcher['calls']} x {trace_launchers.format_launcher(launcher)[:160]}")
    return lines


def format_table(result: dict) -> str:
    """One row per variant; ratios are to the first measured variant of the same micro-batch size
    (``mt=``), so a grid over sizes compares each size with its own first setting."""
    rows = [v for v in result["variants"]]

    def first_of(v, key):
        return next(
            (
                w["summary"].get(key)
                for w in rows
                if w["summary"].get(key) and _micro_batch_tokens(w) == _micro_batch_tokens(v)
            ),
            None,
        )

    lines = [
        f"{'variant':<34}{'tok/s':>9}{'/GPU':>8}{'vs 1st':>8}{'Σtok/Σs':>9}{'vs 1st':>8}{'step s':>8}{'opt s':>7}{'MFU':>7}"
        f"{'MFU-R':>7}{'GiB':>7}{'est':>7}{'syncs':>6}"
    ]
    for v in rows:
        s = v["summary"]
        if "error" in s:
            lines.append(f"{v['name']:<34}  FAILED: {s['error'][:160]}")
            continue
        if "refused" in s:
            fits = "; ".join(s["fits"]) or "nothing tried fits"
            lines.append(
                f"{v['name']:<34}  REFUSED by the memory model: {s['memory_estimate_gib']['total']:.1f} GiB "
                f"> {s['capacity_gib']:.1f} GiB; fits: {fits}"
            )
            continue
        first, first_total = first_of(v, "tokens_per_s"), first_of(v, "tokens_per_s_total")
        ratio = s["tokens_per_s"] / first if first else float("nan")

        def fmt(x, spec):
            return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0].rstrip("d")))

        lines.append(
            f"{v['name']:<34}{fmt(s['tokens_per_s'], '9.0f')}{fmt(s['tokens_per_s_per_gpu'], '8.0f')}"
            f"{ratio:7.3f}x{s['tokens_per_s_total']:9.0f}{s['tokens_per_s_total'] / first_total:7.3f}x"
            f"{fmt(s['step_time_s'], '8.3f')}{fmt(s['optimizer_time_s'], '7.3f')}"
            f"{fmt(s['mfu'], '7.3f')}{fmt(s['mfu_relax'], '7.3f')}{fmt(s['peak_mem_gib'], '7.1f')}"
            f"{s['memory_estimate_gib']['total']:7.1f}{fmt(s['host_syncs_max'], '6d')}"
        )
        if s.get("fp8"):
            lines.append(f"  {s['fp8']}")
        untrained = s.get("params_without_gradient")
        if untrained:
            lines.append(
                f"  NOT A VALID ROW: {len(untrained)} trainable parameters got no gradient "
                f"(first: {untrained[0]}); see the run's warning"
            )
    for v in rows:
        split = v["summary"].get("kernel_split")
        if split and not split["kernels"]:  # a CPU run: the trace holds host ops only
            lines.append(
                f"  {v['name']}: no GPU kernels in the profiled step (trace: {split.get('trace', '-')})"
            )
        elif split:
            parts = ", ".join(f"{k} {t:.3f}" for k, t in split["seconds"].items())
            unprofiled = split.get("idle_unprofiled_s")
            lines.append(
                f"  {v['name']}: kernels {split['kernels']}, {parts}, idle {split['idle_s']:.3f} "
                f"of {split['step_time_s']:.3f} s under the profiler"
                + (f", ~{unprofiled:.3f} s at the timed rate" if unprofiled is not None else "")
            )
            gaps = split.get("idle_gaps")
            if gaps:
                lines.append(
                    "    idle by gap size: "
                    + ", ".join(f"{k} {t:.3f} s" for k, t in gaps["seconds_by_gap"].items())
                )
                lines.append(
                    "    idle before: "
                    + ", ".join(f"{n[:40]} {t:.3f} s" for n, t in gaps["late_kernels"][:4])
                )
            lines.extend(_top_kernel_lines(split.get("top_kernels") or []))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="';'-separated variants (default without --grid: baseline,recompute=full;"
        "recompute=full;recompute=selective;recompute=none)",
    )
    parser.add_argument(
        "--grid",
        help="variants from every combination of axes, e.g. "
        "'mt=32768/65536;recompute=full/mixed;model.attention_backend=varlen/fa4' "
        "(after any --variants)",
    )
    parser.add_argument(
        "--mean-fraction",
        type=float,
        default=None,
        help="sample lengths per variant: mean this fraction of its micro-batch, clipped to "
        "[--min-tokens, the micro-batch] (replaces --mean-tokens / --max-tokens)",
    )
    add_cuda_alloc_conf(parser)
    parser.add_argument("--preset", default="qwen3_5_9b_reduced")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument(
        "--skip", type=int, help="warm-up steps left out of the medians (default 2, fewer with --steps 2)"
    )
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    parser.add_argument("--mean-tokens", type=float, default=3000.0)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--min-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--lengths-file", help="lengths to draw from: 'length' or 'length count' per line")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--optimizer", choices=("auto", "adam", "none"), default="auto")
    parser.add_argument("--profile", action="store_true", help="kernel-category split of one extra step")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--warm-up-pass",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the first variant once, untimed, before the measured ones (fills the shared "
        "autotune and compile caches for every batch's shapes, the profiled step's included)",
    )
    parser.add_argument(
        "--warm-up-every-variant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a warm-up pass of every variant (repeats that differ only in train.seed share one), "
        "not only the first: variants whose kernels the first does not run (e.g. the fused "
        "paths after fused=off) then compile them outside their timed steps",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--trace-dir",
        help="with --profile: keep each variant's profiled step here as a gzipped "
        "chrome trace of rank 0 (opens in Perfetto)",
    )
    args = parser.parse_args(argv)
    if args.variants is None:
        args.variants = (
            "" if args.grid else "baseline,recompute=full;recompute=full;recompute=selective;recompute=none"
        )
    if args.mean_fraction is not None and not 0 < args.mean_fraction <= 1:
        parser.error(f"--mean-fraction {args.mean_fraction} must be in (0, 1]")
    apply_cuda_alloc_conf(parser, args.cuda_alloc_conf)
    resolve_skip(parser, args, "a warm-up step")
    if args.skip >= args.steps:
        parser.error(f"--skip {args.skip} must be below --steps {args.steps}")
    try:
        variants = [v for v in (v.strip() for v in args.variants.split(";")) if v] + grid_variants(
            args.grid or ""
        )
    except ValueError as e:
        parser.error(str(e))
    if args.trace_dir and not (args.profile or any(map(profiled_variant, variants))):
        parser.error(f"--trace-dir {args.trace_dir} keeps the profiled step's trace: add --profile")
    if args.device == "cuda":
        require_gpus("relax_gdn.bench.train_e2e")

    from relax_gdn.runtime import Runtime

    # after the checks above: installing touches CUDA, and a refused run must not pay for it
    with Runtime() as runtime:  # every process-wide change of the benchmark, undone when it ends
        return _run(args, variants, runtime)


def _run(args, variants: list[str], runtime) -> dict:
    from relax_gdn.config import RunConfig
    from relax_gdn.parallel import init_distributed
    from relax_gdn.train.build import select_device

    base = RunConfig().with_overrides(
        {
            "model.preset": args.preset,
            "train.steps": args.steps,
            "train.global_batch_size": args.global_batch_size,
            "train.max_tokens_per_gpu": args.max_tokens_per_gpu,
            "train.device": args.device,
            "train.seed": args.seed,
            "data.num_samples": args.global_batch_size * (args.steps + 1),
            "optim.warmup_steps": 1,
            "optim.lr": 1e-5,
            "optim.min_lr": 1e-6,
            "logging.console": False,
            "logging.jsonl": False,
            "logging.count_host_syncs": True,
        }
    )
    device = select_device(base)
    created = init_distributed(device)
    world = dist.get_world_size()
    result = {
        "meta": {
            "preset": args.preset,
            "world_size": world,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "commit": tree_commit(),
            "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "args": vars(args),
            "lengths": "lognormal" if not args.lengths_file else args.lengths_file,
            # what every variant starts from: relax_gdn.compare labels a key a variant leaves alone by it
            "base_config": base.resolved().to_dict(),
        },
        "variants": [],
    }
    if args.warm_up_pass and variants:
        untimed = argparse.Namespace(**{**vars(args), "profile": False})
        # the profiled step's batch too: its new shapes would otherwise compile inside the profile
        warm_up_steps = {"train.steps": args.steps + 1} if args.profile else {}
        passes = []
        for variant in warm_up_variants(variants, world, every=args.warm_up_every_variant):
            steps = warm_up_steps or ({"train.steps": args.steps + 1} if profiled_variant(variant) else {})
            warm_up = run_variant(
                f"{variant} (warm-up pass)",
                base.with_overrides({**variant_overrides(variant, world), **steps}),
                untimed,
                world,
                device,
                runtime=runtime,
            )
            passes.append(
                {
                    "variant": variant,
                    "steps": len(warm_up["records"]),
                    "error": warm_up["summary"].get("error") or warm_up["summary"].get("refused"),
                }
            )
        result["meta"]["warm_up_pass"] = (
            passes[0] if len(passes) == 1 else {"variant": "every", "runs": passes}
        )
    for variant in variants:
        overrides = variant_overrides(variant, world)
        variant_args = (
            args if not profiled_variant(variant) else argparse.Namespace(**{**vars(args), "profile": True})
        )
        entry = run_variant(
            variant, base.with_overrides(overrides), variant_args, world, device, runtime=runtime
        )
        entry["config"] = overrides
        result["variants"].append(entry)
        if dist.get_rank() == 0:
            if args.out:  # after every variant: a run cut short keeps what it measured
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=1, default=str))
            s = entry["summary"]
            if "error" in s or "refused" in s:
                outcome = s.get("error") or f"refused by the memory model: {s['refused']}"
            else:
                outcome = (
                    f"{s['tokens_per_s']:.0f} tok/s, step {s['step_time_s']:.3f} s, peak {s['peak_mem_gib']} "
                    f"GiB, optimizer {entry['optimizer']}"
                )
            print(f"[train_e2e] {variant}: {outcome}", flush=True)
    if dist.get_rank() == 0:
        print(
            f"\n{args.preset}, world {world}, global batch {args.global_batch_size}, max_tokens_per_gpu "
            f"{args.max_tokens_per_gpu}, medians of steps {args.skip + 1}-{args.steps}"
        )
        print(format_table(result))
    if created:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
