"""train.py through Hydra, as a user runs it (one process, CPU): a short run writes its resolved
config and metrics into the Hydra run directory (never into the package); every bad input
(configuration or data) exits with status 2 and one message naming the key or file, no traceback,
and leaves no run directory behind."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import child_env
from tests.helpers import ROOT
from tests.helpers import train_py as _train


def test_short_run_writes_config_and_metrics_in_the_run_dir(short_train_py):
    done, run, before, after = short_train_py("3 steps")
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"config.yaml", "metrics.jsonl", ".hydra"} <= {p.name for p in run.iterdir()}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "run_name: entry-test" in (run / "config.yaml").read_text()
    assert "step 3/3" in done.stdout
    assert before == after  # nothing written into the package


def test_impossible_config_exits_before_training(tmp_path):
    done = _train(tmp_path, "parallel.cp=2", "gdn.cp_mode=all_gather")
    assert done.returncode == 2
    text = done.stdout + done.stderr
    assert "world size 1 is not divisible by parallel.tp x parallel.cp" in text
    run = tmp_path / "run"
    assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()


def _data_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# (overrides, what the one message must contain); {tmp} is the test's directory
BAD_INPUTS = {
    "append unknown key": (["+train.stepz=3"], ["'train.stepz'", "steps"]),
    "unknown key": (["train.stepz=3"], ["'train.stepz'", "steps"]),
    "unknown group": (["parallel.pp=2"], ["'parallel.pp'", "tp, cp"]),
    "float for a float": (["optim.lr=fast"], ["optim.lr=fast", "Float"]),
    "float for an int": (["train.steps=1.5"], ["train.steps=1.5", "Integer"]),
    "unknown group option": (["gdn=ringwise"], ["gdn=ringwise", "chunkwise"]),
    "unknown choice": (["gdn.route=eager"], ["gdn.route='eager'", "lazy_cache"]),
    "impossible combination": (["parallel.cp=2", "gdn.cp_mode=all_gather"], ["world size 1", "parallel.cp"]),
    "sp without tp": (["parallel.sp=true"], ["parallel.sp=true", "parallel.tp"]),
    "missing data file": (["data=jsonl", "data.path={tmp}/none.jsonl"], ["data.path=", "none.jsonl"]),
    "empty data file": (["data=jsonl", "data.path={tmp}/empty.jsonl"], ["empty.jsonl", "no records"]),
    "wrong field names": (["data=jsonl", "data.path={tmp}/fields.jsonl"],
                          ["fields.jsonl", "data.prompt_field", "['question', 'answer']"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_message_and_leaves_nothing(tmp_path, case):
    _data_file(tmp_path, "empty.jsonl", "")
    _data_file(tmp_path, "fields.jsonl", json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    overrides, needles = BAD_INPUTS[case]
    done = _train(tmp_path, *(o.format(tmp=tmp_path) for o in overrides))
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert "Traceback" not in text
    assert len(re.findall(r"^error: ", done.stderr, flags=re.M)) == 1, done.stderr
    for needle in needles:
        assert needle in done.stderr, (needle, done.stderr)
    assert not (tmp_path / "run").exists()  # nothing written: Hydra's run directory is gone too


def test_a_data_error_leaves_no_default_run_directory_behind(tmp_path):
    """Without hydra.run.dir, Hydra makes outputs/runs/<date>/<time>/; an attempt that fails
    while loading its data removes that and the empty parents made for it."""
    _data_file(tmp_path, "empty.jsonl", "")
    (tmp_path / "kept").mkdir()  # what was there before stays
    done = _train(tmp_path, "data=jsonl", f"data.path={tmp_path}/empty.jsonl", run_dir=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl", "kept"]


def test_a_typo_is_reported_before_torch_is_imported(tmp_path):
    done = _train(tmp_path, "train.stepz=3", python_flags=("-X", "importtime"))
    assert done.returncode == 2
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "omegaconf" in imported and "relax_gdn.config.validate" in imported
    for heavy in ("torch", "megatron", "fla", "wandb", "transformers"):
        assert heavy not in imported, heavy


def test_hydra_full_error_shows_the_traceback(tmp_path):
    done = _train(tmp_path, "train.steps=0", env={"HYDRA_FULL_ERROR": "1"})
    assert done.returncode != 0 and "Traceback" in done.stderr and "train.steps=0" in done.stderr


def test_under_torchrun_rank_zero_alone_reports_a_config_problem(tmp_path):
    env = child_env()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(ROOT / "train.py"),
         f"hydra.run.dir={tmp_path / 'run'}", "train.steps=0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode != 0
    assert re.findall(r"^(?:\[rank \d+\] )?error: .*", done.stderr, flags=re.M) == [
        "error: configuration problem: train.steps=0 must be an integer >= 1"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("steps", [1, 3])
def test_any_step_count_trains_with_the_default_warmup(short_train_py, steps):
    done, run, _, _ = short_train_py({1: "1 step, third-party notices", 3: "3 steps"}[steps])
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[0]["lr"] > 0  # no warm-up step at rate 0: 0.1 x 1 or 3 steps rounds to none


def test_jsonl_data_runs_on_the_demo_defaults_skipping_what_does_not_fit(tmp_path):
    records = [{"problem": f"What is {i} + {i}?", "generated_solution": f"{2 * i}"} for i in range(20)]
    records.append({"problem": "Repeat x.", "generated_solution": "x" * 3000})  # > 2048 byte tokens
    path = _data_file(tmp_path, "train.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    done = _train(tmp_path, "data=jsonl", f"data.path={path}", "train.steps=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "20/21 records kept; skipped: too_long=1" in done.stdout + done.stderr
