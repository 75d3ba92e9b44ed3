"""Runs that fail safely (CPU): divergence, dead ranks, hangs, rank-agreed decisions, signals during a
save, Ctrl-C, save failures that keep their cause.

* A diverged run (the issue's command, ``optim.lr=1e4``) stops at its first non-finite step with
  exit 3 and one message; only checkpoints from before it are on disk, ``latest`` names the last
  good one, ``metrics.jsonl`` marks the step (``"nonfinite": true``, ``"loss": "nan"``). With
  ``train.on_nonfinite=skip`` a non-finite step's update is not applied and the run goes on, until
  ``train.max_nonfinite_steps`` in a row stop it.
* ``kill -9`` of one torchrun worker ends the job naming the dead rank, and nothing of the job
  outlives it; the checkpoint writer's helper dies with its rank and ignores the job's signals.
* Ranks that list ``checkpoint.dir`` differently load the step rank 0 chose; a data error on one
  rank is one message from rank 0, with no wait for torchrun.
* A rank stuck in a collective: every rank writes its stacks to ``<run dir>/hang/`` and exits 124.
* SIGTERM to the process group or SIGUSR1 to the rank during a save: the save completes, the run
  exits 75 naming the signal, ``resume=auto`` continues. Ctrl-C: the step finishes, a checkpoint is
  saved, exit 130 with one line; a second Ctrl-C stops at once, saying what is saved and what is
  not; the same under a bare torchrun (relax_gdn.launch: tests/test_launch_ctrl_c.py).
* A save the file system refuses (read-only, full) is one message, exit 2, its cause chained; any
  other failure in a save keeps its traceback, exit 1.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from relax_gdn.errors import (
    DIVERGED_EXIT_CODE,
    EXIT_CODE_FILE_ENV,
    HANG_EXIT_CODE,
    INTERRUPTED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
)
from tests.distributed import child_env, job_runtime, run_distributed
from tests.helpers import THIRD_PARTY_NOTICE
from tests.helpers import small_config as _cfg
from tests.processes import alive, descendants, output_lines, start_as_a_job, wait_until

ROOT = Path(__file__).resolve().parents[1]
SMALL = (
    "train.global_batch_size=4",
    "data.num_samples=64",
    "data.synthetic_max_steps=1",
    "optim.warmup_steps=1",
    "optim.decay_steps=40",
)
RUN_LIMIT_S = 600  # one train.py or torchrun job on a loaded 2-core machine


def _command(tmp_path: Path, *overrides: str, nproc: int = 0, faults: bool = False) -> list[str]:
    """``python train.py`` (or the fault-injecting wrapper), under torchrun with ``nproc`` workers."""
    script = ROOT / "tests" / "train_with_faults.py" if faults else ROOT / "train.py"
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [*launcher, str(script), f"hydra.run.dir={tmp_path / 'run'}", *overrides]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return child_env({EXIT_CODE_FILE_ENV: str(tmp_path / "exit_code"), **extra})


def _start(command: list[str], tmp_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """In a session of its own: its process group is the job's, as a terminal's or SLURM's is."""
    return start_as_a_job(command, tmp_path, env)


def _recorded_exit_code(tmp_path: Path) -> int | None:
    path = tmp_path / "exit_code"
    return int(path.read_text()) if path.exists() else None


def _strict_json(line: str) -> dict:
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON: {line}")

    return json.loads(line, parse_constant=refuse)


def _metrics(run_dir: Path) -> list[dict]:
    return [_strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ divergence


@pytest.mark.slow
def test_the_issues_diverging_command_stops_at_the_first_nonfinite_step_keeping_good_checkpoints(tmp_path):
    command = _command(
        tmp_path, "optim.lr=1e4", "checkpoint.every_steps=1", "checkpoint.keep_last=2", "train.steps=8"
    )
    done = subprocess.run(
        command, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=RUN_LIMIT_S
    )
    text = done.stdout + done.stderr
    assert done.returncode == DIVERGED_EXIT_CODE, text[-3000:]
    assert _recorded_exit_code(tmp_path) == DIVERGED_EXIT_CODE
    (message,) = [line for line in text.splitlines() if "not finite (train.on_nonfinite=stop)" in line]
    bad = int(re.search(r"step (\d+): loss nan, grad norm nan", message).group(1))
    assert bad >= 2 and "Traceback" not in text and "run summary" not in text
    checkpoints = tmp_path / "run" / "checkpoints"
    good = [f"step_{s:06d}" for s in range(max(1, bad - 2), bad)]  # keep_last=2 of the steps before it
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", *good]
    assert (checkpoints / "latest").read_text().strip() == good[-1]
    assert f"the last good checkpoint is {checkpoints / good[-1]}" in message and "exiting with 3" in message
    records = _metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, bad + 1))  # the run stopped there
    assert all(not r["nonfinite"] and math.isfinite(r["loss"]) for r in records[:-1])
    last = records[-1]
    assert (last["nonfinite"], last["loss"], last["grad_norm"], last["skipped_update"]) == (
        True,
        "nan",
        "nan",
        True,
    )


def _skip_cases(tmp: str, device: dict | None = None) -> dict:
    """Two runs with non-finite steps 3, 5 and 6 under ``on_nonfinite=skip``; ``device``: config
    overrides for a GPU run (Megatron-Core's DDP and optimizer instead of the CPU path's)."""
    import torch

    from relax_gdn.train import loop, run_training
    from relax_gdn.train.console import run_summary
    from tests.train_with_faults import nan_loss

    torch.set_num_threads(1)
    sums = {}
    train_step = loop.Trainer.train_step

    def noting_weights(self, step):
        outcome = train_step(self, step)
        sums[step] = sum(float(p.double().sum()) for p in self.core_model.parameters())
        return outcome

    loop.Trainer.train_step = noting_weights
    nan_loss("3", "5", "6")  # one non-finite step, then two in a row
    out = {}
    for name, most in (("skips", 3), ("stops", 2)):
        sums.clear()
        tmp_dir = Path(tmp) / name
        result = run_training(
            _cfg(
                train__steps=7,
                train__global_batch_size=4,  # the steps' outcomes are checked, not the batch
                data__num_samples=64,
                train__on_nonfinite="skip",
                train__max_nonfinite_steps=most,
                checkpoint__every_steps=1,
                checkpoint__keep_last=0,
                checkpoint__dir=str(tmp_dir / "ckpt"),
                **(device or {}),
            ),
            tmp_dir / "run",
            runtime=job_runtime(),
        )
        out[name] = dict(
            records=result.records,
            weights=dict(sums),
            nonfinite=result.nonfinite_steps,
            stop=None if result.stop is None else (result.stop.step, result.stop.exit_code),
            saved=sorted(p.name for p in (tmp_dir / "ckpt").iterdir()),
            summary=dict(run_summary(result)),
            jsonl=_metrics(tmp_dir / "run"),
        )
    return out


@pytest.fixture(scope="module")
def skipped(tmp_path_factory):
    return run_distributed(_skip_cases, 1, str(tmp_path_factory.mktemp("skip")))[0]


def _assert_skipped_without_updates(out: dict) -> None:
    nonfinite = [r["step"] for r in out["records"] if r["nonfinite"]]
    assert nonfinite == [3, 5, 6] and out["stop"] is None and out["nonfinite"] == 3
    weights = out["weights"]
    assert weights[3] == weights[2] and weights[5] == weights[6] == weights[4]  # no update applied
    assert weights[4] != weights[3] and weights[7] != weights[6]  # finite steps update again
    assert all(r.get("skipped_update") for r in out["records"] if r["nonfinite"])
    assert out["saved"] == ["latest", "step_000001", "step_000002", "step_000004", "step_000007"]
    assert [r["nonfinite_steps"] for r in out["jsonl"]] == [0, 0, 1, 1, 2, 3, 3]
    assert out["summary"]["non-finite steps"].startswith("3 ")


def _assert_stopped_after_two_in_a_row(out: dict) -> None:
    assert out["stop"] == (6, DIVERGED_EXIT_CODE)  # steps 5 and 6 in a row; step 3 alone was skipped
    assert [r["step"] for r in out["records"]] == list(range(1, 7))
    assert out["saved"] == ["latest", "step_000001", "step_000002", "step_000004"]


def test_skip_leaves_the_weights_of_a_nonfinite_step_and_saves_no_checkpoint_after_it(skipped):
    _assert_skipped_without_updates(skipped["skips"])


def test_skip_stops_after_max_nonfinite_steps_in_a_row(skipped):
    _assert_stopped_after_two_in_a_row(skipped["stops"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_gpu_megatrons_optimizer_skips_the_update_of_a_nonfinite_step(tmp_path):
    """The same runs on one GPU in bf16: Megatron-Core's DDP and optimizer (SkipNonfiniteUpdate
    turns the update of a non-finite grad norm into a no-op; Megatron alone would write NaN)."""
    device = {"train__device": "cuda", "train__precision": "bf16"}
    out = run_distributed(_skip_cases, 1, str(tmp_path), device, backend="nccl")[0]
    _assert_skipped_without_updates(out["skips"])
    _assert_stopped_after_two_in_a_row(out["stops"])


def test_metrics_jsonl_writes_nonfinite_values_as_strings_and_compare_reads_them_back(tmp_path):
    from relax_gdn.compare.runs import clean_records, is_nonfinite, read_jsonl
    from relax_gdn.train.loggers import JsonlLogger

    log = JsonlLogger(tmp_path / "metrics.jsonl")
    log.log({"step": 1, "loss": 2.5, "grad_norm": 1.0, "nonfinite": False})
    log.log({"step": 2, "loss": float("nan"), "grad_norm": float("inf"), "nonfinite": True})
    log.log({"step": 3, "loss": float("-inf"), "grad_norm": None, "nonfinite": True})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [_strict_json(line)["loss"] for line in lines] == [2.5, "nan", "-inf"]
    assert _strict_json(lines[1])["grad_norm"] == "inf"
    records = clean_records(
        read_jsonl(tmp_path / "metrics.jsonl") + [{"step": 4, "loss": None}]
    )  # an older file's NaN
    assert [is_nonfinite(r) for r in records] == [False, True, True, True]
    assert (
        math.isnan(records[1]["loss"])
        and records[1]["grad_norm"] == math.inf
        and math.isnan(records[3]["loss"])
    )


# ------------------------------------------------------------------ compare: diverged runs


def _write_run(directory: Path, seed: int, lr: float, losses: list, nonfinite_style: str = "marked") -> None:
    import yaml

    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text(yaml.safe_dump({"train": {"seed": seed}, "optim": {"lr": lr}}))
    lines = []
    for step, loss in enumerate(losses, 1):
        bad = isinstance(loss, float) and not math.isfinite(loss)
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": 1.0,
            "lr": lr,
            "tokens": 1000,
            "tokens_per_s": 1000.0 + seed,
            "mfu": None,
            "world_size": 1,
        }
        if bad and nonfinite_style == "marked":
            record |= {"loss": "nan", "grad_norm": "nan", "nonfinite": True}
        elif bad:  # files written before the mark: null
            record |= {"loss": None, "grad_norm": None}
        lines.append(json.dumps(record))
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_compare_marks_diverged_runs_and_keeps_them_out_of_the_noise_floor(tmp_path):
    from relax_gdn.compare.__main__ import main

    falling = [3.0 - 0.1 * i for i in range(12)]
    _write_run(tmp_path / "a1", 1, 1e-3, falling)
    _write_run(tmp_path / "a2", 2, 1e-3, [x + 0.01 for x in falling])
    _write_run(tmp_path / "b1", 1, 1e4, falling[:3] + [math.nan] * 9)
    _write_run(tmp_path / "b2", 2, 1e4, falling[:4] + [math.nan] * 8, nonfinite_style="null")
    _write_run(tmp_path / "c1", 1, 1e-2, [x - 0.02 for x in falling])
    _write_run(tmp_path / "c2", 2, 1e-2, [x - 0.03 for x in falling[:6]] + [math.nan] + falling[7:])
    assert main([str(tmp_path), "--baseline", "optim.lr=0.001", "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    variants = {v["config"]["optim.lr"]: v for v in summary["variants"]}
    assert not variants[1e-3]["diverged"] and variants[1e4]["diverged"] and variants[1e-2]["diverged"]
    runs = {r["name"]: r for v in summary["variants"] for r in v["runs"]}
    assert (runs["b1"]["nonfinite_steps"], runs["b1"]["first_nonfinite_step"]) == (9, 4)
    assert (runs["b2"]["nonfinite_steps"], runs["b2"]["first_nonfinite_step"]) == (
        8,
        5,
    )  # an older file's nulls
    assert (runs["c2"]["nonfinite_steps"], runs["a1"]["nonfinite_steps"], runs["a1"]["diverged"]) == (
        1,
        0,
        False,
    )
    # A/A: the two lr=1e-3 runs only (lr=1e4 and lr=1e-2 each have one run that did not diverge)
    assert [n["variant"] for n in summary["noise"]["variants"]] == ["optim.lr=0.001"]
    verdicts = {c["variant"]: c for c in summary["comparisons"]}
    assert (
        verdicts["optim.lr=10000.0"]["loss"]["verdict"] == "diverged"
        and verdicts["optim.lr=10000.0"]["diverged"]
    )
    markdown = (tmp_path / "out" / "summary.md").read_text()
    assert "optim.lr=10000.0 (diverged: 17 non-finite steps)" in markdown
    assert "run b1 **diverged**: 9 non-finite step(s) from step 4" in markdown
    assert "run b1 diverged: 9 non-finite step(s)" in (tmp_path / "out" / "report.html").read_text()


def test_compare_exit_2_is_for_bad_input_only(tmp_path, monkeypatch, capsys):
    from relax_gdn.compare import __main__ as compare_main
    from relax_gdn.compare import stats

    assert compare_main.main([str(tmp_path / "nowhere")]) == USER_ERROR_EXIT_CODE
    assert "is neither a run/sweep directory" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{ not json")
    assert compare_main.main([str(tmp_path / "broken.json")]) == USER_ERROR_EXIT_CODE
    assert "broken.json is not JSON" in capsys.readouterr().err
    _write_run(tmp_path / "runs" / "a", 1, 1e-3, [3.0, 2.9, 2.8, 2.7, 2.6])

    def numpy_fails(*args, **kwargs):
        raise ValueError("operands could not be broadcast together")  # what a bug in the statistics raises

    monkeypatch.setattr(stats, "compare_runs", numpy_fails)
    with pytest.raises(ValueError, match="could not be broadcast"):  # a traceback, not "bad input"
        compare_main.main([str(tmp_path / "runs")])


# ------------------------------------------------------------------ save failures keep their cause


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["erofs", "bug"])
def test_a_refused_save_is_one_message_and_a_bug_in_a_save_a_traceback(tmp_path, kind):
    ckpt = tmp_path / "ckpt"
    command = _command(
        tmp_path, *SMALL, "train.steps=3", "checkpoint.every_steps=1", f"checkpoint.dir={ckpt}", faults=True
    )
    env = _env(tmp_path, RELAX_GDN_TEST_FAULTS=f"save_error:2:{kind}")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    text = done.stdout + done.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == [".step_000002.partial", "latest", "step_000001"]
    if kind == "erofs":
        assert done.returncode == USER_ERROR_EXIT_CODE, text[-3000:]
        (message,) = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert (
            f"saving checkpoint {ckpt / 'step_000002'} failed ([Errno 30] Read-only file system)" in message
        )
        assert "checkpoint.resume=auto" in message and "Traceback" not in text
        full = subprocess.run(
            command,
            cwd=tmp_path,
            env={**env, "HYDRA_FULL_ERROR": "1"},
            capture_output=True,
            text=True,
            timeout=RUN_LIMIT_S,
        )
        assert (
            "CheckpointException" in full.stderr and "The above exception was the direct cause" in full.stderr
        )
        last = full.stderr.rstrip().splitlines()[-1].removeprefix("[rank0]: ")  # torch's prefix, with a group
        assert last.startswith("relax_gdn.train.checkpoint.CheckpointError: saving"), full.stderr[-3000:]
    else:
        assert done.returncode == 1, text[-3000:]
        assert "Traceback" in text and "a bug in the checkpoint writer" in text and "free space" not in text


def _mount_tmpfs(directory: Path, size: str) -> bool:
    directory.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
            capture_output=True,
            timeout=60,
        ).returncode
        == 0
    )


@pytest.mark.slow
def test_a_save_into_a_full_file_system_is_one_message_naming_it(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "6m"):  # one checkpoint of the tiny model (3.9 MB) fits, two do not
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    try:
        command = _command(
            tmp_path,
            *SMALL,
            "train.steps=3",
            "checkpoint.every_steps=1",
            f"checkpoint.dir={disk / 'ckpt'}",
            "checkpoint.keep_last=1",
        )
        done = subprocess.run(
            command, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=RUN_LIMIT_S
        )
        text = done.stdout + done.stderr
        assert done.returncode == USER_ERROR_EXIT_CODE, text[-3000:]
        (message,) = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert "step_000002 failed ([Errno 28] No space left on device); 0.0 MiB free there" in message
        assert (disk / "ckpt" / "latest").read_text().strip() == "step_000001" and "Traceback" not in text
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=60)


# ------------------------------------------------------------------ rank 0 decides


def _listings_differ(tmp: str) -> dict:
    """Rank 1 sees ``checkpoint.dir`` as an older listing (its network file system's cache):
    without step_000004 and with ``latest`` naming step_000002."""
    import pathlib

    import torch
    import torch.distributed as dist

    from relax_gdn.train import run_training

    torch.set_num_threads(1)
    tmp = Path(tmp)
    small = dict(train__global_batch_size=4, data__num_samples=64)  # which step is loaded is checked
    cfg = _cfg(
        **small,
        train__steps=6,
        parallel__cp=2,
        optim__decay_steps=6,
        checkpoint__every_steps=2,
        checkpoint__keep_last=0,
        checkpoint__dir=str(tmp / "ckpt"),
        checkpoint__resume="auto",
    )
    first = _cfg(
        **small,
        train__steps=4,
        parallel__cp=2,
        optim__decay_steps=6,
        checkpoint__every_steps=2,
        checkpoint__dir=str(tmp / "ckpt"),
    )
    run_training(first, None, runtime=job_runtime())
    if dist.get_rank() == 1:
        iterdir, read_text = pathlib.Path.iterdir, pathlib.Path.read_text
        pathlib.Path.iterdir = lambda self: (p for p in iterdir(self) if p.name != "step_000004")
        pathlib.Path.read_text = lambda self, *a, **k: (
            "step_000002\n" if self.name == "latest" else read_text(self, *a, **k)
        )
    seen = sorted(p.name for p in (tmp / "ckpt").iterdir())
    resumed = run_training(cfg, None, runtime=job_runtime())
    return {"seen": seen, "start": resumed.start_step, "losses": [r["loss"] for r in resumed.records]}


@pytest.mark.slow
def test_ranks_that_list_the_checkpoint_dir_differently_load_the_step_rank_0_chose(tmp_path):
    rank0, rank1 = run_distributed(_listings_differ, 2, str(tmp_path))
    assert "step_000004" in rank0["seen"] and "step_000004" not in rank1["seen"]  # the views differ
    assert rank0["start"] == rank1["start"] == 4 and rank0["losses"] == rank1["losses"]


@pytest.mark.slow
def test_a_data_error_on_one_rank_is_reported_by_rank_0_at_once(tmp_path):
    """Rank 1 alone cannot load the data: rank 0 reports it for both (they agreed at once), instead
    of rank 1 waiting for torchrun to stop the others."""
    logs = tmp_path / "logs"
    command = _command(tmp_path, *SMALL, "train.steps=2", nproc=2, faults=True)
    command[3:3] = ["--log-dir", str(logs), "--redirects", "3"]  # each worker's output in a file of its own
    done = subprocess.run(
        command,
        cwd=tmp_path,
        env=_env(tmp_path, RELAX_GDN_TEST_FAULTS="data_error:1"),
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S,
    )
    said = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    errors = {
        rank: re.findall(r"^(?:\[rank \d+\] )?error: .*", text, flags=re.M) for rank, text in said.items()
    }
    assert errors == {
        0: ["[rank 1] error: data.path: the data file is not visible on this node (rank 1)"],
        1: [],
    }, done.stderr[-3000:]
    assert done.returncode != 0 and _recorded_exit_code(tmp_path) == USER_ERROR_EXIT_CODE


# ------------------------------------------------------------------ dead ranks and hangs


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
# on 2 GPUs: NCCL, bf16, and background saves (Megatron-Core's writer and its results-queue server)
ON_TWO_GPUS = ("train.device=cuda", "train.precision=bf16", "checkpoint.async_save=true")


@pytest.mark.parametrize(
    "device",
    [pytest.param((), id="cpu"), pytest.param(ON_TWO_GPUS, id="gpu", marks=[pytest.mark.gpu, TWO_GPUS])],
)
@pytest.mark.parametrize("dead", [0, 1])
def test_kill_9_of_a_worker_ends_the_job_naming_it_and_leaves_no_process(tmp_path, dead, device):
    command = _command(
        tmp_path, *SMALL, "parallel.cp=2", "train.steps=40", "checkpoint.every_steps=1", *device, nproc=2
    )
    torchrun = _start(command, tmp_path, _env(tmp_path))
    lines, killed_at, job = [], None, []
    for line in output_lines(torchrun, timeout_s=RUN_LIMIT_S):
        lines.append(line)
        if killed_at is None and "step_000001 saved" in line:  # after a save: its helpers exist if any do
            job = descendants(torchrun.pid)
            (worker,) = [
                p for p in psutil.Process(torchrun.pid).children() if p.environ().get("RANK") == str(dead)
            ]
            worker.kill()
            killed_at = time.monotonic()
    code = torchrun.wait(timeout=60)
    ended = time.monotonic() - killed_at
    text = "".join(lines)
    assert code != 0 and ended < 60, text[-3000:]
    assert re.search(rf"rank\s+: {dead} \(local_rank: {dead}\)\n\s+exitcode\s+: -9", text), text[-3000:]
    wait_until(lambda: not alive(job), 20, f"the job's processes {[p.pid for p in alive(job)]} ending")


# The watchdog's limit for the stuck rank's job: the test waits it out once, and each of the tiny
# model's steps before the stuck one (step 1 with its warm-up: well under a second, a few seconds
# on a loaded 2-core machine) must finish within it
STUCK_HANG_S = 6


@pytest.mark.slow
def test_a_rank_stuck_in_a_collective_leaves_every_ranks_stacks_and_exits_124(tmp_path):
    command = _command(
        tmp_path,
        *SMALL,
        "train.steps=40",
        f"train.hang_timeout_s={STUCK_HANG_S}",
        "train.collective_timeout_s=900",
        nproc=2,
        faults=True,
    )
    torchrun = _start(command, tmp_path, _env(tmp_path, RELAX_GDN_TEST_FAULTS="stuck:1:3"))
    text = "".join(output_lines(torchrun, timeout_s=RUN_LIMIT_S))
    assert torchrun.wait(timeout=60) != 0, text[-3000:]
    assert re.search(r"exitcode\s+: 124", text), text[-3000:]
    assert _recorded_exit_code(tmp_path) == HANG_EXIT_CODE
    stacks = {rank: (tmp_path / "run" / "hang" / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    for rank, dump in stacks.items():
        assert (
            dump.startswith(f"rank {rank}: no training step completed in {STUCK_HANG_S} s")
            and "last step completed: step 2" in dump
        ), dump[:500]
        assert (
            "in _fire" in dump and "in _step_and_save" in dump
        )  # every thread: the watchdog's and the stuck main one
    assert " in recv" in stacks[1] and " in recv" not in stacks[0]  # where the stuck rank is
    assert " in all_reduce" in stacks[0]  # what the other waits in
    assert text.count("relax-gdn: rank ") == 2 and f"no training step completed in {STUCK_HANG_S} s" in text
    assert (
        text.count("Traceback") == 1 and "ChildFailedError" in text
    )  # torchrun's own report, none from a worker


@pytest.mark.slow
def test_the_step_watchdog_fires_with_the_stacks_of_every_thread(tmp_path):
    script = (
        "import threading\n"
        "from pathlib import Path\n"
        "from relax_gdn.train.watchdog import StepWatchdog\n"
        # rank 3 of 4, the other ranks' stacks already written: it exits once its own are
        f"dog = StepWatchdog(1.0, rank=3, dump_dir=Path({str(tmp_path / 'hang')!r}), world_size=4)\n"
        "dog.start(); dog.progress(7, 0.1)\n"
        "def parked_forever():\n"
        "    threading.Event().wait()\n"
        "parked_forever()\n"
    )
    (tmp_path / "hang").mkdir()
    for peer in range(3):
        (tmp_path / "hang" / f"rank{peer}.txt").write_text(f"rank {peer}: ...\n")
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == HANG_EXIT_CODE, done.stderr
    dump = (tmp_path / "hang" / "rank3.txt").read_text()
    assert dump.startswith(
        "rank 3: no training step completed in 1 s (train.hang_timeout_s=1.0; last step completed: step 7)"
    )
    assert "parked_forever" in dump and "relax-gdn: rank 3: no training step completed" in done.stderr


@pytest.mark.slow
def test_a_rank_that_fired_waits_for_its_peers_stacks_before_it_exits(tmp_path):
    """The first rank to exit ends the job (torchrun stops the others): rank 0 of 2 leaves its stacks,
    then stays until rank 1's file is there (within peer_grace_s), so a peer whose deadline passes a
    moment later still leaves its own."""
    from relax_gdn.train.watchdog import peer_grace_s

    assert peer_grace_s(1.0) == 10.0 and peer_grace_s(15.0) == 15.0 and peer_grace_s(900.0) == 60.0
    hang = tmp_path / "hang"
    script = (
        "import threading\n"
        "from pathlib import Path\n"
        "from relax_gdn.train.watchdog import StepWatchdog\n"
        f"dog = StepWatchdog(1.0, rank=0, world_size=2, dump_dir=Path({str(hang)!r}))\n"
        "dog.start(); dog.progress(2, 0.1)\n"
        "threading.Event().wait()\n"
    )
    rank0 = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, env=child_env(), stderr=subprocess.PIPE, text=True
    )
    try:
        wait_until(lambda: (hang / "rank0.txt").exists(), 60, "rank 0's stacks")
        assert rank0.poll() is None  # written, and waiting for rank 1 (10 s of grace)
        (hang / "rank1.txt").write_text("rank 1: ...")
        _, err = rank0.communicate(timeout=30)
    finally:
        rank0.kill()
    assert rank0.returncode == HANG_EXIT_CODE, err
    assert sorted(p.name for p in hang.iterdir()) == ["rank0.txt", "rank1.txt"]  # no partial file left
    assert "relax-gdn: rank 0: no training step completed in 1 s" in err


def test_auto_hang_timeout_follows_the_median_step_above_a_floor():
    from relax_gdn.train.watchdog import AUTO_AFTER_STEPS, HANG_FLOOR_S, auto_hang_timeout

    assert auto_hang_timeout([100.0] * (AUTO_AFTER_STEPS - 1)) is None  # not armed during the first steps
    assert auto_hang_timeout([1.0, 2.0, 500.0]) == HANG_FLOOR_S  # a slow first step does not count
    assert auto_hang_timeout([40.0, 50.0, 60.0, 900.0]) == 550.0  # 10 x the median


# ------------------------------------------------------------------ the checkpoint writer's helper


def test_inline_saves_report_through_an_in_process_queue(runtime):
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    runtime.checkpoint_write_results(background=False)
    assert isinstance(
        filesystem_async.get_write_results_queue(), queue.Queue
    )  # no process to outlive the rank
    runtime.close()
    assert filesystem_async._results_queue is None


@pytest.mark.slow
def test_the_background_writers_queue_server_ignores_the_jobs_signals_and_dies_with_its_rank(tmp_path):
    script = (
        "import multiprocessing, sys\n"
        "from relax_gdn.compat.write_results import use_write_results_queue\n"
        "from megatron.core.dist_checkpointing.strategies import filesystem_async\n"
        "if __name__ == '__main__':\n"
        "    use_write_results_queue(background=True)\n"
        "    (server,) = multiprocessing.active_children()\n"
        "    print('server', server.pid, flush=True)\n"
        "    for line in sys.stdin:  # the test signals the server, then asks for a round trip\n"
        "        q = filesystem_async.get_write_results_queue(); q.put(line.strip())\n"
        "        print('echo', q.get(), flush=True)\n"
    )
    rank = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    said = (line.split() for line in output_lines(rank, timeout_s=120))
    answers = (words for words in said if words[:1] in (["server"], ["echo"]))  # torch's import notices aside
    server = psutil.Process(int(next(answers)[1]))
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        server.send_signal(signum)
        rank.stdin.write(f"after-{signum.name}\n")
        rank.stdin.flush()
        assert next(answers) == ["echo", f"after-{signum.name}"]  # the server still answers
    rank.kill()  # kill -9 of the rank
    rank.wait(timeout=60)
    wait_until(lambda: not alive([server]), 20, "the queue server ending with its rank")


# ------------------------------------------------------------------ signals during a save


@pytest.mark.slow
@pytest.mark.parametrize("signum,to", [(signal.SIGTERM, "group"), (signal.SIGUSR1, "rank")])
def test_a_signal_during_a_save_lets_it_finish_then_exits_75_and_resume_continues(tmp_path, signum, to):
    ckpt, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    overrides = (
        *SMALL,
        "train.steps=6",
        "checkpoint.every_steps=2",
        f"checkpoint.dir={ckpt}",
        "checkpoint.resume=auto",
    )
    job = _start(
        _command(tmp_path, *overrides, faults=True),
        tmp_path,
        _env(tmp_path, RELAX_GDN_TEST_FAULTS=f"pause_save:4:{gate}"),
    )
    lines = []
    for line in output_lines(job, timeout_s=RUN_LIMIT_S):
        lines.append(line)
        if "step 4/6" in line:
            wait_until(lambda: (gate / "saving.rank0").exists(), 120, "the step-4 save to begin")
            os.killpg(job.pid, signum) if to == "group" else os.kill(job.pid, signum)
            (gate / "go").touch()
    text = "".join(lines)
    assert job.wait(timeout=60) == PREEMPTED_EXIT_CODE, text[-3000:]
    assert f"preempted after step 4 ({signum.name}), checkpoint {ckpt / 'step_000004'}" in text, text[-3000:]
    assert "step 5/6" not in text and "Traceback" not in text and "free space" not in text
    assert (ckpt / "latest").read_text().strip() == "step_000004" and not list(ckpt.glob(".*partial"))
    again = subprocess.run(
        _command(tmp_path, *overrides),
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step 4 ({ckpt / 'step_000004'})" in again.stdout + again.stderr
    # the resume reads the checkpoint without a third-party notice (relax_gdn.known_warnings)
    said = (again.stdout + again.stderr).splitlines()
    assert [line for line in said if THIRD_PARTY_NOTICE.search(line)] == []
    assert [r["step"] for r in _metrics(tmp_path / "run")] == list(range(1, 7))


# ------------------------------------------------------------------ Ctrl-C


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_saves_and_exits_130_with_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = _start(
        _command(tmp_path, *SMALL, "train.steps=40", f"checkpoint.dir={ckpt}", "checkpoint.resume=auto"),
        tmp_path,
        _env(tmp_path),
    )
    lines = []
    for line in output_lines(job, timeout_s=RUN_LIMIT_S):
        lines.append(line)
        if "step 2/40" in line:
            os.killpg(job.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    text = "".join(lines)
    assert job.wait(timeout=60) == INTERRUPTED_EXIT_CODE, text[-3000:]
    saved = (ckpt / "latest").read_text().strip()
    stopped = int(saved.removeprefix("step_"))
    assert (
        f"stopped after step {stopped} (Ctrl-C), checkpoint {ckpt / saved}; the same command continues from it; "
        "exiting with 130" in text
    ), text[-3000:]
    assert text.count("relax-gdn: Ctrl-C: stopping after the step in progress") == 1
    assert f"step {stopped + 1}/40" not in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert _recorded_exit_code(tmp_path) == INTERRUPTED_EXIT_CODE


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_with_one_line(tmp_path):
    ckpt, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    job = _start(
        _command(
            tmp_path,
            *SMALL,
            "train.steps=40",
            "checkpoint.every_steps=3",
            f"checkpoint.dir={ckpt}",
            faults=True,
        ),
        tmp_path,
        _env(tmp_path, RELAX_GDN_TEST_FAULTS=f"pause_save:3:{gate}"),
    )
    lines = []
    for line in output_lines(job, timeout_s=RUN_LIMIT_S):
        lines.append(line)
        if "step 3/40" in line:
            wait_until(lambda: (gate / "saving.rank0").exists(), 120, "the step-3 save to begin")
            os.killpg(job.pid, signal.SIGINT)
        if "Ctrl-C again stops at once" in line:
            os.killpg(job.pid, signal.SIGINT)
    text = "".join(lines)
    assert job.wait(timeout=60) == INTERRUPTED_EXIT_CODE, text[-3000:]
    partial = ckpt / ".step_000003.partial"
    assert (
        f"relax-gdn: second Ctrl-C: stopped at once during step 3; saved: no checkpoint, nothing to "
        f"continue from; not saved: steps 1-3, the checkpoint being written ({partial}, incomplete: "
        "never read, removed by the next save)\n"
    ) in text, text[-3000:]
    assert "Traceback" not in text and not (ckpt / "latest").exists()  # the paused save never completed
    assert partial.is_dir()


@pytest.mark.slow
def test_ctrl_c_under_torchrun_saves_once_and_every_worker_exits_130(tmp_path):
    ckpt = tmp_path / "ckpt"
    command = _command(
        tmp_path,
        *SMALL,
        "parallel.cp=2",
        "train.steps=40",
        f"checkpoint.dir={ckpt}",
        "checkpoint.resume=auto",
        nproc=2,
    )
    torchrun = _start(command, tmp_path, _env(tmp_path))
    lines = []
    for line in output_lines(torchrun, timeout_s=RUN_LIMIT_S):
        lines.append(line)
        if "step 2/40" in line:
            os.killpg(torchrun.pid, signal.SIGINT)  # the terminal's Ctrl-C: torchrun and both workers
    torchrun.wait(timeout=60)
    text = "".join(lines)
    saved = (ckpt / "latest").read_text().strip()
    assert (
        f"stopped after step {int(saved.removeprefix('step_'))} (Ctrl-C), checkpoint {ckpt / saved}" in text
    ), text[-3000:]
    # rank 0 alone; torchrun's copy absorbed
    assert text.count("relax-gdn: Ctrl-C: stopping after the step in progress") == 1
    assert (
        "second Ctrl-C" not in text and "KeyboardInterrupt" not in text and "[rank0]: Traceback" not in text
    )
    assert _recorded_exit_code(tmp_path) == INTERRUPTED_EXIT_CODE
    assert not alive(descendants(torchrun.pid))


# ------------------------------------------------------------------ slurm/train.sbatch requeues


def _fake_slurm(bin_dir: Path, log: Path, worker_code: int) -> None:
    """srun, scontrol and scancel for slurm/train.sbatch: srun runs like torchrun after a worker
    exit (status 1, the worker's code in the exit-code file); scontrol notes its arguments."""
    bin_dir.mkdir()
    scripts = {
        "srun": f'#!/bin/bash\necho "{worker_code}" > "$RELAX_GDN_EXIT_CODE_FILE"\nexit 1\n',
        "scontrol": f'#!/bin/bash\nif [[ $1 == show ]]; then echo node1; else echo "scontrol $*" >> {log}; fi\n',
        "scancel": "#!/bin/bash\nexit 0\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


@pytest.mark.slow  # bash and python processes (no training)
@pytest.mark.parametrize(
    "worker_code,restarts,requeued",
    [
        (PREEMPTED_EXIT_CODE, 0, True),
        (HANG_EXIT_CODE, 0, True),
        (HANG_EXIT_CODE, 3, False),
        (DIVERGED_EXIT_CODE, 0, False),
        (USER_ERROR_EXIT_CODE, 0, False),
    ],
)
def test_train_sbatch_requeues_on_the_codes_errors_py_names(tmp_path, worker_code, restarts, requeued):
    log = tmp_path / "scontrol.log"
    _fake_slurm(tmp_path / "bin", log, worker_code)
    env = {
        **child_env(),
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": f"safety-test-{worker_code}",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_RESTART_COUNT": str(restarts),
    }
    done = subprocess.run(
        ["bash", str(ROOT / "slurm" / "train.sbatch")], env=env, capture_output=True, text=True, timeout=120
    )
    (ROOT / "slurm" / "logs" / f"safety-test-{worker_code}-4242.exit").unlink(missing_ok=True)
    assert done.returncode == (0 if requeued else worker_code), done.stdout + done.stderr
    assert (log.exists() and "scontrol requeue 4242" in log.read_text()) == requeued
