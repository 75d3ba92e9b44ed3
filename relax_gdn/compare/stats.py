"""Steady-state statistics, variants and A/A-vs-A/B verdicts (pure: lists of dicts in, dicts out).

Rules (docs/compare.md repeats them):

* **Steady state and intervals**: :mod:`relax_gdn.run_stats` (the training loop's summary uses
  the same definitions): the first 10 % of a run's steps, at least 3, are warm-up; medians come
  with a 95 % percentile-bootstrap interval. Per-step metrics pool the steady-state steps of every
  run of a variant; per-run values (peak memory, final and mean loss) resample the runs.
* **Variants.** Runs are grouped by the config keys whose values differ between them, except
  keys that do not change what is trained or measured (``logging.*``, ``checkpoint.*``,
  ``run_name``, W&B's ``derived.*``) and the seed (``train.seed``: runs that differ only in it
  are repeats of one variant). A variant's label is its values of those keys alone; keys of one
  group that take the same values in every run are written once (``model.fused_*=false``).
* **Noise floor (A/A).** Variants with >= 2 runs give it: for throughput, the largest spread
  (max - min) / median of the runs' steady-state median tok/s; for a curve (loss, grad norm), the
  run-to-run variance at each step, pooled over those variants (and the largest max - min spread,
  reported).
* **Verdict (A/B).** Throughput *differs* when the ratio to the baseline is further from 1 than
  the noise floor AND the two bootstrap intervals do not overlap. A curve *differs* when the RMS
  over the common steps of (variant mean curve - baseline mean curve) is more than twice the RMS
  that the A/A variance predicts for that difference (per step: variance x (1/n_variant +
  1/n_baseline), at least (0.1 % of the baseline's value)^2 — the floor keeps reordered
  floating-point reductions from counting when the A/A runs are bit-identical). One number over
  all steps: a per-step test would flag noise at the steps where two repeats happen to cross.
  Without a variant of >= 2 runs there is no noise floor and the verdict is ``no A/A``.
* **Paired by seed.** Runs of two variants with the same ``train.seed`` start from the same weights
  and see the same batches in the same order, so their curves share most of the seed-to-seed noise
  that the A/A verdict above must allow for. Per curve, the difference (variant - baseline) of each
  same-seed pair is taken at every steady-state step of the pair's common steps; its mean over all
  pairs comes with a 95 % moving-block bootstrap interval (blocks of ceil(sqrt(steps)) consecutive
  steps, resampled within each pair: neighbouring steps' differences are correlated). With >= 2
  pairs, a curve *differs* by seed when that interval excludes +-(0.1 % of the baseline's mean)
  and every pair's mean difference has the sign of the overall mean; else it is *within noise*.
  One pair is measured, not judged (``one pair``); none: ``no pairs``. Nor is a pair with fewer
  than ``PAIRED_MIN_STEPS`` steady steps (``too few steps``): its blocks are so few that the
  bootstrap interval shrinks towards one value and any offset would count.
* **Shared machine.** A comparison whose runs overlapped in time on one host, or ran one after
  another on a host loaded far above its cores, says so beside its tok/s verdict
  (:mod:`relax_gdn.compare.machine`).
* **Diverged runs.** A run with a step whose loss or grad norm was not finite
  (:func:`~relax_gdn.compare.runs.nonfinite_steps`) is *diverged*, and so is its variant. Its
  non-finite values are left out of every statistic, the run is left out of the A/A noise floor
  (its spread is the divergence, not run-to-run noise), and the curve verdicts against a diverged
  variant or baseline are ``diverged``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from relax_gdn.compare.machine import shared_machine
from relax_gdn.compare.runs import CompareInputError, Run, is_nonfinite, nonfinite_steps
from relax_gdn.run_stats import (
    BOOTSTRAP_RESAMPLES,
    MIN_WARMUP_STEPS,
    RUN_METRICS,
    STEP_METRICS,
    WARMUP_FRACTION,
    median_ci,
    run_summary,
    run_value,
    steady_records,
    step_values,
    warmup_steps,
)
from relax_gdn.run_stats import finite_values as _finite

CURVE_RTOL = 1e-3  # relative floor of the per-step noise
# 10 steady steps make blocks of 4 with 7 places to start: fewer, and the resampled means of a pair
# take so few values that the interval says nothing (2 steps: one block, an interval of zero width)
PAIRED_MIN_STEPS = 10
CURVE_NOISE_RATIO = 2.0  # a curve differs when its RMS difference exceeds this many times the A/A prediction
SEED_KEY = "train.seed"
REPEAT_KEYS = (SEED_KEY,)
IGNORED_KEY_PREFIXES = ("logging.", "checkpoint.", "derived.", "hydra.")
IGNORED_KEYS = ("run_name",)

METRIC_LABELS = dict(STEP_METRICS + RUN_METRICS)
# per-step curves judged against the A/A noise; mtp_loss where runs train an MTP layer (model.mtp.*)
CURVES = ("loss", "grad_norm", "mtp_loss")


# ---- variants ------------------------------------------------------------------------------------


@dataclass
class Variant:
    label: str
    config: dict[str, Any]  # its values of the varying keys
    runs: list[Run]


def _counts(key: str) -> bool:
    return key not in IGNORED_KEYS and key not in REPEAT_KEYS and not key.startswith(IGNORED_KEY_PREFIXES)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def group_variants(runs: list[Run]) -> tuple[list[str], list[Variant]]:
    """(varying keys, variants in order of first appearance)."""
    keys = sorted({k for run in runs for k in run.config if _counts(k)})
    varying = [k for k in keys if len({_canonical(run.config.get(k, UNSET)) for run in runs}) > 1]
    label_keys = _label_keys(varying, runs)
    variants: dict[str, Variant] = {}
    for run in runs:
        config = {k: run.config.get(k, UNSET) for k in varying}
        label = ", ".join(f"{name}={_fmt_value(config[keys[0]])}" for name, keys in label_keys) or "all runs"
        variants.setdefault(label, Variant(label, config, [])).runs.append(run)
    return varying, list(variants.values())


def _label_keys(varying: list[str], runs: list[Run]) -> list[tuple[str, list[str]]]:
    """What a label names: each varying key, or one name for the keys of one group whose values
    agree in every run (``model.fused_norms`` and ``model.fused_swiglu`` -> ``model.fused_*``, or
    ``group.{a,b}`` when their names share no prefix)."""
    together: dict[tuple[str, str], list[str]] = {}
    for key in varying:
        values = _canonical([run.config.get(key, UNSET) for run in runs])
        together.setdefault((key.rpartition(".")[0], values), []).append(key)
    named = []
    for (group, _), keys in together.items():
        if len(keys) == 1:
            named.append((keys[0], keys))
            continue
        leaves = [k.rpartition(".")[2] for k in keys]
        prefix = os.path.commonprefix(leaves)
        dot = f"{group}." if group else ""
        named.append((f"{dot}{prefix}*" if len(prefix) >= 2 else f"{dot}{{{','.join(leaves)}}}", keys))
    return named


class _Unset:
    """A key a run's config does not have (unlike an explicit null)."""

    def __repr__(self) -> str:
        return "(unset)"


UNSET = _Unset()


def _fmt_value(value: Any) -> str:
    """A config value as an override would write it (``true``, ``null``, ``0.003``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if value is UNSET:
        return repr(value)
    if isinstance(value, float):  # a derived value (min_lr = 0.1 x 0.003) without its binary tail
        return repr(float(f"{value:.12g}"))
    return str(value)


def find_baseline(variants: list[Variant], selectors: list[str]) -> Variant:
    """The variant whose config matches every ``key=value`` selector; the first variant without."""
    if not selectors:
        return variants[0]
    wanted = []
    for selector in selectors:
        if "=" not in selector:
            raise CompareInputError(f"--baseline {selector!r}: expected key=value, e.g. gdn.cp_mode=headwise")
        wanted.append(tuple(selector.split("=", 1)))
    for variant in variants:
        run_config = variant.runs[0].config
        if all(_fmt_value(run_config.get(k)) == v for k, v in wanted):
            return variant
    raise CompareInputError(
        f"--baseline {' '.join(selectors)} matches no variant; variants: "
        + "; ".join(v.label for v in variants)
    )


# ---- statistics and verdicts ---------------------------------------------------------------------


def variant_stats(variant: Variant) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for metric, _ in STEP_METRICS:
        pooled = [x for run in variant.runs for x in step_values(run.records, metric, run.world_size)]
        stats[metric] = median_ci(pooled)
    for metric, _ in RUN_METRICS:
        stats[metric] = median_ci(_finite(run_value(run.records, metric) for run in variant.runs))
    return stats


def _run_median_tps(run: Run) -> float | None:
    values = step_values(run.records, "tokens_per_s", run.world_size)
    return float(np.median(values)) if values else None


def _curve(run: Run, key: str) -> dict[int, float]:
    return {
        int(r["step"]): float(r[key])
        for r in run.records
        if r.get(key) is not None and math.isfinite(float(r[key]))
    }


def _mean_curve(variant: Variant, key: str) -> dict[int, float]:
    curves = [_curve(run, key) for run in variant.runs]
    steps = set.intersection(*(set(c) for c in curves)) if curves else set()
    return {s: float(np.mean([c[s] for c in curves])) for s in sorted(steps)}


def _healthy(variant: Variant) -> Variant:
    """``variant`` with only its runs that did not diverge."""
    return Variant(
        variant.label, variant.config, [run for run in variant.runs if not nonfinite_steps(run.records)]
    )


def noise_floor(variants: list[Variant]) -> dict[str, Any]:
    """The A/A spreads and per-step curve variances (module docstring) from every variant with >= 2
    runs that did not diverge (a diverged run's spread is its divergence, not noise)."""
    repeated = [v for v in map(_healthy, variants) if len(v.runs) >= 2]
    throughput = None
    sums: dict[str, dict[int, list[float]]] = {key: {} for key in CURVES}  # step -> [sum of var x dof, dof]
    per_variant = []
    for variant in repeated:
        medians = _finite(_run_median_tps(run) for run in variant.runs)
        spread = (max(medians) - min(medians)) / float(np.median(medians)) if len(medians) >= 2 else None
        if spread is not None:
            throughput = spread if throughput is None else max(throughput, spread)
        entry = {"variant": variant.label, "runs": len(variant.runs), "tokens_per_s_spread": spread}
        for key in CURVES:
            run_curves = [_curve(run, key) for run in variant.runs]
            common = sorted(set.intersection(*(set(c) for c in run_curves)))
            spreads = []
            for s in common:
                values = [c[s] for c in run_curves]
                spreads.append(max(values) - min(values))
                acc = sums[key].setdefault(s, [0.0, 0.0])
                acc[0] += float(np.var(values, ddof=1)) * (len(values) - 1)
                acc[1] += len(values) - 1
            entry[f"{key}_max_spread"] = max(spreads) if spreads else None
        per_variant.append(entry)
    variance = {key: {s: total / dof for s, (total, dof) in by_step.items()} for key, by_step in sums.items()}
    return {
        "available": bool(repeated),
        "tokens_per_s_spread": throughput,
        "curve_variance": variance,
        "variants": per_variant,
    }


def throughput_verdict(
    variant: dict[str, Any], baseline: dict[str, Any], noise: dict[str, Any]
) -> dict[str, Any]:
    v, b = variant["tokens_per_s"], baseline["tokens_per_s"]
    if v is None or b is None or not b["median"]:
        return {"verdict": "no data"}
    ratio = v["median"] / b["median"]
    overlap = v["lo"] <= b["hi"] and b["lo"] <= v["hi"]
    spread = noise["tokens_per_s_spread"]
    out = {"ratio": ratio, "diff": ratio - 1.0, "noise": spread, "intervals_overlap": overlap}
    if spread is None:
        out["verdict"] = "no A/A"
    else:
        out["verdict"] = "differs" if abs(ratio - 1.0) > spread and not overlap else "within noise"
    return out


def curve_verdict(variant: Variant, baseline: Variant, key: str, noise: dict[str, Any]) -> dict[str, Any]:
    a, b = _mean_curve(baseline, key), _mean_curve(variant, key)
    steps = sorted(set(a) & set(b))
    if not steps:
        return {"verdict": "no data", "steps": 0}
    variance = noise["curve_variance"][key]
    scale = 1.0 / len(baseline.runs) + 1.0 / len(variant.runs)
    diffs = {s: abs(b[s] - a[s]) for s in steps}
    # the variance of (mean of variant runs - mean of baseline runs) at each step if only noise differs
    expected = {s: max(variance.get(s, 0.0), (CURVE_RTOL * a[s]) ** 2) * scale for s in steps}
    rms_diff = math.sqrt(float(np.mean([d * d for d in diffs.values()])))
    rms_noise = math.sqrt(float(np.mean(list(expected.values()))))
    worst = max(steps, key=lambda s: diffs[s])
    out = {
        "steps": len(steps),
        "rms_diff": rms_diff,
        "rms_noise": rms_noise,
        "noise_ratio": rms_diff / rms_noise if rms_noise else (math.inf if rms_diff else 0.0),
        "outside": sum(diffs[s] > 2.0 * math.sqrt(expected[s]) for s in steps),
        "max_abs_diff": diffs[worst],
        "at_step": worst,
        "max_rel_diff": diffs[worst] / abs(a[worst]) if a[worst] else None,
        "mean_abs_diff": float(np.mean(list(diffs.values()))),
    }
    if _diverged(variant) or _diverged(baseline):  # a curve with non-finite steps is not compared
        out |= {"verdict": "diverged", "rms_noise": None, "noise_ratio": None, "outside": None}
    elif not noise["available"]:  # no repeats: no noise to weigh the difference against, none quoted
        out |= {"verdict": "no A/A", "rms_noise": None, "noise_ratio": None, "outside": None}
    else:
        out["verdict"] = "differs" if out["noise_ratio"] > CURVE_NOISE_RATIO else "within noise"
    return out


def _first_run_by_seed(variant: Variant) -> dict[str, tuple[Any, Run]]:
    """Each seed of ``variant``'s runs (as :func:`_canonical` writes it) -> (seed, its first run)."""
    first: dict[str, tuple[Any, Run]] = {}
    for run in variant.runs:
        seed = run.config.get(SEED_KEY, UNSET)
        if seed is not UNSET:
            first.setdefault(_canonical(seed), (seed, run))
    return first


def _seed_pairs(variant: Variant, baseline: Variant) -> list[tuple[Any, Run, Run]]:
    """(seed, variant run, baseline run) for each seed both variants ran (its first run in each)."""
    base = _first_run_by_seed(baseline)
    return [
        (seed, run, base[key][1]) for key, (seed, run) in _first_run_by_seed(variant).items() if key in base
    ]


def _block_bootstrap_mean(diffs: list[np.ndarray], seed: int = 0) -> tuple[float, float]:
    """95 % interval of the mean of all of ``diffs`` (one array per pair): each resample draws, per
    pair, ceil(n / L) blocks of L = ceil(sqrt(n)) consecutive values (moving blocks), cut to n."""
    rng = np.random.default_rng(seed)
    means = np.zeros(BOOTSTRAP_RESAMPLES)
    total = sum(len(d) for d in diffs)
    for d in diffs:
        n = len(d)
        block = math.ceil(math.sqrt(n))
        count = math.ceil(n / block)
        starts = rng.integers(0, n - block + 1, size=(BOOTSTRAP_RESAMPLES, count))
        index = (starts[:, :, None] + np.arange(block)).reshape(BOOTSTRAP_RESAMPLES, -1)[:, :n]
        means += d[index].sum(axis=1)
    means /= total
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def paired_curve_verdict(variant: Variant, baseline: Variant, key: str) -> dict[str, Any]:
    """The curve ``key`` of same-seed runs, difference by difference (module docstring)."""
    pairs = _seed_pairs(variant, baseline)
    diffs, bases, per_pair = [], [], []
    for seed, v_run, b_run in pairs:
        v, b = _curve(v_run, key), _curve(b_run, key)
        common = sorted(set(v) & set(b))
        steady = common[warmup_steps(len(common)) :]
        if len(steady) < 2:
            continue
        d, base = np.array([v[s] - b[s] for s in steady]), np.array([b[s] for s in steady])
        diffs.append(d)
        bases.append(base)
        per_pair.append(
            {
                "seed": seed,
                "steps": len(steady),
                "first_step": steady[0],
                "last_step": steady[-1],
                "mean_diff": float(d.mean()),
                "rel_diff": float(d.mean() / base.mean()) if base.mean() else None,
            }
        )
    if not diffs:
        return {"verdict": "no pairs", "pairs": 0}
    all_diffs, all_bases = np.concatenate(diffs), np.concatenate(bases)
    mean, base_mean = float(all_diffs.mean()), float(all_bases.mean())
    lo, hi = _block_bootstrap_mean(diffs)
    floor = CURVE_RTOL * abs(base_mean)
    out = {
        "pairs": len(diffs),
        "steps": int(all_diffs.size),
        "mean_diff": mean,
        "rel_diff": mean / base_mean if base_mean else None,
        "lo": lo,
        "hi": hi,
        "floor": floor,
        "per_pair": per_pair,
    }
    if _diverged(variant) or _diverged(baseline):
        verdict = "diverged"
    elif len(diffs) < 2:
        verdict = "one pair"
    elif min(p["steps"] for p in per_pair) < PAIRED_MIN_STEPS:
        verdict = "too few steps"
    else:
        same_sign = all(p["mean_diff"] * mean > 0 for p in per_pair)
        verdict = "differs" if (lo > floor or hi < -floor) and same_sign else "within noise"
    return out | {"verdict": verdict}


def _diverged(variant: Variant) -> bool:
    return any(nonfinite_steps(run.records) for run in variant.runs)


def _run_entry(run: Run) -> dict[str, Any]:
    """A run as ``summary.json`` lists it (``nonfinite_steps`` > 0: diverged)."""
    bad = [r["step"] for r in run.records if is_nonfinite(r)]
    return {
        "name": run.name,
        "source": run.source,
        "steps": len(run.records),
        "world_size": run.world_size,
        "steady_steps": len(steady_records(run.records)),
        "nonfinite_steps": len(bad),
        "diverged": bool(bad),
        "first_nonfinite_step": bad[0] if bad else None,
        "summary": run_summary(run.records, run.world_size),
    }


def compare_runs(runs: list[Run], baseline: list[str] | None = None) -> dict[str, Any]:
    """Everything the reports show, as one JSON-ready dict (``summary.json``)."""
    if not runs:
        raise CompareInputError("no runs to compare (no metrics.jsonl with step records)")
    varying, variants = group_variants(runs)
    base = find_baseline(variants, baseline or [])
    noise = noise_floor(variants)
    stats = {v.label: variant_stats(v) for v in variants}
    out_variants = []
    for variant in variants:
        ratios = {}
        for metric in METRIC_LABELS:
            s, b = stats[variant.label][metric], stats[base.label][metric]
            ratios[metric] = s["median"] / b["median"] if s and b and b["median"] else None
        out_variants.append(
            {
                "label": variant.label,
                "config": {k: v for k, v in variant.config.items() if v is not UNSET},
                "baseline": variant is base,
                "diverged": _diverged(variant),
                "nonfinite_steps": sum(nonfinite_steps(r.records) for r in variant.runs),
                "runs": [_run_entry(r) for r in variant.runs],
                "stats": stats[variant.label],
                "ratio_to_baseline": ratios,
            }
        )
    comparisons = []
    for variant in variants:
        if variant is base:
            continue
        comparisons.append(
            {
                "variant": variant.label,
                "baseline": base.label,
                "diverged": _diverged(variant) or _diverged(base),
                "throughput": throughput_verdict(stats[variant.label], stats[base.label], noise),
                "shared_machine": shared_machine(variant.runs, base.runs, steady_records),
                **{key: curve_verdict(variant, base, key, noise) for key in CURVES},
                "paired": {key: paired_curve_verdict(variant, base, key) for key in CURVES},
            }
        )
    noise_out = {k: v for k, v in noise.items() if k != "curve_variance"}
    return {
        "schema": "relax_gdn.compare/1",
        "rules": _rules(),
        "varying_keys": varying,
        "baseline": base.label,
        "variants": out_variants,
        "noise": noise_out,
        "comparisons": comparisons,
    }


def _rules() -> dict[str, str]:
    """The rules of the verdicts, as summary.json states them (module docstring)."""
    return {
        "warmup": f"first {100 * WARMUP_FRACTION:g} % of steps, at least {MIN_WARMUP_STEPS}",
        "interval": f"95 % percentile bootstrap of the median, {BOOTSTRAP_RESAMPLES} resamples",
        "curve": f"differs when the RMS over steps of the mean-curve difference exceeds "
        f"{CURVE_NOISE_RATIO:g}x the RMS the A/A variance predicts (per step at least "
        f"({CURVE_RTOL:g} x baseline value)^2)",
        "paired": f"same-seed runs: the mean of (variant - baseline) over steady steps differs when "
        f"its 95 % moving-block bootstrap interval excludes +-{CURVE_RTOL:g} x the baseline's mean and "
        f"every pair has its sign (>= 2 pairs of >= {PAIRED_MIN_STEPS} steady steps each)",
        "throughput": "differs when |ratio - 1| > A/A spread and the intervals do not overlap",
        "diverged": "a run with a non-finite loss or grad norm; left out of the A/A noise floor, its "
        "curves not compared",
    }


def variant_curves(
    runs_by_variant: dict[str, list[Run]], key: str
) -> dict[str, list[tuple[list[int], list[float]]]]:
    """Per variant, one (steps, values) line per run (for plots)."""
    out = {}
    for label, runs in runs_by_variant.items():
        lines = []
        for run in runs:
            curve = _curve(run, key)
            lines.append((list(curve), list(curve.values())))
        out[label] = lines
    return out
