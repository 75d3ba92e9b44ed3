"""The comparison's reports as a person reads them, on realistic inputs: a CPU sweep directory (run
directories with the resolved config.yaml and metrics.jsonl the training loop writes; two CP
modes that train the same curve, two seeds each) and a ``bench.train_e2e --out`` JSON (the 9B on
one GPU, variants written as the benchmark writes them, one out of memory, one an A/A repeat).

Labels name only what differs, with real values for the defaults; every plot keeps its axes size
with long labels; coinciding curves stay visible; "no A/A" quotes no noise; the output goes beside
the input. The HTML is rendered in headless Chromium (Debian's ``chromium``; the test is skipped,
saying so, where it is not installed) and the screenshot's plots are measured. Set
``COMPARE_SCREENSHOT_DIR=docs`` to refresh docs/compare_report_{sweep,bench}.png."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from relax_gdn.compare.__main__ import default_out_dir, main
from relax_gdn.config.schema import RunConfig

ROOT = Path(__file__).resolve().parents[1]
BENCH_VARIANTS = (
    "baseline,recompute=full",
    "recompute=full",
    "recompute=selective",
    "recompute=none",
    "baseline,recompute=full,train.seed=1234",
)
CHROMIUM = shutil.which("chromium")
SCREENSHOT_DIR = os.environ.get("COMPARE_SCREENSHOT_DIR")


# ---- inputs ------------------------------------------------------------------------------------------


def _step_record(
    step: int,
    loss: float,
    grad_norm: float,
    tokens: int,
    tokens_per_s: float,
    world_size: int,
    gpu: dict | None = None,
) -> dict:
    """A metrics.jsonl record (relax_gdn.train.metrics.StepRecord's fields)."""
    step_time = tokens / tokens_per_s
    record = {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": 3e-3 * min(1.0, step / 2),
        "tokens": tokens,
        "tokens_per_s": tokens_per_s,
        "mfu": None,
        "mfu_relax": None,
        "tflops_per_gpu": 4.4e-6 * tokens_per_s / world_size,
        "step_time_s": step_time,
        "loss_tokens": tokens // 2,
        "padded_tokens": tokens + 3,
        "num_micro_batches": 1,
        "num_samples": 16,
        "epoch": 0,
        "peak_mem_gb": None,
        "host_syncs": None,
        "world_size": world_size,
        "optimizer_time_s": 0.007,
    }
    return record | (gpu or {})


def write_sweep(sweep_dir: Path, steps: int = 20) -> Path:
    """``hydra/launcher=local tasks_per_node=2 parallel.cp=2 gdn.cp_mode=headwise,chunkwise train.seed=1,2``:
    run directories 0-3 as the training loop leaves them. The two modes train the same curve for a
    seed (they differ in rounding only); throughput differs."""
    rng = np.random.default_rng(7)
    for num, (mode, seed) in enumerate((m, s) for m in ("headwise", "chunkwise") for s in (1, 2)):
        overrides = {
            "parallel.cp": 2,
            "gdn.cp_mode": mode,
            "train.seed": seed,
            "train.steps": steps,
            "logging.wandb.group": "sweep-2026-12-01_14-48-00",
            "logging.wandb.job_type": f"gdn.cp_mode={mode}",
        }
        config = dataclasses.asdict(RunConfig().with_overrides(overrides))
        run_dir = sweep_dir / str(num)
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        seed_rng = np.random.default_rng(seed)
        base_tps = 6200.0 if mode == "headwise" else 7000.0
        records = []
        for step in range(1, steps + 1):
            loss = 2.7 + 4.2 * math.exp(-step / 6) + seed_rng.normal(0, 0.02)
            grad_norm = 0.3 + 1.4 * math.exp(-step / 8) + seed_rng.normal(0, 0.05)
            tokens = int(1400 + seed_rng.integers(-200, 200))
            tps = base_tps * (0.6 if step <= 2 else 1.0) + rng.normal(0, 150)
            records.append(
                _step_record(step, loss + rng.normal(0, 1e-6), grad_norm, tokens, tps, world_size=2)
            )
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run_dir / "train.log").write_text("")
    return sweep_dir


def write_bench_json(path: Path, steps: int = 7) -> Path:
    """``python -m relax_gdn.bench.train_e2e --preset qwen3_5_9b --variants "<BENCH_VARIANTS>" --profile
    --out e2e.json`` on one H200: no optimizer update (Adam does not fit), so every variant trains the
    same loss (ln 248,320 ~ 12.4); the step after ``--steps`` is the profiled one; recompute=none runs
    out of memory. ``config`` is what each variant set (``variant_overrides``)."""
    from relax_gdn.bench.train_e2e import variant_overrides

    rng = np.random.default_rng(3)
    batch_tokens = [int(t) for t in rng.normal(48000, 4000, steps + 1)]
    losses = [12.42 + float(d) for d in rng.normal(0, 0.01, steps + 1)]
    grad_norms = [float(g) for g in rng.normal(2.1, 0.15, steps + 1)]
    speed = {
        "baseline,recompute=full": (6950.0, 60.2),
        "recompute=full": (8675.0, 57.1),
        "recompute=selective": (10127.0, 98.5),
        "baseline,recompute=full,train.seed=1234": (6890.0, 60.2),
    }
    variants = []
    for name in BENCH_VARIANTS:
        entry = {
            "name": name,
            "optimizer": "none",
            "optimizer_note": "Adam state does not fit: estimate 167 GiB > 140 GiB; forward + backward "
            "+ DDP gradient reduction, no update",
            "lengths": {"mean": 2987.0, "median": 2311.0, "p90": 6240.0, "max": 8192},
            "config": variant_overrides(name, 1),
        }
        if name not in speed:
            variants.append(
                entry
                | {
                    "records": [],
                    "summary": {
                        "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.37 GiB. GPU 0 has a total "
                        "capacity of 139.81 GiB of which 1.02 GiB is free."
                    },
                }
            )
            continue
        tps, peak = speed[name]
        records = []
        for step in range(1, steps + 2):
            rate = tps * (0.55 if step == 1 else 1.0) * (1 + float(rng.normal(0, 0.006)))
            gpu = {
                "mfu": 0.43 * rate / 8675.0,
                "mfu_relax": 0.45 * rate / 8675.0,
                "peak_mem_gb": peak,
                "host_syncs": 1,
                "tflops_per_gpu": 425.0 * rate / 8675.0,
            }
            loss = losses[step - 1] + float(rng.normal(0, 2e-4))
            grad_norm = grad_norms[step - 1] + float(rng.normal(0, 1e-3))
            records.append(
                _step_record(step, loss, grad_norm, batch_tokens[step - 1], rate, world_size=1, gpu=gpu)
                | {"lr": 1e-5}
            )
        records[-1]["profiled"] = True
        summary = {
            "steps_timed": steps - 2,
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps,
            "mfu": 0.43 * tps / 8675,
            "step_time_s": 48000 / tps,
            "peak_mem_gib": peak,
            "host_syncs_max": 1,
            "loss_last": losses[-2],
            "memory_estimate_gib": {"total": peak + 2.0},
        }
        variants.append(entry | {"records": records, "summary": summary})
    meta = {
        "preset": "qwen3_5_9b",
        "world_size": 1,
        "device": "NVIDIA H200",
        "torch": "2.14.1+cu130",
        "commit": "a9e5a4e",
        "date_utc": "2026-12-01T12:00:00+00:00",
        "lengths": "lognormal",
        "args": {
            "variants": ";".join(BENCH_VARIANTS),
            "preset": "qwen3_5_9b",
            "steps": steps,
            "skip": 2,
            "global_batch_size": 16,
            "max_tokens_per_gpu": 8192,
            "seed": 1234,
            "optimizer": "auto",
            "profile": True,
            "device": "auto",
            "out": str(path),
        },
        "warm_up_pass": {
            "variant": "every",
            "runs": [{"variant": v, "steps": steps + 1, "error": None} for v in BENCH_VARIANTS[:4]],
        },
    }
    path.write_text(json.dumps({"meta": meta, "variants": variants}, indent=1))
    return path


# ---- measuring images --------------------------------------------------------------------------------


def _longest_run(mask: np.ndarray) -> int:
    """Longest run of True along the last axis, over all rows."""
    best = 0
    for row in mask:
        padded = np.concatenate(([0], row.astype(np.int8), [0]))
        edges = np.flatnonzero(np.diff(padded))
        if len(edges):
            best = max(best, int((edges[1::2] - edges[::2]).max()))
    return best


def plot_frame_px(png: Path) -> tuple[int, int]:
    """(width, height) in pixels of the largest axes frame in an image: the longest horizontal and
    vertical runs of near-black pixels (the spines; text strokes are short, plot lines coloured)."""
    import matplotlib.image

    pixels = matplotlib.image.imread(str(png))[..., :3]
    dark = (pixels < 0.5).all(axis=-1)
    return _longest_run(dark), _longest_run(dark.T)


# ---- tests -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reports")
    sweep = write_sweep(tmp / "sweep")
    bench = write_bench_json(tmp / "e2e.json")
    assert main([str(sweep), "--baseline", "gdn.cp_mode=headwise"]) == 0
    assert main([str(bench)]) == 0
    return {"sweep": sweep / "compare", "bench": tmp / "e2e-compare"}


def test_reports_go_beside_their_input(reports, tmp_path):
    assert (reports["sweep"] / "report.html").exists() and (reports["bench"] / "report.html").exists()
    assert default_out_dir([str(tmp_path / "runs" / "e2e.json")], None) == tmp_path / "runs" / "e2e-compare"
    assert default_out_dir([str(tmp_path)], None) == tmp_path / "compare"
    assert default_out_dir([], "sweep-x") == Path("compare-sweep-x")


def test_benchmark_labels_name_only_what_differs_with_real_default_values(reports):
    summary = json.loads((reports["bench"] / "summary.json").read_text())
    labels = [v["label"] for v in summary["variants"]]
    assert labels == [
        "model.fused_*=false, recompute.granularity=full, recompute.skip_unused=false",
        "model.fused_*=true, recompute.granularity=full, recompute.skip_unused=true",
        "model.fused_*=true, recompute.granularity=selective, recompute.skip_unused=true",
    ]  # recompute=none ran out of memory: no records, no variant
    assert summary["varying_keys"] == [
        "model.fused_cross_entropy",
        "model.fused_grad_accumulation",
        "model.fused_norms",
        "model.fused_swiglu",
        "recompute.granularity",
        "recompute.skip_unused",
    ]
    assert all(v is not None for variant in summary["variants"] for v in variant["config"].values())
    # "baseline,recompute=full" and its train.seed=1234 twin are one variant: an A/A pair
    assert [len(v["runs"]) for v in summary["variants"]] == [2, 1, 1] and summary["noise"]["available"]
    md = (reports["bench"] / "summary.md").read_text()
    assert "None" not in md and "fused_*=true" in md


def test_sweep_labels_and_no_aa_text(reports, tmp_path):
    summary = json.loads((reports["sweep"] / "summary.json").read_text())
    assert [v["label"] for v in summary["variants"]] == ["gdn.cp_mode=headwise", "gdn.cp_mode=chunkwise"]
    # one seed per mode: no A/A, and then no noise floor is quoted anywhere
    single = tmp_path / "single"
    for num in (0, 2):
        shutil.copytree(reports["sweep"].parent / str(num), single / str(num))
    assert main([str(single)]) == 0
    md = (single / "compare" / "summary.md").read_text()
    (line,) = [line for line in md.splitlines() if line.startswith("- gdn.cp_mode=chunkwise vs")]
    assert line.count("**no A/A**") == 3 and "noise" not in line, line
    assert "measured but not judged (no A/A)" in md


def test_plots_keep_their_axes_size_and_coinciding_curves_stay_visible(reports):
    for name in ("bench", "sweep"):
        for png in sorted(reports[name].glob("*.png")):
            width, height = plot_frame_px(png)
            if png.stem == "throughput":  # bars: the axes grow with the variants, never narrower
                assert width >= 600 and height >= 110, (png, width, height)
            else:  # 6.4 x 3.2 in at 100 dpi: 640 x 320 px, labels or not
                assert 630 <= width <= 650 and 310 <= height <= 330, (png, width, height)
    # the two modes' loss curves coincide: both colours are drawn (not one blend of the two)
    import matplotlib
    import matplotlib.image

    pixels = matplotlib.image.imread(str(reports["sweep"] / "loss.png"))[..., :3]
    for colour in matplotlib.colormaps["tab10"].colors[:2]:
        close = (np.abs(pixels - np.asarray(colour)) < 0.04).all(axis=-1)
        assert close.sum() > 200, colour


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed: apt-get install -y chromium (.ci/run does)"
)
@pytest.mark.parametrize("name", ["sweep", "bench"])
def test_report_html_renders_plots_at_full_size_in_chromium(reports, name, tmp_path):
    shot = tmp_path / f"compare_report_{name}.png"
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1280,2600",
            (reports[name] / "report.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and shot.exists(), done.stderr[-3000:]
    # the largest plot as rendered: its axes as wide as in the PNG (not squeezed by the page)
    png_width, png_height = max(
        plot_frame_px(p) for p in reports[name].glob("*.png") if p.stem != "throughput"
    )
    width, height = plot_frame_px(shot)
    assert width >= 0.75 * png_width and height >= 0.75 * png_height, (width, height, png_width, png_height)
    assert 1.5 <= width / height <= 2.5
    if SCREENSHOT_DIR:
        _save_cropped(shot, Path(SCREENSHOT_DIR) / shot.name)


def _save_cropped(shot: Path, dest: Path) -> None:
    """The screenshot without the empty page below the report, as a docs example."""
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    rows = np.flatnonzero((np.asarray(image) < 250).any(axis=(1, 2)))
    image.crop((0, 0, image.width, int(rows[-1]) + 24)).save(dest, optimize=True)
