"""Statistics of a run's step records (the ``metrics.jsonl`` schema), defined once for the training
loop's summaries (console, W&B) and the comparison (:mod:`relax_gdn.compare`). Pure: lists of
dicts in, numbers out.

* **Steady state.** The first 10 % of a run's steps, at least 3, are warm-up (compilation,
  autotuning, allocator growth, cold caches) and left out of every throughput statistic; a run
  too short to keep 2 steps keeps its second half. Loss, grad-norm and MTP-loss curves use every step.
* **Intervals.** Medians with a 95 % percentile-bootstrap interval (2000 resamples, fixed seed):
  per-step metrics pool the steady-state steps of every run of a variant; per-run values
  (peak memory, final and mean loss) resample the runs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

WARMUP_FRACTION = 0.1
MIN_WARMUP_STEPS = 3
BOOTSTRAP_RESAMPLES = 2000

# per-step metrics: (key, label, how a step record gives it)
STEP_METRICS = (
    ("tokens_per_s", "tok/s"),
    ("tokens_per_s_per_gpu", "tok/s/GPU"),
    ("mfu", "MFU"),
    ("step_time_s", "step time (s)"),
    ("host_syncs", "host syncs"),
)
# one value per run
RUN_METRICS = (
    ("peak_mem_gb", "peak mem (GB)"),
    ("final_loss", "final loss"),
    ("mean_loss", "mean loss"),
    ("final_mtp_loss", "final MTP loss"),  # runs that train a multi-token-prediction layer
)


def warmup_steps(n: int) -> int:
    """How many leading steps of an ``n``-step run are warm-up (module docstring)."""
    warm = max(MIN_WARMUP_STEPS, math.ceil(WARMUP_FRACTION * n))
    return warm if n - warm >= 2 else n // 2


def steady_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return records[warmup_steps(len(records)) :]


def finite_values(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def step_values(records: list[dict[str, Any]], metric: str, world_size: int) -> list[float]:
    """Steady-state values of a per-step metric."""
    steady = steady_records(records)
    if metric == "tokens_per_s_per_gpu":
        return finite_values(
            r.get("tokens_per_s") / world_size if r.get("tokens_per_s") is not None else None for r in steady
        )
    return finite_values(r.get(metric) for r in steady)


def run_value(records: list[dict[str, Any]], metric: str) -> float | None:
    """A per-run metric: peak memory over the run, the last loss (and MTP loss), the steady-state mean loss."""
    if metric == "peak_mem_gb":
        values = finite_values(r.get("peak_mem_gb") for r in records)
        return max(values) if values else None
    if metric in ("final_loss", "final_mtp_loss"):
        values = finite_values(r.get(metric.removeprefix("final_")) for r in records[-1:])
        return values[0] if values else None
    if metric == "mean_loss":
        values = finite_values(r.get("loss") for r in steady_records(records))
        return float(np.mean(values)) if values else None
    raise KeyError(metric)


def median_ci(values: list[float], seed: int = 0) -> dict[str, Any] | None:
    """Median and 95 % percentile-bootstrap interval of the median; None without values."""
    if not values:
        return None
    data = np.asarray(values, dtype=float)
    median = float(np.median(data))
    if len(data) == 1:
        return {"median": median, "lo": median, "hi": median, "n": 1}
    rng = np.random.default_rng(seed)
    resampled = np.median(rng.choice(data, size=(BOOTSTRAP_RESAMPLES, len(data)), replace=True), axis=1)
    lo, hi = np.percentile(resampled, [2.5, 97.5])
    return {"median": median, "lo": float(lo), "hi": float(hi), "n": int(len(data))}


def cp_size_histogram(records: list[dict[str, Any]]) -> dict[str, int]:
    """Micro-batches per CP size over a dynamic-CP run (the records' ``cp_sizes``); {} otherwise."""
    total: dict[str, int] = {}
    for record in records:
        for size, count in (record.get("cp_sizes") or {}).items():
            total[str(size)] = total.get(str(size), 0) + int(count)
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))


def run_summary(records: list[dict[str, Any]], world_size: int | None = None) -> dict[str, Any]:
    """End-of-run summary values (W&B run summary; the same statistics as the comparison):
    ``steady/<metric>`` medians over the steady state, ``peak_mem_gb``, ``total_tokens``,
    ``final_loss``, ``mean_loss``, the step counts, and ``cp_sizes/<d>`` under dynamic CP."""
    if not records:
        return {}
    if world_size is None:
        world_size = next((int(r["world_size"]) for r in records if r.get("world_size")), 1)
    summary: dict[str, Any] = {
        "steady/steps": len(steady_records(records)),
        "steady/warmup_steps": warmup_steps(len(records)),
    }
    for metric, _ in STEP_METRICS:
        stat = median_ci(step_values(records, metric, world_size))
        if stat is not None:
            summary[f"steady/{metric}"] = stat["median"]
    for metric, _ in RUN_METRICS:
        value = run_value(records, metric)
        if value is not None:
            summary[metric] = value
    summary["total_tokens"] = int(sum(r.get("tokens") or 0 for r in records))
    for size, count in cp_size_histogram(records).items():
        summary[f"cp_sizes/{size}"] = count
    return summary
