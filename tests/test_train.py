"""relax_gdn.train end to end on CPU (gloo): the tiny demo trains (world 1 and world 2 with CP 2),
the loss falls, metrics.jsonl has the required fields, W&B offline writes a run directory and a
W&B failure does not stop training, step 1 with CP 2 (every GDN mode) equals CP 1 (and DP 2) on
the same samples, a resumed run repeats the uninterrupted one, and bad input fails before step 1
with nothing written.

Each case is one job of the session's gloo pools (tests/conftest.py), run when a test first reads
it; the jobs return plain records that the tests assert on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from relax_gdn.config import ConfigError, RunConfig
from tests.distributed import JobResults, job_runtime
from tests.helpers import EQ_TOL
from tests.helpers import GDN_MODES as MODES
from tests.helpers import small_config as _cfg
from tests.helpers import step_fields as _step


def _equality_cfg(cp: int, mode: str = "chunkwise", route: str = "lazy_cache") -> RunConfig:
    return _cfg(
        train__steps=1,
        parallel__cp=cp,
        gdn__cp_mode=mode,
        gdn__route=route,
        recompute__granularity="full" if mode == "all_gather" else "none",
        logging__jsonl=False,
    )


# ---------------------------------------------------------------------------------------------
# inside the spawned processes
# ---------------------------------------------------------------------------------------------


def _demo(tmp: str) -> dict:
    """The demo: 20 steps, JSONL, W&B offline into a temporary directory (no network)."""
    import os

    from relax_gdn.train import run_training

    tmp = Path(tmp)
    os.environ["WANDB_DIR"] = str(tmp / "wandb")
    os.environ["WANDB_SILENT"] = "true"
    (tmp / "wandb").mkdir()
    demo = _cfg(
        train__steps=20,
        optim__warmup_steps=2,
        logging__wandb=dict(
            mode="offline", project="relax-gdn-test", entity=None, group=None, tags=["test"], name=None
        ),
    )
    result = run_training(demo, tmp / "demo", runtime=job_runtime())
    return {
        "demo": result.records,
        "demo_files": sorted(p.name for p in (tmp / "demo").iterdir()),
        "wandb_runs": sorted(str(p.relative_to(tmp)) for p in (tmp / "wandb").rglob("offline-run-*")),
    }


def _wandb_broken(tmp: str) -> dict:
    """W&B init raises: training goes on, one line said once (a log line, on the console and in
    train.log), no Python warning beside it."""
    import logging
    import warnings

    import wandb

    from relax_gdn.train import run_training

    out, lines = {}, []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    def broken_init(*args, **kwargs):
        raise RuntimeError("no W&B today")

    original, wandb.init = wandb.init, broken_init
    collect, train_logger = Collect(), logging.getLogger("relax_gdn.train")
    train_logger.addHandler(collect)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            failing = _cfg(
                train__steps=2,
                logging__wandb=dict(mode="online", project="p", entity=None, group=None, tags=[], name=None),
            )
            out["wandb_broken"] = run_training(
                failing, Path(tmp) / "wandb_broken", runtime=job_runtime()
            ).records
        out["wandb_warnings"] = [str(w.message) for w in caught if "W&B" in str(w.message)]
        out["wandb_lines"] = [line for line in lines if "W&B" in line]
    finally:
        wandb.init = original
        train_logger.removeHandler(collect)
    return out


def _cp1_reference() -> dict:
    """The CP = 1 reference of the equality test."""
    from relax_gdn.train import run_training

    return {"cp1": run_training(_equality_cfg(1), None, runtime=job_runtime()).records}


def _resume(tmp: str) -> dict:
    """4 steps with a checkpoint at 2; then from step 2 to 4."""
    from relax_gdn.train import run_training

    tmp = Path(tmp)
    full = run_training(_cfg(train__steps=4, checkpoint__every_steps=2), tmp / "full", runtime=job_runtime())
    resumed = run_training(
        _cfg(train__steps=4, checkpoint__resume=str(full.checkpoints[0])),
        tmp / "resumed",
        runtime=job_runtime(),
    )
    return {
        "full": full.records,
        "checkpoints": [str(p) for p in full.checkpoints],
        "resumed": resumed.records,
        "resumed_start": resumed.start_step,
    }


def _preempted(tmp: str) -> dict:
    """SIGUSR1 arrives while step 2 is logged: the run checkpoints after step 3 and stops; the
    profiler traces steps 1-2 meanwhile."""
    import os
    import signal

    from relax_gdn.train import loggers as loggers_module
    from relax_gdn.train import run_training

    tmp = Path(tmp)
    original_log = loggers_module.RunLoggers.log

    def log_then_signal(self, record):
        original_log(self, record)
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    loggers_module.RunLoggers.log = log_then_signal
    try:
        preempted = run_training(
            _cfg(train__steps=6, logging__profile_steps=[1, 2]), tmp / "preempted", runtime=job_runtime()
        )
    finally:
        loggers_module.RunLoggers.log = original_log
    return {
        "preempted": (
            preempted.stop.step,
            [Path(p).name for p in preempted.checkpoints],
            len(preempted.records),
        ),
        "traces": sorted(p.name for p in (tmp / "preempted" / "traces").iterdir()),
    }


def _two_process_step(case: str) -> dict:
    """Step 1 on 2 processes: CP 2 in each GDN mode (and chunkwise with prebuilt routes), CP 1 (DP
    2), or dynamic CP <= 2 (samples up to 256 tokens on one rank, longer ones on both)."""
    from relax_gdn.train import run_training

    if case in MODES:
        cfg = _equality_cfg(2, case)
    elif case == "chunkwise_prebuild":
        cfg = _equality_cfg(2, "chunkwise", "prebuild")
    elif case == "dp2":
        cfg = _equality_cfg(1)
    else:
        assert case == "dynamic", case
        cfg = _cfg(
            train__steps=1,
            parallel__cp=2,
            train__max_tokens_per_gpu=256,
            parallel__dynamic_cp=dict(enabled=True, max_cp=2),
            logging__jsonl=False,
        )
    return {case: run_training(cfg, None, runtime=job_runtime()).records}


def _cp2_demo(tmp: str) -> dict:
    import torch.distributed as dist

    from relax_gdn.train import run_training

    run_dir = Path(tmp) / "cp2_demo" if dist.get_rank() == 0 else None
    return {
        "cp2_demo": run_training(_cfg(train__steps=3, parallel__cp=2), run_dir, runtime=job_runtime()).records
    }


def _step_totals() -> dict:
    """The step's one all-reduce: losses summed (/ tp), a flag raised on rank 1 raised on both ranks."""
    import torch
    import torch.distributed as dist

    from relax_gdn.train.step import StepFlag, all_reduce_step

    loss = torch.tensor(float(dist.get_rank() + 1))
    totals = [
        all_reduce_step(loss, {StepFlag.STOP_REQUESTED} if dist.get_rank() == 1 else set(), tp=1),
        all_reduce_step(loss, set(), tp=2),
    ]
    return {"step_totals": [(t.loss_sum, sorted(flag.name for flag in t.flags)) for t in totals]}


SINGLE_PROCESS_JOBS = {
    _demo: ("demo", "demo_files", "wandb_runs"),
    _wandb_broken: ("wandb_broken", "wandb_warnings", "wandb_lines"),
    _resume: ("full", "checkpoints", "resumed", "resumed_start"),
    _preempted: ("preempted", "traces"),
}
TWO_PROCESS_CASES = (*MODES, "chunkwise_prebuild", "dp2", "dynamic")


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single(gloo_once, tmp_path_factory):
    """(directory, the single-process cases by key): each job runs when a test first reads one of its keys."""
    tmp = tmp_path_factory.mktemp("single")
    jobs = {key: (job, 1, str(tmp)) for job, keys in SINGLE_PROCESS_JOBS.items() for key in keys}
    return tmp, JobResults(gloo_once, {**jobs, "cp1": (_cp1_reference, 1)})


@pytest.fixture(scope="module")
def pair(gloo_once, tmp_path_factory):
    """(directory, per rank: the two-process cases by key)."""
    tmp = tmp_path_factory.mktemp("pair")
    jobs = {case: (_two_process_step, 2, case) for case in TWO_PROCESS_CASES}
    jobs.update(cp2_demo=(_cp2_demo, 2, str(tmp)), step_totals=(_step_totals, 2))
    return tmp, [JobResults(gloo_once, jobs, rank) for rank in range(2)]


def test_demo_loss_is_finite_and_falls(single):
    records = single[1]["demo"]
    assert [r["step"] for r in records] == list(range(1, 21))
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:3]) / 3, losses
    assert all(r["grad_norm"] is not None and math.isfinite(r["grad_norm"]) for r in records)
    # warm-up then cosine down to min_lr at the last step
    lrs = [r["lr"] for r in records]
    assert lrs[0] < lrs[1] and lrs[-1] == pytest.approx(3e-4) and max(lrs) == pytest.approx(3e-3)


def test_jsonl_and_config_written_by_the_run(single):
    tmp, out = single
    assert out["demo_files"] == ["config.yaml", "metrics.jsonl"]
    lines = (tmp / "demo" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 20
    for line, record in zip(lines, out["demo"]):
        parsed = json.loads(line)
        for key in ("step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "mfu"):
            assert key in parsed, key
        assert parsed["mfu"] is None  # no known peak on CPU
        assert parsed["tokens"] > 0 and parsed["tokens_per_s"] > 0 and parsed["tflops_per_gpu"] > 0
        assert parsed["loss"] == record["loss"]
    from relax_gdn.config.hydra_io import load_run_config

    assert load_run_config(tmp / "demo" / "config.yaml").train.steps == 20


def test_wandb_offline_run_holds_every_step_and_the_run_identity(single):
    from tests.wandb_records import offline_run_records

    tmp, out = single
    (run_dir,) = out["wandb_runs"]  # one offline-run-* directory under WANDB_DIR
    records = offline_run_records(tmp / run_dir)
    history = records["history"]
    assert len(history) == 20
    for row, logged in zip(history, out["demo"]):
        for key in ("loss", "grad_norm", "lr", "tokens", "tokens_per_s", "tflops_per_gpu", "step_time_s"):
            assert f"train/{key}" in row, (key, sorted(row))
        assert json.loads(row["_step"]) == logged["step"]
        assert json.loads(row["train/loss"]) == pytest.approx(logged["loss"], rel=1e-12)
    run = records["run"]
    assert run.project == "relax-gdn-test" and {"test", "mode:chunkwise", "route:lazy_cache"} <= set(
        run.tags
    ), run.tags
    assert run.display_name.startswith("qwen3_5_tiny-chunkwise-lazy_cache-tp1-cp1")
    config_keys = {item.key for item in run.config.update}
    assert {"model", "gdn", "parallel", "train", "optim", "derived"} <= config_keys, config_keys


def test_wandb_failure_does_not_stop_training(single):
    out = single[1]
    assert [r["step"] for r in out["wandb_broken"]] == [1, 2]
    assert out["wandb_warnings"] == [] and len(out["wandb_lines"]) == 1, out
    assert out["wandb_lines"][0] == "W&B init failed (RuntimeError: no W&B today); continuing without W&B"


def test_two_processes_cp2_demo_trains(pair):
    tmp, ranks = pair
    for out in ranks:
        losses = [r["loss"] for r in out["cp2_demo"]]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert ranks[0]["cp2_demo"] == ranks[1]["cp2_demo"] or all(
        a["loss"] == b["loss"] for a, b in zip(ranks[0]["cp2_demo"], ranks[1]["cp2_demo"])
    )
    assert len((tmp / "cp2_demo" / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("case", TWO_PROCESS_CASES)
def test_step1_cp2_equals_cp1(single, pair, case):
    reference = _step(single[1]["cp1"][0])
    for rank, out in enumerate(pair[1]):
        got = _step(out[case][0])
        assert got["tokens"] == reference["tokens"] and got["loss_tokens"] == reference["loss_tokens"]
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(reference[key], rel=EQ_TOL), (case, rank, key, got, reference)


def test_step_all_reduce_sums_the_loss_and_gives_every_rank_a_flag_any_rank_raised(pair):
    for out in pair[1]:
        assert out["step_totals"] == [(3.0, ["STOP_REQUESTED"]), (1.5, [])]


def test_dynamic_cp_uses_both_cp_sizes(pair):
    for out in pair[1]:
        sizes = out["dynamic"][0]["cp_sizes"]
        assert set(sizes) == {"1", "2"} and all(n > 0 for n in sizes.values()), sizes


def test_sigusr1_checkpoints_and_stops_after_the_current_step(single):
    assert single[1]["preempted"] == (3, ["step_000003"], 3)


def test_profile_window_writes_a_trace_per_rank(single):
    assert single[1]["traces"] == ["rank0_steps1-2.json"]


def test_resume_repeats_the_uninterrupted_run(single):
    out = single[1]
    assert len(out["checkpoints"]) == 2 and out["checkpoints"][0].endswith("step_000002")
    assert out["resumed_start"] == 2
    assert [r["step"] for r in out["resumed"]] == [3, 4]
    for a, b in zip(out["full"][2:], out["resumed"]):
        assert (a["loss"], a["grad_norm"], a["lr"], a["tokens"]) == (
            b["loss"],
            b["grad_norm"],
            b["lr"],
            b["tokens"],
        )


# --------------------------------------------------------------------- bad input (no process group)


def test_missing_data_file_fails_before_anything_is_written(tmp_path):
    from relax_gdn.runtime import Runtime
    from relax_gdn.train import run_training

    run_dir = tmp_path / "run"
    cfg = _cfg(data__source="jsonl", data__path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="data.path="):  # before the Runtime (never installed) is asked
        run_training(cfg, run_dir, runtime=Runtime())
    assert not run_dir.exists()


def test_unusable_data_file_fails_before_anything_is_written(tmp_path, runtime):
    from relax_gdn.train import run_training

    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n{"question": "no prompt field"}\n')
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="no usable record"):
        run_training(_cfg(data__source="jsonl", data__path=str(bad)), run_dir, runtime=runtime)
    assert not run_dir.exists()


def test_impossible_config_fails_before_anything_is_written(tmp_path):
    from relax_gdn.runtime import Runtime
    from relax_gdn.train import run_training

    run_dir = tmp_path / "run"
    never_installed = Runtime()  # the config is refused before the Runtime is asked for anything
    with pytest.raises(ConfigError, match=r"world size 1 is not divisible by parallel.tp x parallel.cp"):
        run_training(_cfg(parallel__cp=2), run_dir, runtime=never_installed)
    with pytest.raises(ConfigError, match="parallel.sp=true needs parallel.tp > 1") as info:
        run_training(
            _cfg(parallel__sp=True, train__global_batch_size=7, data__num_samples=3),
            run_dir,
            runtime=never_installed,
        )
    assert "data.num_samples=3 is below train.global_batch_size=7" in str(info.value)  # all at once
    assert not run_dir.exists()


# --------------------------------------------------------------------- names, tags, W&B log failure


def test_run_name_and_tags_say_what_is_compared():
    from relax_gdn.train.loggers import default_run_name, run_tags

    cfg = _cfg(gdn__cp_mode="headwise", parallel__cp=2, gdn__route="prebuild")
    assert default_run_name(cfg) == "qwen3_5_tiny-headwise-prebuild-tp1-cp2-rcnone-mt1024"
    assert {"mode:headwise", "route:prebuild", "cp:2", "tp:1", "model:qwen3_5_tiny", "recompute:none"} <= set(
        run_tags(cfg)
    )
    assert default_run_name(_cfg(run_name="mine")) == "mine"


def test_wandb_log_failure_warns_once_and_training_logging_goes_on(tmp_path, monkeypatch, caplog):
    import wandb

    from relax_gdn.train.loggers import RunLoggers

    class BrokenRun:
        dir = str(tmp_path)

        def log(self, *args, **kwargs):
            raise ConnectionError("W&B is down")

        def finish(self):
            raise ConnectionError("W&B is down")

    seen = {}
    monkeypatch.setattr(wandb, "init", lambda **kwargs: seen.update(kwargs) or BrokenRun())
    cfg = _cfg(
        logging__wandb=dict(mode="offline", project="p", entity=None, group=None, tags=["x"], name=None)
    )
    loggers = RunLoggers.create(cfg, tmp_path, is_rank0=True, config_dict=cfg.to_dict())
    record = {
        "step": 1,
        "loss": 1.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens": 10,
        "tokens_per_s": 5.0,
        "mfu": None,
        "tflops_per_gpu": 0.1,
        "step_time_s": 2.0,
    }
    with caplog.at_level("WARNING", logger="relax_gdn.train"):
        loggers.log(record)
        loggers.log({**record, "step": 2})
        loggers.close()
    assert [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()] == [
        "W&B log failed (ConnectionError: W&B is down); continuing without W&B"
    ]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # the other sinks went on
    assert (
        seen["mode"] == "offline" and seen["config"]["gdn"]["cp_mode"] == "chunkwise" and "x" in seen["tags"]
    )


def test_a_sample_too_long_for_any_micro_batch_fails_before_step_1():
    from relax_gdn.data import Sample
    from relax_gdn.train.run_data import check_samples_fit

    cfg = _cfg(parallel__cp=2, train__max_tokens_per_gpu=256)
    check_samples_fit([Sample([1] * 512, [True] * 512, 0)], cfg)  # 512 = 256 x 2: fits exactly
    with pytest.raises(ValueError, match=r"sample 7: 513 tokens.*data.max_sample_tokens=512"):
        check_samples_fit([Sample([1] * 513, [True] * 513, 7)], cfg)


def test_console_line_and_run_summary_show_micro_batches_per_cp_size():
    from relax_gdn.run_stats import cp_size_histogram
    from relax_gdn.train.console import step_line
    from relax_gdn.train.metrics import format_cp_sizes

    records = [
        {"step": 1, "cp_sizes": {"2": 2, "1": 4}},
        {"step": 2, "cp_sizes": {"4": 1, "2": 3}},
        {"step": 3},
    ]
    assert cp_size_histogram(records) == {"1": 4, "2": 5, "4": 1}
    assert format_cp_sizes(cp_size_histogram(records)) == "CP1 x 4, CP2 x 5, CP4 x 1"
    assert cp_size_histogram([{"step": 1}]) == {}  # static CP: no histogram
    line = dict(
        step=1,
        loss=2.0,
        grad_norm=1.0,
        lr=1e-5,
        tokens_per_s=10.0,
        tflops_per_gpu=1.0,
        mfu=None,
        step_time_s=0.5,
    )
    assert step_line({**line, "cp_sizes": {"1": 4, "2": 2}}, total=2).endswith("[CP1 x 4, CP2 x 2]")
    assert "CP" not in step_line(line, total=2)
    assert " TFLOP/s/process " in step_line(line, total=2)  # a CPU record (no GPU memory): no "/gpu"
    assert " TFLOP/s/gpu " in step_line({**line, "peak_mem_gb": 3.5}, total=2)
