"""Saving never loses work, resume=auto continues the run, bad checkpoints get one message (CPU).

* kill -9 of the whole run (its process group) at a seeded random step, while shards are being
  written, and between the rename of a checkpoint and the ``latest`` marker; then the same
  command with ``checkpoint.resume=auto`` finishes the run: its ``metrics.jsonl`` (one file, the
  steps logged after the last checkpoint dropped) equals the uninterrupted run's, step by step.
* ``keep_last``, ``latest``, a damaged newest checkpoint skipped by resume=auto, a changed
  schedule refused or applied, W&B offline continuing the same run id.
* ``python train.py`` with a truncated shard, a garbage index, an unwritable checkpoint.dir and a
  per-rank torch.save checkpoint: exit code 2, one message naming the path, no traceback.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.distributed import JobResults, child_env, job_runtime, rank_process_context
from tests.helpers import TYPO_MESSAGE
from tests.helpers import small_config as _cfg
from tests.processes import ChildLines, output_lines

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def _lifecycle_cfg(case_dir: Path, **dotted):
    # 4 samples a step (small_config's 8 halved): what these runs check is where they stop, what they
    # leave on disk and how they resume, not the batch
    return _cfg(
        **{
            "train__global_batch_size": 4,
            "data__num_samples": 64,
            "train__steps": STEPS,
            "checkpoint__every_steps": 2,
            "checkpoint__keep_last": 2,
            "checkpoint__dir": str(case_dir / "checkpoints"),
            "checkpoint__resume": "auto",
            **dotted,
        }
    )


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _kill_whole_run() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)  # this process and the checkpoint writer's helper


def _run_killed(case_dir: str, kill_point: str, kill_step: int) -> None:
    """A run that kills its own process group at ``kill_point`` (in a fresh process group)."""
    os.setpgid(0, 0)
    import torch

    torch.set_num_threads(1)  # as the runs it is compared with
    from relax_gdn.runtime import Runtime
    from relax_gdn.train import checkpoint, loggers, run_training
    from tests.train_with_faults import on_checkpoint_write

    runtime = Runtime().install()  # set up like an entry point's process; the kill ends it
    if kill_point == "after_step":
        log = loggers.RunLoggers.log

        def log_then_kill(self, record):
            log(self, record)
            if record["step"] == kill_step:
                _kill_whole_run()

        loggers.RunLoggers.log = log_then_kill
    elif kill_point == "writing_shards":
        on_checkpoint_write(str(kill_step), _kill_whole_run)
    elif kill_point == "before_latest":
        replace = os.replace

        def replace_then_kill(src, dst):
            if Path(dst).name == checkpoint.LATEST and f"step_{kill_step:06d}" in Path(src).read_text():
                _kill_whole_run()
            replace(src, dst)

        checkpoint.os.replace = replace_then_kill
    case_dir = Path(case_dir)
    run_training(_lifecycle_cfg(case_dir), case_dir / "run", runtime=runtime)
    raise AssertionError("the run was not killed")


def _uninterrupted_run(tmp: str) -> dict:
    from relax_gdn.train import run_training

    tmp = Path(tmp)
    run_training(_lifecycle_cfg(tmp / "uninterrupted"), tmp / "uninterrupted" / "run", runtime=job_runtime())
    return {"uninterrupted": _metrics(tmp / "uninterrupted" / "run")}


def _finish_run(tmp: str, case: str) -> dict:
    """A killed run again with the same command (resume=auto)."""
    from relax_gdn.train import run_training

    tmp = Path(tmp)
    before = sorted(p.name for p in (tmp / case / "checkpoints").iterdir())
    result = run_training(_lifecycle_cfg(tmp / case), tmp / case / "fresh_hydra_dir", runtime=job_runtime())
    return {
        case: dict(
            before=before,
            start=result.start_step,
            run_dir=str(result.run_dir),
            metrics=_metrics(tmp / case / "run"),
            after=sorted(p.name for p in (tmp / case / "checkpoints").iterdir()),
        )
    }


KILL_CASES = {  # name: (kill point, step)
    "after_step": ("after_step", random.Random(17).randint(3, STEPS - 1)),  # a seeded random step
    "writing_shards": ("writing_shards", 4),
    "before_latest": ("before_latest", 4),
}


class _KilledAndFinished(Mapping):
    """``self[case]``: that case's run killed (a process of its own: it kills its process group),
    then finished on the pool; ``self["uninterrupted"]``: the reference run's metrics. Each is made
    when a test first reads it."""

    def __init__(self, tmp: Path, run):
        self._tmp, self._run, self._killed = tmp, run, {}

    def _kill(self, case: str) -> None:
        if case not in self._killed:
            point, step = KILL_CASES[case]
            process = rank_process_context().Process(
                target=_run_killed, args=(str(self._tmp / case), point, step)
            )
            process.start()
            process.join(600)
            if process.is_alive():
                process.kill()
                process.join(60)
            self._killed[case] = process.exitcode
        assert self._killed[case] == -signal.SIGKILL, (case, self._killed[case])

    def __getitem__(self, key: str) -> dict:
        if key == "uninterrupted":
            return self._run(_uninterrupted_run, 1, str(self._tmp))[0][key]
        self._kill(key)
        return self._run(_finish_run, 1, str(self._tmp), key)[0][key]

    def __iter__(self):
        return iter(["uninterrupted", *KILL_CASES])

    def __len__(self) -> int:
        return 1 + len(KILL_CASES)


@pytest.fixture(scope="module")
def killed_and_finished(gloo_once, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("killed")
    return tmp, _KilledAndFinished(tmp, gloo_once)


@pytest.mark.parametrize("case", list(KILL_CASES))
def test_kill_9_then_resume_auto_repeats_the_uninterrupted_run(killed_and_finished, case):
    tmp, out = killed_and_finished
    reference, finished = out["uninterrupted"], out[case]
    assert [r["step"] for r in finished["metrics"]] == list(range(1, STEPS + 1))  # one file, no repeats
    for got, want in zip(finished["metrics"], reference):
        assert (got["loss"], got["lr"], got["tokens"]) == (want["loss"], want["lr"], want["tokens"]), (
            case,
            got,
        )
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-12), (case, got)  # a float64 sum
    assert finished["run_dir"] == str(tmp / case / "run")  # the checkpoint's run directory, not the new one
    assert finished["after"] == ["latest", "step_000004", "step_000006"]  # keep_last=2, no partial left


def test_what_the_kill_left_behind(killed_and_finished):
    out = killed_and_finished[1]
    step = KILL_CASES["after_step"][1]
    assert out["after_step"]["start"] == 2 * (
        (step - 1) // 2
    )  # killed after logging, before that step's save
    # killed while writing step 4: step 2 is the newest complete checkpoint, step 4 never visible
    assert out["writing_shards"]["before"] == [".step_000004.partial", "latest", "step_000002"]
    assert out["writing_shards"]["start"] == 2
    # killed after the rename, before latest was replaced: latest still names step 2, and the
    # resume follows latest (rank 0 reads it; a scan only when it is missing or damaged), so step
    # 4, complete but never named, is trained and saved again
    assert out["before_latest"]["before"] == [".latest.tmp", "latest", "step_000002", "step_000004"]
    assert out["before_latest"]["start"] == 2


# ------------------------------------------------------------------ one process: resume=auto details


def _auto_resume_cases(tmp: str) -> dict:
    import logging

    import torch

    from relax_gdn.errors import RecipeError
    from relax_gdn.train import run_training

    torch.set_num_threads(1)
    tmp = Path(tmp)
    out = {}
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger, collect = logging.getLogger("relax_gdn.train"), Collect()
    level = logger.level
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    os.environ["WANDB_DIR"] = str(tmp / "wandb")
    os.environ["WANDB_SILENT"] = "true"
    (tmp / "wandb").mkdir()
    wandb = dict(mode="offline", project="relax-gdn-test", entity=None, group=None, tags=[], name=None)

    first = run_training(
        _lifecycle_cfg(tmp, train__steps=4, optim__decay_steps=6, logging__wandb=wandb),
        tmp / "run",
        runtime=job_runtime(),
    )
    out["fresh_note"] = [m for m in messages if "starting fresh" in m]
    out["first_id"] = first.wandb_dir
    # damage the newest checkpoint (step 4): resume=auto falls back to step 2, saying so
    shard = next((tmp / "checkpoints" / "step_000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    messages.clear()
    second = run_training(
        _lifecycle_cfg(tmp, optim__decay_steps=6, logging__wandb=wandb),
        tmp / "other_run",
        runtime=job_runtime(),
    )
    out["fallback_notes"] = [m for m in messages if "falling back" in m]
    out["resumed_notes"] = [m for m in messages if m.startswith("resumed from step")]
    out["second_start"], out["second_wandb_dir"] = second.start_step, second.wandb_dir
    out["metrics_steps"] = [r["step"] for r in _metrics(tmp / "run")]

    # a changed schedule (train.steps decides decay_steps here) is refused, or applied on request
    longer = _lifecycle_cfg(tmp, train__steps=8)
    try:
        run_training(longer, tmp / "run", runtime=job_runtime())
        out["refused"] = None
    except RecipeError as e:
        out["refused"] = str(e)
    messages.clear()
    applied = run_training(
        _lifecycle_cfg(
            tmp, train__steps=8, optim__reset_schedule_on_resume=True, checkpoint__export_hf_final=True
        ),
        tmp / "run",
        runtime=job_runtime(),
    )
    out["applied"] = (
        applied.start_step,
        [m for m in messages if "schedule changed" in m],
        [r["lr"] for r in applied.records],
    )
    out["export_files"] = sorted(p.name for p in (tmp / "run" / "hf").iterdir())
    out["export_config"] = json.loads((tmp / "run" / "hf" / "config.json").read_text())
    from relax_gdn.data import load_tokenizer

    out["tokenizer_vocab"] = load_tokenizer(None).vocab_size
    logger.removeHandler(collect)  # the pool's rank runs other jobs after this one
    logger.setLevel(level)
    return out


def _full_disk(tmp: str) -> dict:
    """A save whose shard write fails (a full disk) at step 4: one message naming it, step 2 intact."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from relax_gdn.errors import RecipeError
    from relax_gdn.train import run_training

    tmp = Path(tmp)
    out = {}
    write = FileSystemWriterAsync.write_preloaded_data

    def no_space_at_step_4(*args, **kwargs):
        if kwargs["write_bucket"][0].count("step_000004"):
            raise OSError(28, "No space left on device")
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(no_space_at_step_4)
    try:
        run_training(_lifecycle_cfg(tmp / "full_disk"), tmp / "full_disk" / "run", runtime=job_runtime())
        out["save_failed"] = None
    except RecipeError as e:
        out["save_failed"] = str(e)
    finally:
        FileSystemWriterAsync.write_preloaded_data = staticmethod(write)
    out["after_failed_save"] = sorted(p.name for p in (tmp / "full_disk" / "checkpoints").iterdir())
    return out


@pytest.fixture(scope="module")
def auto_resume(gloo_once, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto")
    scenario = (
        "fresh_note",
        "first_id",
        "fallback_notes",
        "resumed_notes",
        "second_start",
        "second_wandb_dir",
        "metrics_steps",
        "refused",
        "applied",
        "export_files",
        "export_config",
        "tokenizer_vocab",
    )
    jobs = {
        **{key: (_auto_resume_cases, 1, str(tmp)) for key in scenario},
        **{key: (_full_disk, 1, str(tmp)) for key in ("save_failed", "after_failed_save")},
    }
    return tmp, JobResults(gloo_once, jobs)


def test_resume_auto_starts_fresh_then_falls_back_past_a_damaged_checkpoint(auto_resume):
    tmp, out = auto_resume
    assert len(out["fresh_note"]) == 1 and str(tmp / "checkpoints") in out["fresh_note"][0]
    (note,) = out["fallback_notes"]
    assert "step_000004" in note and "is truncated" in note
    assert out["resumed_notes"] == [f"resumed from step 2 ({tmp / 'checkpoints' / 'step_000002'})"]
    assert out["second_start"] == 2
    assert out["metrics_steps"] == [1, 2, 3, 4, 5, 6]


def test_resumed_run_continues_the_same_wandb_run(auto_resume):
    out = auto_resume[1]
    # offline runs live in .../offline-run-<time>-<id>/files: the same id both times
    assert out["first_id"] and out["second_wandb_dir"]
    assert (
        Path(out["first_id"]).parent.name.split("-")[-1]
        == Path(out["second_wandb_dir"]).parent.name.split("-")[-1]
    )


def test_export_hf_final_writes_a_transformers_directory_after_the_last_step(auto_resume):
    out = auto_resume[1]
    # the embedded tokenizer as a Hugging Face one, and the end-of-turn token for generate()
    assert out["export_files"] == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert out["export_config"]["vocab_size"] == out["tokenizer_vocab"]  # the padded rows trimmed


def test_failed_save_names_the_checkpoint_and_keeps_the_previous_one(auto_resume):
    tmp, out = auto_resume
    message = out["save_failed"]
    assert message is not None and str(tmp / "full_disk" / "checkpoints" / "step_000004") in message
    assert "No space left on device" in message and re.search(r"[0-9.]+ [MG]iB free there", message)
    assert "checkpoint.resume=auto" in message and "Traceback" not in message
    assert out["after_failed_save"] == [".step_000004.partial", "latest", "step_000002"]


@pytest.mark.parametrize(
    "every,keep,steps,held", [(2, 3, 6, 4), (2, 3, 2, 2), (0, 3, 6, 1), (5, 0, 12, 3), (4, 1, 100, 2)]
)
def test_checkpoints_held_at_once(every, keep, steps, held):
    from relax_gdn.config import RunConfig
    from relax_gdn.train.checkpoint_disk import checkpoints_held_at_once

    cfg = RunConfig().with_overrides({"checkpoint.every_steps": every, "checkpoint.keep_last": keep})
    assert checkpoints_held_at_once(cfg.checkpoint, steps) == held


def test_changed_schedule_is_refused_unless_asked_for(auto_resume):
    out = auto_resume[1]
    assert (
        "optim.reset_schedule_on_resume=true" in out["refused"] and "lr_decay_steps 6 -> 8" in out["refused"]
    )
    start, notes, lrs = out["applied"]
    assert start == 6 and len(notes) == 1 and len(lrs) == 2
    assert lrs[-1] == pytest.approx(3e-4)  # the new schedule reaches min_lr at its own last step


# ------------------------------------------------------------------ python train.py: bad checkpoints


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = child_env()
    small = (
        "train.global_batch_size=4",
        "data.num_samples=64",
        "data.synthetic_max_steps=1",
        "optim.warmup_steps=1",
        "optim.decay_steps=4",
    )
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}", *small, *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def saved_checkpoint(short_train_py) -> Path:
    """The last checkpoint of the session's 3-step ``python train.py`` run (tests/conftest.py: the
    batch and data of ``_train``'s runs, which resume it for a 4th step)."""
    done, run, _, _ = short_train_py("3 steps")
    assert done.returncode == 0, done.stderr[-3000:]
    return run / "checkpoints" / "step_000003"


def _damaged_copy(saved: Path, tmp_path: Path, damage) -> Path:
    import shutil

    copy = tmp_path / "ckpt" / saved.name
    shutil.copytree(saved, copy)
    return damage(copy)


def _truncate_shard(directory: Path) -> Path:
    shard = next(directory.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard


def _garbage_index(directory: Path) -> Path:
    (directory / ".metadata").write_bytes(b"not a pickle at all")
    return directory / ".metadata"


def _garbage_manifest(directory: Path) -> Path:
    (directory / "relax_gdn.json").write_text("{ half a json")
    return directory / "relax_gdn.json"


def _per_rank_torch_save_files(directory: Path) -> Path:
    import shutil

    old = directory.parent / "step_000002"
    old.mkdir()
    (old / "rank_00000.pt").write_bytes(b"\x80")
    (old / "meta.json").write_text("{}")
    shutil.rmtree(directory)
    return old / "rank_00000.pt"


@pytest.mark.parametrize(
    "damage",
    [_truncate_shard, _garbage_index, _garbage_manifest, _per_rank_torch_save_files],
    ids=["truncated_shard", "garbage_index", "garbage_manifest", "per_rank_torch_save"],
)
def test_bad_checkpoint_exits_2_naming_the_file(saved_checkpoint, tmp_path, damage):
    path = _damaged_copy(saved_checkpoint, tmp_path, damage)
    done = _train(tmp_path, "train.steps=4", f"checkpoint.resume={path.parent}")
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert str(path) in text and "Traceback" not in text, text[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_optimizer_state_of_another_kind_exits_2_naming_the_fix(saved_checkpoint, tmp_path):
    copy = _damaged_copy(saved_checkpoint, tmp_path, lambda directory: directory)
    manifest = json.loads((copy / "relax_gdn.json").read_text())
    assert manifest["optimizer"] == {"kind": "cpu_adamw"}
    manifest["optimizer"] = {"kind": "megatron", "sharding": "dp_reshardable"}  # as a GPU run writes it
    (copy / "relax_gdn.json").write_text(json.dumps(manifest))
    done = _train(tmp_path, "train.steps=4", f"checkpoint.resume={copy}")
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert f"checkpoint {copy} holds Megatron-Core's distributed optimizer state" in text, text[-3000:]
    assert "relax_gdn.export_hf" in text and "Traceback" not in text


@pytest.mark.parametrize(
    "sharding,saved_tp,tp,refused",
    [("dp_reshardable", 2, 1, True), ("dp_reshardable", 1, 1, False), ("fully_reshardable", 2, 1, False)],
)
def test_dp_reshardable_optimizer_state_is_refused_at_another_tp(sharding, saved_tp, tp, refused):
    from relax_gdn.train.resume import optimizer_reshard_problem

    manifest = {
        "optimizer": {"kind": "megatron", "sharding": sharding},
        "layout": {"world_size": 2, "tp": saved_tp, "cp": 2 // saved_tp, "dynamic_cp": False, "max_cp": 1},
    }
    layout = {"world_size": 2, "tp": tp, "cp": 2 // tp, "dynamic_cp": True, "max_cp": 2}
    problem = optimizer_reshard_problem(
        Path("/ckpt/step_000004"), manifest, {"kind": "megatron", "sharding": "dp_reshardable"}, layout
    )
    if refused:
        assert problem.startswith(
            "checkpoint /ckpt/step_000004 was written at TP 2 with "
            "checkpoint.optimizer_sharding=dp_reshardable"
        )
        assert "parallel.tp=2 with checkpoint.optimizer_sharding=fully_reshardable" in problem
    else:
        assert problem is None


def test_unwritable_checkpoint_dir_exits_2_before_step_1(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("checkpoint.dir cannot be created under a file")
    done = _train(tmp_path, "train.steps=2", "checkpoint.every_steps=1", f"checkpoint.dir={blocker / 'ckpt'}")
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert f"checkpoint.dir={str(blocker / 'ckpt')!r} cannot be written" in text and "Traceback" not in text
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_sigusr1_saves_then_exits_75_without_a_traceback(tmp_path):
    env = child_env()
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        f"hydra.run.dir={tmp_path / 'run'}",
        "train.steps=40",
        "train.global_batch_size=4",
        "data.num_samples=64",
        "data.synthetic_max_steps=1",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.resume=auto",
    ]
    process = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    for line in output_lines(process, timeout_s=300):  # the console prints one line per step
        lines.append(line)
        if "step 2/40" in line:
            process.send_signal(signal.SIGUSR1)
    text = "".join(lines)
    assert process.wait(timeout=300) == 75, text[-3000:]
    assert "preempted after step" in text and "Traceback" not in text, text[-3000:]
    saved = (tmp_path / "ckpt" / "latest").read_text().strip()
    stopped_after = int(saved.removeprefix("step_"))
    assert 2 <= stopped_after < 40 and f"step {stopped_after + 1}/40" not in text


@pytest.mark.parametrize("launcher", ["torch.distributed.run", "relax_gdn.launch"])
def test_sigusr1_under_torchrun_saves_then_the_workers_exit_75(tmp_path, launcher):
    import psutil

    env = child_env({"PYTHONPATH": str(ROOT)})
    command = [
        sys.executable,
        "-m",
        launcher,
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "train.py"),
        f"hydra.run.dir={tmp_path / 'run'}",
        "parallel.cp=2",
        "train.steps=40",
        "train.global_batch_size=4",
        "data.num_samples=64",
        "data.synthetic_max_steps=1",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.resume=auto",
    ]
    torchrun = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    for line in output_lines(torchrun, timeout_s=300):
        lines.append(line)
        if "step 2/40" in line:  # as SLURM does: the signal goes to the workers, not to torchrun
            for worker in psutil.Process(torchrun.pid).children():
                worker.send_signal(signal.SIGUSR1)
    rc = torchrun.wait(timeout=300)
    text = "".join(lines)
    assert "preempted after step" in text and (tmp_path / "ckpt" / "latest").is_file()
    if launcher == "relax_gdn.launch":  # the workers' code, without torchrun's report
        assert rc == 75 and "Traceback" not in text and "exitcode" not in text, text[-3000:]
        return
    # torchrun's report names the first worker to exit (75); it sends SIGTERM to a worker still
    # tearing down, after the checkpoint (a collective) is complete
    assert "exitcode  : 75" in text, text[-3000:]
    # the one traceback is torchrun's own report of the non-zero exits, none from a worker
    assert text.count("Traceback") == 1 and "ChildFailedError" in text, text[-3000:]


# ------------------------------------------------------------ stopped, resumed, finished, run again

FINISHED_STEPS = 8
_LOG_LINE_START = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\[")


def _run_command(tmp: Path, run: str) -> list[str]:
    """The README's command for a run that saves and continues (``checkpoint.resume=auto``), small,
    its run directory named; the same every time it is started again."""
    return [
        f"hydra.run.dir={tmp / run}",
        f"train.steps={FINISHED_STEPS}",
        "train.global_batch_size=4",
        "data.num_samples=64",
        "data.synthetic_max_steps=1",
        "optim.warmup_steps=1",
        "checkpoint.every_steps=1",
        f"checkpoint.dir={tmp / 'checkpoints' / 'job'}",
        "checkpoint.resume=auto",
        "checkpoint.export_hf_final=true",
    ]


def _in_a_terminal(command: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """Run ``command`` with a pseudo-terminal as its stdout and stderr (so rank 0 draws its
    progress bar); its exit code and everything it wrote, each read bounded by ``timeout``."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    process = subprocess.Popen(
        command, cwd=cwd, env=child_env(), stdin=subprocess.DEVNULL, stdout=follower, stderr=follower
    )
    os.close(follower)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], timeout)
            assert ready, (
                f"no output within {timeout} s:\n" + b"".join(chunks).decode(errors="replace")[-3000:]
            )
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        return process.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(leader)
        if process.poll() is None:
            process.kill()


def _fake_slurm(tmp: Path) -> Path:
    """``srun`` and ``scontrol`` for running slurm/train.sbatch on this machine (no SLURM here):
    srun runs its command once, here, and notes that it ran; scontrol names this host."""
    bin_dir = tmp / "fake_slurm"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(
        '#!/bin/bash\ntouch "$(dirname "$0")/srun_ran"\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n'
    )
    (bin_dir / "scontrol").write_text("#!/bin/bash\n[[ $1 == show ]] && echo localhost\nexit 0\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def _sbatch(tmp: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``slurm/train.sbatch`` as SLURM would start it on one node with 2 GPUs (2 CPU processes here)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake = _fake_slurm(tmp)
    env = child_env(
        {
            "PATH": f"{fake}:{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT),
            "PYTHON": sys.executable,
            "SLURM_SUBMIT_DIR": str(ROOT),
            "SLURM_JOB_ID": "1",
            "SLURM_JOB_NAME": "job",
            "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": "localhost",
            "GPUS_PER_NODE": "2",
            "CHECKPOINT_ROOT": str(tmp / "checkpoints"),
            "RDZV_PORT": str(port),
        }
    )
    return subprocess.run(
        ["bash", str(ROOT / "slurm" / "train.sbatch"), *overrides],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run stopped by SIGTERM after step 2; the same command again (in a terminal) finishes it;
    again: nothing to do; then, its export removed, as a requeued SLURM job on 2 processes."""
    tmp = tmp_path_factory.mktemp("finished")
    out = {}
    train = [sys.executable, str(ROOT / "train.py")]
    first = subprocess.Popen(
        [*train, *_run_command(tmp, "run1")],
        cwd=tmp,
        env=child_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines = ChildLines(first, timeout_s=600)
    try:
        lines.wait_for(rf"step 2/{FINISHED_STEPS}")
        first.send_signal(signal.SIGTERM)
        out["stopped_rc"] = first.wait(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    lines.all()
    out["stopped_log"] = (tmp / "run1" / "train.log").read_text()
    out["resumed_rc"], out["terminal"] = _in_a_terminal(
        [*train, *_run_command(tmp, "run2")], tmp, timeout=300
    )
    out["resumed_dir"] = sorted(p.name for p in (tmp / "run2").iterdir())
    out["metrics"] = (tmp / "run1" / "metrics.jsonl").read_text()
    out["log"] = (tmp / "run1" / "train.log").read_text()
    out["again"] = subprocess.run(
        [*train, *_run_command(tmp, "run3")],
        cwd=tmp,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out["again_dir"] = sorted(p.name for p in (tmp / "run3").iterdir())
    out["again_metrics"] = (tmp / "run1" / "metrics.jsonl").read_text()
    out["again_log"] = (tmp / "run1" / "train.log").read_text()
    shutil.rmtree(tmp / "run1" / "hf")
    out["requeued"] = _sbatch(tmp, *_run_command(tmp, "run4"), "parallel.cp=2")
    out["requeued_export"] = sorted(p.name for p in (tmp / "run1" / "hf").iterdir())
    out["run1"] = sorted(p.name for p in (tmp / "run1").iterdir())
    return tmp, out


def test_a_stopped_run_resumed_keeps_one_log_in_its_run_directory(finished_run):
    tmp, out = finished_run
    assert out["stopped_rc"] == 75
    stopped_at = int(re.search(r"preempted after step (\d+)", out["stopped_log"]).group(1))
    assert 2 <= stopped_at < FINISHED_STEPS
    assert out["resumed_rc"] == 0, out["terminal"][-3000:]
    assert [json.loads(line)["step"] for line in out["metrics"].splitlines()] == list(
        range(1, FINISHED_STEPS + 1)
    )
    # the original train.log: the first part as it was, then the resumed part, in order
    log = out["log"]
    assert log.startswith(out["stopped_log"])
    resumed = log[len(out["stopped_log"]) :]
    marks = [
        f"resumed from step {stopped_at} ({tmp / 'checkpoints' / 'job' / f'step_{stopped_at:06d}'})",
        f"continuing run directory {tmp / 'run1'}",
        f"step_{FINISHED_STEPS:06d} saved",
        "Hugging Face export:",
    ]
    assert all(mark in resumed for mark in marks), resumed
    assert [resumed.index(mark) for mark in marks] == sorted(resumed.index(mark) for mark in marks)
    assert out["resumed_dir"] == [".hydra"]  # the new invocation's directory: Hydra's files only


def test_log_lines_start_on_their_own_line_below_a_progress_bar(finished_run):
    """In a terminal the resumed run draws its progress bar and logs its checkpoints while it is
    drawn: each log line starts a line (after a newline or rich's erase-line), never continuing
    the bar's text."""
    text = finished_run[1]["terminal"]
    starts = [m.start() for m in _LOG_LINE_START.finditer(text)]
    assert sum("checkpoint" in text[s : s + 120] and "saved" in text[s : s + 200] for s in starts) >= 3
    assert "\x1b[2K" in text and f"{FINISHED_STEPS}/{FINISHED_STEPS}" in text  # the bar was drawn
    continuing = [
        text[max(0, s - 40) : s + 60]
        for s in starts
        if s > 0 and not (text[:s].endswith("\n") or text[:s].endswith("\x1b[2K"))
    ]
    assert continuing == []


def test_a_finished_run_started_again_is_complete_with_nothing_to_do(finished_run):
    tmp, out = finished_run
    again = out["again"]
    assert again.returncode == 0, again.stderr[-3000:]
    complete = (
        f"complete at step {FINISHED_STEPS} "
        f"({tmp / 'checkpoints' / 'job' / f'step_{FINISHED_STEPS:06d}'}); nothing to do"
    )
    assert (again.stdout + again.stderr).count(complete) == 1, again.stdout[-3000:]
    assert "Traceback" not in again.stderr and not re.search(r"^error", again.stderr, flags=re.M)
    # nothing written: metrics, W&B and config untouched; the log line in the run's own train.log
    assert out["again_metrics"] == out["metrics"] and out["again_dir"] == [".hydra"]
    assert (
        out["again_log"].startswith(out["log"]) and out["again_log"][len(out["log"]) :].count(complete) == 1
    )


def test_a_requeued_slurm_job_of_a_finished_run_writes_the_missing_export_and_exits_0(finished_run):
    """slurm/train.sbatch (srun and scontrol stood in for: no SLURM here) on 2 processes, the run's
    export removed: the check, relax_gdn.launch, rank 0's one message, the export written, exit 0."""
    tmp, out = finished_run
    requeued = out["requeued"]
    assert requeued.returncode == 0, requeued.stdout[-3000:] + requeued.stderr[-3000:]
    assert (tmp / "fake_slurm" / "srun_ran").exists()
    text = requeued.stdout + requeued.stderr
    assert text.count(f"complete at step {FINISHED_STEPS} (") == 1
    assert f"nothing to train, writing its Hugging Face export to {tmp / 'run1' / 'hf'}" in text
    assert "model.safetensors" in out["requeued_export"] and "config.json" in out["requeued_export"]
    assert ".hf.partial" not in out["run1"]


def test_sbatch_checks_the_command_line_before_starting_any_worker(tmp_path):
    done = _sbatch(tmp_path, "train.stepz=3")
    assert done.returncode == 2
    assert re.findall(r"^error: .*", done.stderr, flags=re.M) == [TYPO_MESSAGE]
    assert not (tmp_path / "fake_slurm" / "srun_ran").exists() and "Traceback" not in done.stderr
