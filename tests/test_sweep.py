"""Sweeps as a user runs them: ``python train.py -m hydra/launcher=local ...`` starts each job as
its own 2-process group (submitit's local executor, gloo; two jobs at once); a job the config validation refuses is
recorded as failed and the others still run; the exit code counts the failed jobs; ``sweep.json``
says what happened; the launcher reports each start and end as it happens and names a job that
runs far longer than the finished ones; the comparison reads the sweep directory. Plus the
refusals and the plain sbatch path's dry run."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from relax_gdn.sweep import (
    SweepManifest,
    SweepProgress,
    gpu_slots,
    variant_label,
    varying_keys,
    visible_gpu_ids,
    wandb_run_id,
)
from tests.distributed import child_env
from tests.helpers import train_py
from tests.processes import ChildLines, alive, descendants, start_as_a_job, wait_until

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "train.steps=4",
    "optim.warmup_steps=1",
    "train.global_batch_size=4",
    "data.num_samples=64",
    "data.synthetic_max_steps=1",
    "logging.console=false",
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    sweep_dir = tmp / "sweep"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "hydra/launcher=local",
            "hydra.launcher.tasks_per_node=2",
            "hydra.launcher.parallel_jobs=2",
            "parallel.cp=2",
            "gdn.cp_mode=headwise,chunkwise,all_gather",
            f"hydra.sweep.dir={sweep_dir}",
            *TINY,
        ],
        cwd=tmp,
        env=child_env({"PYTHONPATH": str(ROOT)}),
        capture_output=True,
        text=True,
        timeout=900,
    )
    return sweep_dir, done


def test_local_sweep_runs_each_job_as_a_process_group_and_survives_a_refused_job(sweep):
    sweep_dir, done = sweep
    log = done.stdout + done.stderr
    assert done.returncode == 1, log[-4000:]  # one failed job
    assert "1 of 3 jobs failed" in log
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    assert manifest["counts"] == {
        "submitted": 0,
        "running": 0,
        "ok": 2,
        "failed": 1,
        "stopped": 0,
        "not_run": 0,
        "refused": 1,
    }
    assert manifest["varying_keys"] == ["gdn.cp_mode"] and manifest["world_size_per_job"] == 2
    ok, ok2, refused = manifest["jobs"]
    assert [j["variant"] for j in manifest["jobs"]] == [
        f"gdn.cp_mode={m}" for m in ("headwise", "chunkwise", "all_gather")
    ]
    for job in (ok, ok2):
        assert job["status"] == "ok" and job["rc"] == 0 and job["world_size"] == 2, job
        run_dir = Path(job["run_dir"])
        assert run_dir.parent == sweep_dir
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["world_size"] == 2 for r in records)
        assert f"cp_mode: {job['variant'].split('=')[1]}" in (run_dir / "config.yaml").read_text()
        assert (run_dir / ".hydra" / "overrides.yaml").exists()
    assert refused["status"] == "failed" and refused["rc"] == 2 and refused["run_dir"] is None
    assert "all_gather" in refused["error"] and "recompute.granularity=full" in refused["error"]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "0",
        "1",
    ]
    # submitit's task logs, one directory per job id, and no empty unformatted ".submitit/%j"
    assert sorted(p.name for p in (sweep_dir / ".submitit").iterdir()) == sorted(
        str(j["submitit_job_id"]) for j in (ok, ok2)
    )
    for job in (ok, ok2):
        assert Path(job["log"]).parent.parent == sweep_dir / ".submitit" and Path(job["log"]).exists()
    # one line per start and end as they happen, with the exit code and the run directory
    for job in (ok, ok2):
        assert (
            log.count(f"job #{job['num']} started") == 1 and log.count(f"job #{job['num']} ok (exit 0, ") == 1
        )
        assert log.index(f"job #{job['num']} started") < log.index(f"job #{job['num']} ok")
        assert re.search(
            rf"job #{job['num']} ok \(exit 0, \d+:\d\d:\d\d\): {re.escape(job['run_dir'])}$", log, re.M
        )
    assert log.count("job #2 refused (exit 2), not run: ") == 1
    assert "sweep: 0 running, 2 ok, 1 failed (1 refused), 0 waiting (of 3)" in log.splitlines()[-2]


def test_compare_reads_the_sweep(sweep, tmp_path):
    from relax_gdn.compare.__main__ import main

    sweep_dir, _ = sweep
    out = tmp_path / "cmp"
    assert main([str(sweep_dir), "--out", str(out), "--baseline", "gdn.cp_mode=headwise"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["varying_keys"] == ["gdn.cp_mode"] and summary["baseline"] == "gdn.cp_mode=headwise"
    chunkwise = next(v for v in summary["variants"] if v["label"] == "gdn.cp_mode=chunkwise")
    records = [json.loads(line) for line in (sweep_dir / "1" / "metrics.jsonl").read_text().splitlines()]
    assert chunkwise["stats"]["final_loss"]["median"] == pytest.approx(records[-1]["loss"])
    assert chunkwise["runs"][0]["world_size"] == 2
    per_gpu, total = (
        chunkwise["stats"]["tokens_per_s_per_gpu"]["median"],
        chunkwise["stats"]["tokens_per_s"]["median"],
    )
    assert per_gpu == pytest.approx(total / 2)
    for name in ("summary.md", "report.html", "loss.png", "tokens_per_s.png", "throughput.png"):
        assert (out / name).stat().st_size > 0
    assert "gdn.cp_mode=chunkwise" in (out / "summary.md").read_text()


def test_ctrl_c_stops_the_running_job_after_a_checkpoint_and_the_others_are_not_run(tmp_path):
    """Three one-process jobs one after another; Ctrl-C (SIGINT to the sweep's process group, as a
    terminal sends it) while the first trains: it stops after a checkpoint (its job controller does
    not kill it), the two others are recorded as not run, the sweep ends with one line, exit 130."""
    sweep_dir = tmp_path / "sweep"
    proc = start_as_a_job(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "hydra/launcher=local",
            "train.seed=1,2,3",
            f"hydra.sweep.dir={sweep_dir}",
            *TINY,
            "train.steps=40",
            "optim.decay_steps=40",
        ],
        tmp_path,
        child_env({"PYTHONPATH": str(ROOT)}),
    )
    lines = ChildLines(proc, timeout_s=900)
    try:
        lines.wait_for(r"job #0 started")
        metrics = sweep_dir / "0" / "metrics.jsonl"
        wait_until(
            lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, 600, "job #0's first step"
        )
        below = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=300) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    log = lines.all()
    assert "Traceback" not in log, log[-4000:]
    last = log.strip().splitlines()[-1]
    said = f"sweep stopped by Ctrl-C: 1 stopped, 2 not run; sweep.json in {sweep_dir}"
    assert last.endswith(said), log[-3000:]
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    assert [(j["status"], j.get("rc")) for j in manifest["jobs"]] == [
        ("stopped", 130),
        ("not_run", None),
        ("not_run", None),
    ], manifest["jobs"]
    assert manifest["counts"]["failed"] == 0 and manifest["counts"]["stopped"] == 1
    checkpoints = sweep_dir / "0" / "checkpoints"
    saved = (checkpoints / "latest").read_text().strip()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert saved == f"step_{steps[-1]:06d}" and steps[-1] < 40  # stopped after the step it was in, saved
    assert not (sweep_dir / "1").exists() and not alive(below)


def _write_when_read(fifo: Path, text: str, timeout: float) -> None:
    writer = threading.Thread(target=fifo.write_text, args=(text,), daemon=True)
    writer.start()
    writer.join(timeout)
    assert not writer.is_alive(), f"nothing opened {fifo} for reading within {timeout} s"


def test_jobs_failing_inside_are_reported_as_they_happen_and_the_next_still_runs(tmp_path):
    """Two jobs, one after the other. Both configs pass the launcher's validation (the files exist);
    loading them fails in the job. The second job's data file is a named pipe, so it runs until the
    test writes the pipe: while it runs, the launcher has reported it started (sweep.json says
    so), then names it for running past 1.5x the first job's duration, once."""
    bad_text = 'not json\n{"question": "no prompt field"}\n'
    bad = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    bad[0].write_text(bad_text)
    os.mkfifo(bad[1])
    sweep_dir = tmp_path / "sweep"
    proc = start_as_a_job(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "hydra/launcher=local",
            "data.source=jsonl",
            f"data.path={bad[0]},{bad[1]}",
            f"hydra.sweep.dir={sweep_dir}",
            "hydra.launcher.slow_job_factor=1.5",
            "hydra.launcher.timeout_min=15",
            *TINY,
        ],
        tmp_path,
        child_env({"PYTHONPATH": str(ROOT)}),
    )
    lines = ChildLines(proc, timeout_s=1200)
    try:
        lines.wait_for(r"job #0 failed \(exit 2, \d+:\d\d:\d\d\): .*no usable record")
        lines.wait_for(r"job #1 started")
        # printed after sweep.json was rewritten: the running job is there, the sweep is not finished
        manifest = json.loads((sweep_dir / "sweep.json").read_text())
        assert manifest["jobs"][1]["status"] == "running" and "finished" not in manifest, manifest
        assert manifest["counts"] == {
            "submitted": 0,
            "running": 1,
            "ok": 0,
            "failed": 1,
            "stopped": 0,
            "not_run": 0,
            "refused": 0,
        }
        slow = lines.wait_for(r"job #1 has run")
        assert re.search(
            r"has run \d+:\d\d:\d\d, \d+\.\dx the median \d+:\d\d:\d\d of the 1 finished job\(s\): "
            + re.escape(str(sweep_dir / "1"))
            + r"; its output: .*\.submitit/\d+/\d+_0_log\.out",
            slow,
        ), slow
        _write_when_read(bad[1], bad_text, timeout=120)
        lines.wait_for(r"job #1 failed \(exit 2, ")
        assert proc.wait(timeout=120) == 2  # two failed jobs
    finally:
        if proc.poll() is None:  # a failed wait: release the pipe's reader and stop the sweep
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    log = lines.all()
    assert log.count("job #1 has run") == 1, log[-4000:]  # named once
    assert "2 of 2 jobs failed: #0 (exit 2), #1 (exit 2)" in log
    jobs = json.loads((sweep_dir / "sweep.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["failed", "failed"]
    for job, path in zip(jobs, bad):
        # the recipe's refusal (exit code 2) with its message, naming the file
        assert job["rc"] == 2 and "no usable record" in job["error"] and str(path) in job["error"], job
        assert job["started"] < job["ended"]


def test_multirun_under_torchrun_is_refused(tmp_path):
    env = {**child_env({"PYTHONPATH": str(ROOT)}), "WORLD_SIZE": "2", "RANK": "0", "TORCHELASTIC_RUN_ID": "x"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "gdn.cp_mode=headwise,chunkwise"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "cannot run under torchrun" in done.stderr and "hydra/launcher=local" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "outputs").exists()


def test_seed_table_dry_run_prints_the_array_and_every_task(tmp_path):
    env = {
        **child_env({"PYTHONPATH": str(ROOT)}),
        "DRY_RUN": "1",
        "SEEDS": "1 2",
        "OUT_DIR": str(tmp_path / "logs"),
    }
    done = subprocess.run(
        ["bash", str(ROOT / "slurm" / "seed_table.sh"), "data.path=/d"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    (sbatch,) = [line for line in lines if line.startswith("sbatch ")]
    assert "--array=0-27" in sbatch and "slurm/train.sbatch" in sbatch and "data.path=/d" in sbatch
    tasks = [line for line in lines if line.startswith("# task ") and "train.sbatch" in line]
    assert len(tasks) == 28 and "experiment=s2 gdn.cp_mode=all_gather train.seed=1" in tasks[5]
    table = Path(sbatch.split("TASK_TABLE=")[1].split()[0])
    assert table.parent == tmp_path / "logs" and len(table.read_text().splitlines()) == 28


# ---- pure parts ----------------------------------------------------------------------------------


def test_variant_labels_leave_seeds_out():
    jobs = [
        ["gdn.cp_mode=headwise", "train.seed=1", "train.steps=4"],
        ["gdn.cp_mode=chunkwise", "train.seed=2", "train.steps=4"],
    ]
    varying = varying_keys(jobs)
    assert varying == ["gdn.cp_mode", "train.seed"]
    assert variant_label(jobs[0], varying) == "gdn.cp_mode=headwise"
    assert variant_label(["train.seed=3"], ["train.seed"]) == "default"


def test_progress_lines_tally_and_a_slow_job_named_once():
    progress = SweepProgress(slow_factor=3.0)
    jobs = [
        dict(num=0, status="submitted", variant="a", run_dir="/s/0"),
        dict(num=1, status="submitted", variant="b", run_dir="/s/1"),
        dict(
            num=2,
            status="failed",
            refused=True,
            rc=2,
            run_dir=None,
            error="2 configuration problems:\n  - x\n  - y",
        ),
    ]
    assert progress.update(jobs, now=100.0) == [
        ("ERROR", "job #2 refused (exit 2), not run: 2 configuration problems: - x - y"),
        ("INFO", "sweep: 0 running, 0 ok, 1 failed (1 refused), 2 waiting (of 3)"),
    ]
    assert progress.update(jobs, now=101.0) == []  # nothing changed: nothing printed
    for job in jobs[:2]:
        job.update(status="running", started=100.0, host="n1")
    assert progress.update(jobs, now=102.0) == [
        ("INFO", "job #0 started on n1 (a): /s/0"),
        ("INFO", "job #1 started on n1 (b): /s/1"),
        ("INFO", "sweep: 2 running, 0 ok, 1 failed (1 refused), 0 waiting (of 3)"),
    ]
    jobs[0].update(status="ok", rc=0, ended=160.0)
    assert progress.update(jobs, now=161.0) == [
        ("INFO", "job #0 ok (exit 0, 0:01:00): /s/0"),
        ("INFO", "sweep: 1 running, 1 ok, 1 failed (1 refused), 0 waiting (of 3)"),
    ]
    assert progress.update(jobs, now=280.0) == []  # 180 s: three times the median, not past it
    jobs[1]["log"] = "/s/.submitit/7/7_0_log.out"
    assert progress.update(jobs, now=281.0) == [
        (
            "WARNING",
            "job #1 has run 0:03:01, 3.0x the median 0:01:00 of the 1 finished job(s): /s/1; "
            "its output: /s/.submitit/7/7_0_log.out",
        )
    ]
    assert progress.update(jobs, now=900.0) == []  # named once
    jobs[1].update(status="submitted", requeues=1, ended=None)
    assert progress.update(jobs, now=901.0) == [
        ("WARNING", "job #1 requeued after a checkpoint (1): /s/1"),
        ("INFO", "sweep: 0 running, 1 ok, 1 failed (1 refused), 1 waiting (of 3)"),
    ]
    jobs[1].update(status="running", started=950.0)
    assert progress.update(jobs, now=951.0)[0] == ("INFO", "job #1 started on n1 (b): /s/1")
    jobs[1].update(
        status="failed",
        rc=1,
        ended=1000.0,
        error="Traceback (most recent call last):\n  ...\nRuntimeError: boom",
    )
    assert progress.update(jobs, now=1001.0) == [
        ("ERROR", "job #1 failed (exit 1, 0:00:50): /s/1: RuntimeError: boom"),
        ("INFO", "sweep: 0 running, 1 ok, 2 failed (1 refused), 0 waiting (of 3)"),
    ]
    assert (
        SweepProgress(slow_factor=0)
        .update([{**jobs[0]}, {**jobs[1], "status": "running"}], now=1e6)[-1][1]
        .startswith("sweep:")
    )  # factor 0: no job is ever named slow


def test_manifest_merges_job_files_atomically(tmp_path):
    manifest = SweepManifest(tmp_path)
    manifest.update_job(1, status="submitted", overrides=["a=1"])
    manifest.update_job(0, status="running")
    manifest.merge(launcher="local")
    manifest.update_job(0, status="ok", rc=0)
    merged = manifest.merge()
    assert merged["launcher"] == "local"  # kept from the first merge
    assert [j["num"] for j in merged["jobs"]] == [0, 1] and merged["counts"]["ok"] == 1
    assert json.loads((tmp_path / "sweep.json").read_text()) == merged
    assert not list(tmp_path.rglob("*.tmp"))
    with pytest.raises(AssertionError):
        manifest.update_job(2, status="done")
    assert wandb_run_id(tmp_path, 3) == wandb_run_id(tmp_path, 3) != wandb_run_id(tmp_path, 4)


def test_a_submission_recorded_after_the_job_started_keeps_the_jobs_status(tmp_path):
    """A local job starts (and writes "running") before ``submit`` returns its id to the launcher."""
    manifest = SweepManifest(tmp_path)
    manifest.update_job(0, status="submitted", variant="a=1")
    manifest.update_job(0, status="running", started=1.0)  # the job, already running
    manifest.record_submission(0, "4242")  # the launcher, after submit returned
    (job,) = manifest.merge()["jobs"]
    assert (job["status"], job["started"], job["submitit_job_id"]) == ("running", 1.0, "4242")
    manifest.update_job(0, submitit_job_id="4242_0")  # the job's own id wins
    assert manifest.merge()["jobs"][0]["submitit_job_id"] == "4242_0"


def test_a_slurm_sweep_off_a_slurm_machine_is_one_line_and_writes_nothing(tmp_path):
    """Without sbatch and srun on PATH (an empty bin directory as PATH here), the sweep stops before
    Hydra writes its sweep directory: one line naming both ways on, exit 2."""
    (tmp_path / "bin").mkdir()
    sweep = tmp_path / "sweep"
    done = train_py(
        tmp_path,
        "-m",
        "hydra/launcher=slurm",
        "train.seed=1,2",
        f"hydra.sweep.dir={sweep}",
        env={"PATH": str(tmp_path / "bin")},
        run_dir=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == (
        "error: hydra/launcher=slurm submits each job with SLURM's sbatch and srun, and this machine has no "
        "sbatch or srun on its PATH: start the sweep on a SLURM login node, or run it here with "
        "hydra/launcher=local (docs/sweeps.md)"
    )
    assert not sweep.exists()


def test_slurm_launcher_writes_the_sbatch_script_it_promises(tmp_path, monkeypatch):
    """hydra/launcher=slurm composed from conf/ as a user would set it; submitit's sbatch text
    carries the shape, the signal, requeue and the container flags. No cluster here: submitit only
    looks for an ``srun`` on PATH before writing the script, so a placeholder one stands in."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hydra_plugins.relax_gdn_launcher.launcher import SlurmSweepLauncher
    from relax_gdn.config.hydra_io import register_schema

    register_schema()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            return_hydra_config=True,
            overrides=[
                "hydra/launcher=slurm",
                "hydra.launcher.partition=h200",
                "hydra.launcher.account=llm",
                "hydra.launcher.nodes=2",
                "hydra.launcher.timeout_min=90",
                "hydra.launcher.container_image=/img.sqsh",
                "hydra.launcher.container_mounts=/data:/data",
                f"hydra.sweep.dir={tmp_path}",
                "hydra.job.name=train",
            ],
        )
    launcher = SlurmSweepLauncher(**OmegaConf.to_container(cfg.hydra.launcher, resolve=True))
    assert launcher._world_size() == 16
    text = launcher._executor()._executor._make_submission_file_text("python -m submitit.core._submit x", "u")
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=h200",
        "#SBATCH --account=llm",
        "#SBATCH --time=90",
        "#SBATCH --signal=USR1@120",
        "#SBATCH --requeue",
        "export NCCL_NVLS_ENABLE=0",
    ):
        assert line in text, (line, text)
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert "--container-image=/img.sqsh" in srun and "--container-mounts=/data:/data" in srun
    assert launcher._extra_overrides(str(tmp_path / "3")) == [
        "checkpoint.resume=auto",
        f"checkpoint.dir='{tmp_path / '3' / 'checkpoints'}'",
    ]


def test_local_jobs_running_at_once_get_disjoint_gpus():
    assert visible_gpu_ids(None, 4) == [0, 1, 2, 3] and visible_gpu_ids("2, 5", 8) == [2, 5]
    assert visible_gpu_ids("", 8) == []
    assert gpu_slots(list(range(8)), 2, 3) == [(0, 1), (2, 3), (4, 5)]
    assert gpu_slots(list(range(8)), 4, 3) == [(0, 1, 2, 3), (4, 5, 6, 7)]  # GPUs for two at once
    assert gpu_slots([], 0, 2) == [(), ()]  # CPU jobs
    with pytest.raises(ValueError, match="needs 4 GPUs .* but 2 are visible"):
        gpu_slots([0, 1], 4, 1)
    with pytest.raises(ValueError, match="numeric GPU ids"):
        visible_gpu_ids("GPU-abc", 1)


def test_a_progress_line_is_printed_after_sweep_json_holds_what_it_says(tmp_path):
    """Someone who reads "job #1 started" and then opens sweep.json finds the job running there:
    the launcher rewrites the file before it prints the lines it read off the job files."""
    from types import SimpleNamespace

    from hydra_plugins.relax_gdn_launcher.launcher import _SweepLauncher, log

    manifest = SweepManifest(tmp_path)
    manifest.update_job(1, status="submitted", variant="default", run_dir=str(tmp_path / "1"))
    manifest.merge()
    launcher = SimpleNamespace(_progress=SweepProgress())
    _SweepLauncher._report(launcher, manifest)  # the submitted job: the tally only
    manifest.update_job(1, status="running", started=1.0)

    seen_in_file: dict[str, str] = {}

    class ReadTheFile(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "started" in record.getMessage():
                seen_in_file["status"] = json.loads((tmp_path / "sweep.json").read_text())["jobs"][0][
                    "status"
                ]

    handler, level = ReadTheFile(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        _SweepLauncher._report(launcher, manifest)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert seen_in_file == {"status": "running"}
