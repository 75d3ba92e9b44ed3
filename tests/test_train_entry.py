"""train.py through Hydra, as a user runs it (one process, CPU): a short run writes its resolved
config and metrics into the Hydra run directory (never into the package); an impossible config
exits with status 2 before step 1, naming the keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}", *overrides],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )


def test_short_run_writes_config_and_metrics_in_the_run_dir(tmp_path):
    before = sorted(p.name for p in (ROOT / "relax_gdn").rglob("*") if p.suffix in (".jsonl", ".yaml"))
    done = _train(tmp_path, "train.steps=2", "optim.warmup_steps=1", "train.global_batch_size=4",
                  "data.num_samples=64", "data.synthetic_max_steps=1", "run_name=entry-test")
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    assert {"config.yaml", "metrics.jsonl", ".hydra"} <= {p.name for p in run.iterdir()}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert "run_name: entry-test" in (run / "config.yaml").read_text()
    assert "step 2/2" in done.stdout
    after = sorted(p.name for p in (ROOT / "relax_gdn").rglob("*") if p.suffix in (".jsonl", ".yaml"))
    assert before == after  # nothing written into the package


def test_impossible_config_exits_before_training(tmp_path):
    done = _train(tmp_path, "parallel.cp=2", "gdn.cp_mode=all_gather")
    assert done.returncode == 2
    text = done.stdout + done.stderr
    assert "world size 1 is not divisible by parallel.tp x parallel.cp" in text
    run = tmp_path / "run"
    assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()
