"""relax_gdn.compare on real training runs (one process, CPU): identical-seed repeats are within
noise, a different learning rate differs on the loss curve, a route change (same numerics) does
not; the reports hold the runs' numbers; W&B offline runs carry the end-of-run summary. The
statistics, loaders and W&B report spec are also tested on hand-made records."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from relax_gdn.compare import compare_runs, find_runs, run_summary, warmup_steps
from relax_gdn.compare.report import markdown
from relax_gdn.compare.runs import Run, load_bench_json, records_from_wandb_history, run_from_wandb
from relax_gdn.compare.stats import median_ci, steady_records
from tests.distributed import job_runtime
from tests.helpers import small_config as _cfg

STEPS = 8


def _runs(tmp: str) -> dict:
    import os

    import torch

    from relax_gdn.train import run_training

    torch.set_num_threads(1)
    tmp = Path(tmp)
    os.environ["WANDB_DIR"] = str(tmp / "wandb")
    os.environ["WANDB_SILENT"] = "true"
    (tmp / "wandb").mkdir()
    wandb = dict(
        mode="offline",
        project="relax-gdn-test",
        entity=None,
        group="compare-test",
        tags=[],
        name=None,
        job_type="optim.lr=0.003",
    )
    base = dict(
        train__steps=STEPS, train__global_batch_size=4, data__synthetic_max_steps=1, data__num_samples=64
    )
    runs = {
        "a1": _cfg(**base, logging__wandb=wandb),
        "a2": _cfg(**base),  # identical seed: an A/A repeat of a1
        "route": _cfg(**base, gdn__route="prebuild"),  # same numerics on one process
        "lr": _cfg(**base, optim__lr=1e-2),
    }
    for name, cfg in runs.items():
        run_training(cfg, tmp / "runs" / name, runtime=job_runtime())
    return {"wandb_runs": sorted(str(p) for p in (tmp / "wandb").rglob("offline-run-*"))}


@pytest.fixture(scope="module")
def trained(gloo, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    out = gloo(_runs, 1, str(tmp))[0]
    return tmp, out


def _by_label(summary: dict, fragment: str) -> dict:
    (match,) = [c for c in summary["comparisons"] if fragment in c["variant"]]
    return match


def test_identical_seeds_are_within_noise_and_a_different_lr_differs(trained):
    tmp, _ = trained
    runs = find_runs([tmp / "runs"])
    assert sorted(r.name for r in runs) == ["a1", "a2", "lr", "route"]
    summary = compare_runs(runs, ["gdn.route=lazy_cache", "optim.lr=0.003"])
    # optim.min_lr resolves to optim.lr / 10 in the saved config: it moves with the learning rate
    assert summary["varying_keys"] == ["gdn.route", "optim.lr", "optim.min_lr"]
    baseline = next(v for v in summary["variants"] if v["baseline"])
    assert sorted(r["name"] for r in baseline["runs"]) == ["a1", "a2"]  # the A/A pair is one variant
    (aa,) = summary["noise"]["variants"]
    assert aa["loss_max_spread"] == 0.0  # same seed, one CPU thread: bit-identical curves
    lr = _by_label(summary, "optim.lr=0.01")
    assert lr["loss"]["verdict"] == "differs", lr["loss"]
    assert lr["loss"]["outside"] >= STEPS // 2 and lr["loss"]["max_abs_diff"] > 1e-3
    route = _by_label(summary, "gdn.route=prebuild")
    assert route["loss"]["verdict"] == "within noise", route["loss"]
    assert route["grad_norm"]["verdict"] == "within noise", route["grad_norm"]


def test_reports_hold_the_runs_numbers(trained):
    tmp, _ = trained
    out = tmp / "report"
    from relax_gdn.compare.__main__ import main

    assert (
        main(
            [
                str(tmp / "runs"),
                "--out",
                str(out),
                "--baseline",
                "optim.lr=0.003",
                "--baseline",
                "gdn.route=lazy_cache",
            ]
        )
        == 0
    )
    for name in (
        "summary.md",
        "summary.json",
        "report.html",
        "loss.png",
        "grad_norm.png",
        "tokens_per_s.png",
        "throughput.png",
    ):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "mfu.png").exists()  # no MFU on CPU: no empty plot
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp / "runs" / "lr" / "metrics.jsonl").read_text().splitlines()]
    steady = steady_records(records)
    (lr,) = [v for v in summary["variants"] if v["config"]["optim.lr"] == 0.01]
    assert lr["stats"]["tokens_per_s"]["median"] == pytest.approx(
        np.median([r["tokens_per_s"] for r in steady])
    )
    assert lr["stats"]["final_loss"]["median"] == pytest.approx(records[-1]["loss"])
    assert lr["runs"][0]["steady_steps"] == STEPS - warmup_steps(STEPS)
    md = (out / "summary.md").read_text()
    assert md.startswith("| variant | runs |") and "optim.lr=0.01" in md and "(baseline)" in md
    assert "loss curve **differs**" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4 and "optim.lr=0.01" in html


def test_unknown_baseline_is_one_message_and_exit_2(trained, capsys):
    tmp, _ = trained
    from relax_gdn.compare.__main__ import main

    assert main([str(tmp / "runs"), "--out", str(tmp / "x"), "--baseline", "gdn.cp_mode=nope"]) == 2
    err = capsys.readouterr().err
    assert "--baseline gdn.cp_mode=nope matches no variant" in err and "Traceback" not in err


def test_wandb_offline_run_holds_the_summary(trained):
    from tests.wandb_records import offline_run_records

    tmp, out = trained
    (run_dir,) = out["wandb_runs"]
    records = offline_run_records(run_dir)
    summary = {k: json.loads(v) for k, v in records["summary"].items()}
    for key in (
        "steady/tokens_per_s",
        "steady/tokens_per_s_per_gpu",
        "steady/step_time_s",
        "total_tokens",
        "final_loss",
        "mean_loss",
        "steady/steps",
    ):
        assert key in summary, (key, sorted(summary))
    jsonl = [json.loads(line) for line in (tmp / "runs" / "a1" / "metrics.jsonl").read_text().splitlines()]
    assert summary["total_tokens"] == sum(r["tokens"] for r in jsonl)
    assert summary["final_loss"] == pytest.approx(jsonl[-1]["loss"])
    assert summary["steady/tokens_per_s"] == pytest.approx(
        np.median([r["tokens_per_s"] for r in steady_records(jsonl)])
    )
    run = records["run"]
    assert run.run_group == "compare-test" and run.job_type == "optim.lr=0.003"


# ---- pure parts ----------------------------------------------------------------------------------


def test_warmup_rule():
    assert warmup_steps(150) == 15 and warmup_steps(30) == 3 and warmup_steps(10) == 3
    assert warmup_steps(4) == 2 and warmup_steps(2) == 1  # too short: the second half stays


def test_median_interval_contains_the_median_and_narrows_with_more_data():
    rng = np.random.default_rng(1)
    small, large = rng.normal(100, 5, 10).tolist(), rng.normal(100, 5, 1000).tolist()
    a, b = median_ci(small), median_ci(large)
    assert a["lo"] <= a["median"] <= a["hi"] and b["lo"] <= b["median"] <= b["hi"]
    assert (b["hi"] - b["lo"]) < (a["hi"] - a["lo"])
    assert median_ci([3.0]) == {"median": 3.0, "lo": 3.0, "hi": 3.0, "n": 1} and median_ci([]) is None


def _records(tps: float, n: int = 20, loss0: float = 5.0, cp_sizes=None) -> list[dict]:
    return [
        {
            "step": s,
            "loss": loss0 - 0.1 * s,
            "grad_norm": 1.0,
            "tokens": 100,
            "tokens_per_s": tps + s % 3,
            "mfu": 0.3,
            "step_time_s": 0.5,
            "peak_mem_gb": 10.0 + s,
            "world_size": 2,
            **({"cp_sizes": cp_sizes} if cp_sizes else {}),
        }
        for s in range(1, n + 1)
    ]


def test_seed_repeats_are_one_variant_and_throughput_verdicts():
    def run(name, mode, seed, tps):
        return Run(
            name,
            name,
            {"gdn.cp_mode": mode, "train.seed": seed, "logging.wandb.job_type": name},
            _records(tps),
        )

    runs = [run("h1", "headwise", 1, 1000), run("h2", "headwise", 2, 1010), run("c1", "chunkwise", 1, 1500)]
    summary = compare_runs(runs, ["gdn.cp_mode=headwise"])
    assert summary["varying_keys"] == ["gdn.cp_mode"]  # seed = repeat; logging.* never a variant
    (chunkwise,) = summary["comparisons"]
    assert chunkwise["throughput"]["verdict"] == "differs"
    assert chunkwise["throughput"]["ratio"] == pytest.approx(1501 / 1006, rel=1e-3)
    close = compare_runs(runs[:2] + [run("c2", "chunkwise", 1, 1004)], ["gdn.cp_mode=headwise"])
    assert close["comparisons"][0]["throughput"]["verdict"] == "within noise"
    alone = compare_runs([runs[0], runs[2]])
    assert alone["comparisons"][0]["throughput"]["verdict"] == "no A/A"


def test_labels_name_each_differing_key_once_as_an_override_writes_it():
    def run(name, **config):
        return Run(
            name,
            name,
            {"train.steps": 4, **{k.replace("__", "."): v for k, v in config.items()}},
            _records(100),
        )

    runs = [
        run(
            "a",
            model__fused_norms=False,
            model__fused_swiglu=False,
            data__max_sample_tokens=None,
            gdn__route="prebuild",
            x__alpha=1,
            x__beta=1,
            optim__min_lr=0.1 * 0.003,
        ),
        run(
            "b",
            model__fused_norms=True,
            model__fused_swiglu=True,
            data__max_sample_tokens=512,
            x__alpha=2,
            x__beta=2,
        ),
    ]
    summary = compare_runs(runs)
    assert [v["label"] for v in summary["variants"]] == [
        "data.max_sample_tokens=null, gdn.route=prebuild, model.fused_*=false, optim.min_lr=0.0003, "
        "x.{alpha,beta}=1",
        "data.max_sample_tokens=512, gdn.route=(unset), model.fused_*=true, optim.min_lr=(unset), "
        "x.{alpha,beta}=2",
    ]
    assert compare_runs(runs, ["optim.min_lr=0.0003"])["baseline"].startswith("data.max_sample_tokens=null")
    assert summary["variants"][1]["config"] == {
        "data.max_sample_tokens": 512,
        "model.fused_norms": True,
        "model.fused_swiglu": True,
        "x.alpha": 2,
        "x.beta": 2,
    }
    assert compare_runs(runs, ["data.max_sample_tokens=null"])["baseline"].startswith(
        "data.max_sample_tokens=null"
    )
    (cmp,) = summary["comparisons"]  # one run each: no A/A, and no noise figure in the verdicts
    assert cmp["loss"]["verdict"] == "no A/A" and cmp["loss"]["rms_noise"] is None
    assert cmp["throughput"]["noise"] is None


def _noisy_curve(rng, loss, steps: int = 150) -> list[dict]:
    """``steps`` step records: ``loss(step)``, a gradient norm of 1 +- 0.1 drawn after it from
    ``rng``, a constant throughput."""
    return [
        {
            "step": s,
            "loss": loss(s),
            "grad_norm": 1.0 + rng.normal(0, 0.1),
            "tokens": 100,
            "tokens_per_s": 1000.0,
            "world_size": 1,
        }
        for s in range(1, steps + 1)
    ]


def test_curve_verdict_weighs_the_whole_curve_against_the_seed_noise():
    """Four runs drawn from one noisy curve (two seeds per variant) are within noise even though
    at some steps the two repeats of a variant cross and their spread is ~0; the same curve shifted
    by three times the seed noise differs."""
    rng = np.random.default_rng(0)

    def run(name, variant, seed, shift=0.0):
        records = _noisy_curve(rng, lambda s: 3.0 / s**0.3 + shift + rng.normal(0, 0.05))
        return Run(name, name, {"recompute.granularity": variant, "train.seed": seed}, records)

    same = [run("f1", "full", 1), run("f2", "full", 2), run("s1", "selective", 1), run("s2", "selective", 2)]
    (cmp,) = compare_runs(same, ["recompute.granularity=full"])["comparisons"]
    assert cmp["loss"]["verdict"] == "within noise" and 0.5 < cmp["loss"]["noise_ratio"] < 1.5, cmp["loss"]
    assert cmp["loss"]["outside"] > 0  # single steps outside 2 sigma happen: they are not a verdict
    shifted = same[:2] + [run("s1", "selective", 1, shift=0.15), run("s2", "selective", 2, shift=0.15)]
    (cmp,) = compare_runs(shifted, ["recompute.granularity=full"])["comparisons"]
    assert cmp["loss"]["verdict"] == "differs" and cmp["loss"]["noise_ratio"] > 2, cmp["loss"]
    assert cmp["grad_norm"]["verdict"] == "within noise"


def test_run_summary_holds_cp_size_histogram_and_per_gpu_throughput():
    records = _records(1000, cp_sizes={"1": 2, "2": 1})
    summary = run_summary(records)
    assert summary["cp_sizes/1"] == 40 and summary["cp_sizes/2"] == 20
    assert summary["steady/tokens_per_s_per_gpu"] == pytest.approx(summary["steady/tokens_per_s"] / 2)
    assert (
        summary["total_tokens"] == 2000 and summary["steady/steps"] == 17 and summary["peak_mem_gb"] == 30.0
    )


def test_wandb_runs_parse_from_public_api_objects():
    rows = [
        {"_step": 1, "train/loss": 3.0, "train/tokens_per_s": 10.0, "train/world_size": 2},
        {"_step": 2, "train/loss": 2.5, "train/tokens_per_s": 12.0, "train/mfu": float("nan")},
        {"_step": 2, "system/gpu": 1.0},
    ]  # a system row: no train/loss
    fake = SimpleNamespace(
        id="abc",
        name="run-a",
        config={"gdn": {"cp_mode": "chunkwise"}, "_wandb": {}},
        scan_history=lambda: iter(rows),
    )
    run = run_from_wandb(fake, "ent/proj")
    assert run.source == "wandb:ent/proj/abc" and run.config == {"gdn.cp_mode": "chunkwise"}
    assert run.records == records_from_wandb_history(rows)
    assert [r["step"] for r in run.records] == [1, 2] and "mfu" not in run.records[1]
    assert run.world_size == 2


def test_benchmark_json_variants(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps(
            {
                "variants": [
                    {
                        "name": "headwise",
                        "config": {"gdn": {"cp_mode": "headwise"}},
                        "records": _records(100),
                    },
                    {
                        "name": "chunkwise",
                        "config": {"gdn.cp_mode": "chunkwise"},
                        "summary": {},
                        "records": _records(200)
                        + [{"step": 21, "loss": 1.0, "tokens_per_s": 1.0, "profiled": True}],
                    },
                ],
                "meta": {},
            }
        )
    )
    runs = load_bench_json(path)
    assert [r.config["gdn.cp_mode"] for r in runs] == ["headwise", "chunkwise"]
    assert "bench.variant" not in runs[0].config  # a config tells the variants apart, not the name
    assert len(runs[1].records) == 20  # the profiled step is left out
    summary = compare_runs(runs)
    assert summary["variants"][1]["ratio_to_baseline"]["tokens_per_s"] == pytest.approx(201 / 101, rel=1e-3)
    path.write_text("[]")
    with pytest.raises(ValueError, match="expected"):
        load_bench_json(path)


def test_benchmark_json_fills_keys_a_variant_left_alone(tmp_path):
    """With the start values the file records (meta.base_config), else the recipe's defaults:
    never an empty value."""
    variants = [
        {"name": "mt=4096", "config": {"train.max_tokens_per_gpu": 4096}, "records": _records(100)},
        {"name": "fused=off", "config": {"model": {"fused_norms": False}}, "records": _records(90)},
        {"name": "as started", "config": {}, "records": _records(95)},
    ]
    path = tmp_path / "e2e.json"
    path.write_text(
        json.dumps({"meta": {"base_config": {"train": {"max_tokens_per_gpu": 8192}}}, "variants": variants})
    )
    labels = [v["label"] for v in compare_runs(load_bench_json(path))["variants"]]
    assert labels == [
        "model.fused_norms=true, train.max_tokens_per_gpu=4096",
        "model.fused_norms=false, train.max_tokens_per_gpu=8192",
        "model.fused_norms=true, train.max_tokens_per_gpu=8192",
    ]
    path.write_text(json.dumps({"variants": variants}))
    assert compare_runs(load_bench_json(path))["variants"][1]["label"] == (
        "model.fused_norms=false, train.max_tokens_per_gpu=2048"
    )  # relax_gdn.config.schema's default


def test_wandb_report_spec_panels_grouping_and_filter():
    from relax_gdn.compare.wandb_report import build_report, report_spec

    spec = report_spec("ent/proj", "sweep-x")
    assert spec["runset"] == {
        "name": "sweep-x",
        "filters": "Group = 'sweep-x'",
        "groupby": ["config.gdn.cp_mode"],
    }
    lines = {p["y"][0] for p in spec["panels"] if p["kind"] == "line"}
    bars = {p["metrics"][0] for p in spec["panels"] if p["kind"] == "bar"}
    assert {"train/loss", "train/grad_norm", "train/tokens_per_s", "train/mfu"} <= lines
    assert {"steady/tokens_per_s", "steady/tokens_per_s_per_gpu", "steady/mfu", "peak_mem_gb"} <= bars
    assert bars <= set(run_summary(_records(1000)))  # every bar is a summary key the runs write
    report = build_report(spec)  # wandb_workspaces objects, no server
    grid = report.blocks[-1]
    assert len(grid.panels) == len(spec["panels"]) and grid.runsets[0].groupby == ["config.gdn.cp_mode"]
    with pytest.raises(ValueError, match="ENTITY/PROJECT"):
        report_spec("proj", "g")


def test_same_seed_pairs_find_a_shift_the_seed_noise_hides():
    """Same-seed runs share their batches, so most of the seed-to-seed noise cancels in their
    difference: a shift of 0.03 against a seed noise of 0.05 is "within noise" for the A/A verdict
    and "differs" by seed; no shift is "within noise"; a single pair is measured but
    not judged, nor are pairs too short for the bootstrap; runs without a common seed give no pairs."""
    rng = np.random.default_rng(1)
    steps = 150
    seed_noise = {seed: rng.normal(0, 0.05, steps) for seed in (1, 2, 3)}

    def run(name, recipe, seed, shift=0.0):
        def loss(s):
            return 3.0 / s**0.3 + seed_noise[seed][s - 1] + shift + rng.normal(0, 0.005)

        records = _noisy_curve(rng, loss, steps)
        return Run(name, name, {"model.fp8.recipe": recipe, "train.seed": seed}, records)

    base = [run("b1", None, 1), run("b2", None, 2)]
    shifted = compare_runs(base + [run("t1", "tensorwise", 1, 0.03), run("t2", "tensorwise", 2, 0.03)])
    (cmp,) = shifted["comparisons"]
    assert cmp["loss"]["verdict"] == "within noise", cmp["loss"]
    paired = cmp["paired"]["loss"]
    assert paired["verdict"] == "differs" and paired["pairs"] == 2, paired
    assert paired["lo"] < 0.03 < paired["hi"] and paired["steps"] == 2 * (steps - warmup_steps(steps))
    assert [p["seed"] for p in paired["per_pair"]] == [1, 2]
    assert cmp["paired"]["grad_norm"]["verdict"] == "within noise"
    text = markdown(shifted)
    assert "loss curve, same-seed pairs: **differs** (mean diff +0.0" in text and "by seed 1: +0.0" in text

    (same,) = compare_runs(base + [run("t1", "tensorwise", 1), run("t2", "tensorwise", 2)])["comparisons"]
    assert same["paired"]["loss"]["verdict"] == "within noise", same["paired"]["loss"]
    (one,) = compare_runs(base + [run("t1", "tensorwise", 1, 0.03)])["comparisons"]
    assert one["paired"]["loss"]["verdict"] == "one pair" and one["paired"]["loss"]["pairs"] == 1
    (none,) = compare_runs(base + [run("t3", "tensorwise", 3, 0.03)])["comparisons"]
    assert none["paired"]["loss"] == {"verdict": "no pairs", "pairs": 0}
    assert "same-seed" not in markdown(compare_runs(base + [run("t3", "tensorwise", 3)]))

    def first_steps(r, n):
        return Run(r.name, r.source, r.config, r.records[:n])

    short = [
        first_steps(r, 12)
        for r in base + [run("t1", "tensorwise", 1, 0.03), run("t2", "tensorwise", 2, 0.03)]
    ]
    (few,) = compare_runs(short)["comparisons"]
    assert few["paired"]["loss"]["verdict"] == "too few steps", few["paired"]["loss"]
    assert "same-seed pairs: **too few steps**" in markdown(compare_runs(short))


def test_a_runs_metrics_file_stands_for_its_directory(tmp_path):
    import yaml

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"seed": 1}}))
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "loss": 3.0, "tokens": 10, "tokens_per_s": 5.0}) + "\n" for s in (1, 2)
        )
    )
    (by_file,), (by_dir,) = find_runs([run / "metrics.jsonl"]), find_runs([run])
    assert by_file.config == by_dir.config and by_file.records == by_dir.records
