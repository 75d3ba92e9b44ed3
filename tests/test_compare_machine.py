"""``python -m relax_gdn.compare`` on runs that shared a machine: each step record says when it
ended and where (``time``, ``host``, ``cpus``, ``load_1m``; relax_gdn.train.loggers.JsonlLogger).
Runs that overlapped in time on one host, or ran one after another on a host loaded far above its
cores, get a caution beside the tok/s verdict; runs on a quiet machine, on different hosts, or
without those fields (older files, benchmark JSON) get none."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from relax_gdn.compare.__main__ import main
from relax_gdn.config.schema import RunConfig
from relax_gdn.train.loggers import MACHINE_FIELDS, JsonlLogger

STEPS = 12
STEP_S = 2.0


def _write_run(run_dir: Path, mode: str, seed: int, *, start: float, host: str | None, load: float) -> None:
    """A run directory as a 2-process CPU run leaves it, its steps ``STEP_S`` apart from ``start``."""
    config = dataclasses.asdict(
        RunConfig().with_overrides({"parallel.cp": 2, "gdn.cp_mode": mode, "train.seed": seed})
    )
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    tps = 7000.0 if mode == "chunkwise" else 6200.0
    lines = []
    for step in range(1, STEPS + 1):
        record = {
            "step": step,
            "loss": 7.0 - 0.3 * step + 0.001 * seed,
            "grad_norm": 1.0,
            "lr": 1e-3,
            "tokens": 1400,
            "tokens_per_s": tps + 10 * seed,
            "mfu": None,
            "step_time_s": STEP_S,
            "world_size": 2,
        }
        if host is not None:
            record |= {"time": start + step * STEP_S, "host": host, "cpus": 2, "load_1m": load}
        lines.append(json.dumps(record) + "\n")
    (run_dir / "metrics.jsonl").write_text("".join(lines))


def _caution(tmp_path: Path, starts: dict[tuple[str, int], float], *, hosts=("vm", "vm"), load: float) -> str:
    """compare over headwise and chunkwise, seeds 1 and 2; the line of its verdict."""
    for n, ((mode, seed), start) in enumerate(starts.items()):
        host = hosts[0] if mode == "headwise" else hosts[1]
        _write_run(tmp_path / "sweep" / str(n), mode, seed, start=start, host=host, load=load)
    assert (
        main([str(tmp_path / "sweep"), "--out", str(tmp_path / "cmp"), "--baseline", "gdn.cp_mode=headwise"])
        == 0
    )
    (line,) = [
        x
        for x in (tmp_path / "cmp" / "summary.md").read_text().splitlines()
        if x.startswith("- gdn.cp_mode=chunkwise vs gdn.cp_mode=headwise: ")
    ]
    assert line.index("tok/s **") < line.index("loss curve")  # the verdict stays where it is
    return line


SEQUENTIAL = {("headwise", 1): 0.0, ("headwise", 2): 100.0, ("chunkwise", 1): 200.0, ("chunkwise", 2): 300.0}
SIDE_BY_SIDE = {("headwise", 1): 0.0, ("chunkwise", 1): 0.0, ("headwise", 2): 100.0, ("chunkwise", 2): 100.0}


def test_runs_at_the_same_time_on_one_machine_get_a_caution_beside_the_tok_s_verdict(tmp_path):
    line = _caution(tmp_path, SIDE_BY_SIDE, load=2.0)
    assert (
        "(**caution**: run 1 and the baseline's run 0 ran at the same time on vm (9 of 9 steady-state steps "
        "overlapped), sharing its 2 CPUs: the tok/s ratio measures that sharing as much as the code)"
    ) in line, line
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["comparisons"][0]["shared_machine"]["kind"] == "overlap"


def test_runs_one_after_another_on_a_loaded_machine_get_a_caution(tmp_path):
    line = _caution(tmp_path, SEQUENTIAL, load=6.3)
    assert (
        "(**caution**: the runs ran one after another on vm at a load of up to 6.3 on 2 CPUs: the tok/s "
        "ratio measures what else ran there as much as the code)"
    ) in line, line


@pytest.mark.parametrize("case", ["quiet machine", "two machines", "no machine fields"])
def test_runs_on_a_quiet_machine_or_apart_get_no_caution(tmp_path, case):
    if case == "no machine fields":  # records written before they said where
        line = _caution(tmp_path, SIDE_BY_SIDE, hosts=(None, None), load=6.3)
    elif case == "two machines":
        line = _caution(tmp_path, SIDE_BY_SIDE, hosts=("vm1", "vm2"), load=6.3)
    else:
        line = _caution(tmp_path, SEQUENTIAL, load=2.0)
    assert "caution" not in line, line


def test_the_jsonl_logger_writes_where_and_when(tmp_path):
    log = JsonlLogger(tmp_path / "metrics.jsonl")
    log.log({"step": 1, "loss": 2.0})
    log.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert set(MACHINE_FIELDS) <= set(record) and record["cpus"] >= 1 and record["time"] > 1.7e9
