"""Ctrl-C under ``python -m relax_gdn.launch`` (what ``make run`` starts), as a terminal sends it:
SIGINT to the job's whole process group (launcher and workers).

* One Ctrl-C under ``make run`` (2 workers): the step in progress finishes, its checkpoint is
  written, every worker and the launcher exit 130 (make reports the launcher's 130 and ends
  interrupted, which a shell reports as 130), a few lines after the signal, no traceback, W&B's
  offline run in one line, nothing left running.
* A second Ctrl-C while a checkpoint is being written: rank 0 says exactly what is saved (the
  checkpoint ``latest`` names) and what is not (the steps since, the cut-off save); a worker that
  cannot run its handler is killed after the grace, with its children; the job ends within 30 s.
* A Ctrl-C before any worker started: one line, exit 130.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from relax_gdn.errors import EXIT_CODE_FILE_ENV, INTERRUPTED_EXIT_CODE
from relax_gdn.launch import AT_ONCE_GRACE_S
from tests.distributed import child_env
from tests.processes import ChildLines, alive, descendants, output_lines, start_as_a_job, wait_until

ROOT = Path(__file__).resolve().parents[1]
SMALL = (
    "train.global_batch_size=4",
    "data.num_samples=64",
    "data.synthetic_max_steps=1",
    "optim.warmup_steps=1",
    "optim.decay_steps=40",
    "train.steps=40",
)
RUN_LIMIT_S = 600  # a 2-worker job on a loaded 2-core machine
AT_ONCE_LIMIT_S = 30  # the bound for a second Ctrl-C to end the job


def _start(command: list[str], tmp_path: Path, **env: str) -> subprocess.Popen:
    """In a session of its own: its process group is the job's, as a terminal's is; without the
    environment of a make that runs the tests (``make test``), as a command typed in a terminal."""
    environ = child_env({EXIT_CODE_FILE_ENV: str(tmp_path / "exit_code"), "PYTHONPATH": str(ROOT), **env})
    for name in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS"):  # else make says "make[1]:", as a sub-make
        environ.pop(name, None)
    return start_as_a_job(command, tmp_path, environ)


def _launch(tmp_path: Path, *overrides: str, faults: bool = False) -> list[str]:
    script = ROOT / "tests" / "train_with_faults.py" if faults else ROOT / "train.py"
    return [
        sys.executable,
        "-m",
        "relax_gdn.launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        f"hydra.run.dir={tmp_path / 'run'}",
        "parallel.cp=2",
        *SMALL,
        *overrides,
    ]


def _everything_below(pid: int) -> list[psutil.Process]:
    return descendants(pid)


@pytest.mark.slow
def test_ctrl_c_under_make_run_saves_the_step_and_ends_with_130(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()  # newer than pyproject.toml and requirements.lock: nothing installed
    args = " ".join([f"hydra.run.dir={tmp_path / 'run'}", *SMALL])
    make = _start(
        [
            "make",
            "--no-print-directory",
            "-C",
            str(ROOT),
            "run",
            f"VENV={venv}",
            f"PY={sys.executable}",
            f"ARGS={args}",
        ],
        tmp_path,
    )
    before, after, below = [], [], []
    for line in output_lines(make, timeout_s=RUN_LIMIT_S):
        (after if below else before).append(line)
        if not below and line.startswith("step 2/40"):
            below = _everything_below(make.pid)
            os.killpg(make.pid, signal.SIGINT)  # the terminal's Ctrl-C: make, the launcher, both workers
    text = "".join(after)
    assert make.wait(timeout=60) == -signal.SIGINT, "".join(before)[-3000:] + text  # a shell says 130
    assert len(after) <= 15 and "Traceback" not in text and "wandb:" not in text, text
    assert re.search(r"^make: \*\*\* \[.*run\] Error 130$", text, re.M), text  # relax_gdn.launch's code
    assert (
        text.count("relax-gdn: Ctrl-C: stopping after the step in progress, then saving a checkpoint") == 1
    ), text
    checkpoints = tmp_path / "run" / "checkpoints"
    saved = (checkpoints / "latest").read_text().strip()
    step = int(saved.removeprefix("step_"))
    assert f"stopped after step {step} (Ctrl-C), checkpoint {checkpoints / saved}; " in text, text
    assert f"step {step + 1}/40" not in text and sorted(p.name for p in checkpoints.iterdir()) == [
        "latest",
        saved,
    ]
    (wandb_line,) = [line for line in after if "W&B offline run" in line]
    assert re.search(r"W&B offline run (\S+); upload it with: wandb sync \1$", wandb_line.strip()), wandb_line
    assert (tmp_path / "exit_code").read_text().strip() == str(INTERRUPTED_EXIT_CODE)  # the workers' own
    assert len(below) >= 3 and not alive(below)  # the launcher, both workers and their helpers: gone


def _worker(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    (worker,) = [p for p in psutil.Process(launcher.pid).children() if p.environ().get("RANK") == str(rank)]
    return worker


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_saying_what_is_saved_and_kills_a_worker_that_cannot_stop(tmp_path):
    """The first Ctrl-C goes to the launcher alone (``kill -INT``), during the save of step 4: the
    launcher passes it on. Rank 1 is then stopped (SIGSTOP: like a worker stuck in a CUDA or NCCL
    call, it runs no handler) and the second Ctrl-C comes from the terminal: rank 0 says what is
    saved, rank 1 is killed after the grace."""
    gate = tmp_path / "gate"
    gate.mkdir()
    checkpoints = tmp_path / "run" / "checkpoints"
    job = _start(
        _launch(tmp_path, "checkpoint.every_steps=2", faults=True),
        tmp_path,
        RELAX_GDN_TEST_FAULTS=f"pause_save:4:{gate}",
    )
    lines = ChildLines(job, timeout_s=RUN_LIMIT_S)
    lines.wait_for(r"^step 4/40")
    wait_until(
        lambda: (gate / "saving.rank0").exists() and (gate / "saving.rank1").exists(),
        120,
        "both ranks writing the step-4 checkpoint",
    )
    os.kill(job.pid, signal.SIGINT)
    lines.wait_for(r"^relax-gdn: Ctrl-C: stopping after the step in progress, then saving a checkpoint")
    below = _everything_below(job.pid)
    _worker(job, 1).suspend()
    os.killpg(job.pid, signal.SIGINT)
    pressed = time.monotonic()
    assert job.wait(timeout=AT_ONCE_LIMIT_S) == INTERRUPTED_EXIT_CODE
    assert time.monotonic() - pressed <= AT_ONCE_LIMIT_S
    text = lines.all()
    after = text[text.index("relax-gdn: Ctrl-C: stopping") :].splitlines()
    assert "Traceback" not in text and len(after) <= 4, text[-3000:]
    assert sum(line.startswith("relax-gdn: Ctrl-C") for line in text.splitlines()) == 1
    partial, saved = checkpoints / ".step_000004.partial", checkpoints / "step_000002"
    assert after[1] == (
        f"relax-gdn: second Ctrl-C: stopped at once during step 4; saved: checkpoint {saved} (step 2), "
        f"checkpoint.resume={saved} continues from it; not saved: steps 3-4, the checkpoint being "
        f"written ({partial}, incomplete: never read, removed by the next save)"
    ), after
    assert re.fullmatch(
        rf"relax-gdn: second Ctrl-C: killed rank 1 \(pid \d+\), not stopped {AT_ONCE_GRACE_S:.0f} s "
        r"after being asked",
        after[2],
    ), after
    assert sorted(p.name for p in checkpoints.iterdir()) == [partial.name, "latest", saved.name]
    assert (checkpoints / "latest").read_text().strip() == saved.name
    assert len(below) >= 2 and not alive(below)  # both workers, and whatever ran below them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(pid: int, port: int) -> bool:
    try:
        return any(
            c.laddr.port == port and c.status == psutil.CONN_LISTEN
            for c in psutil.Process(pid).net_connections()
        )
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_ctrl_c_before_any_worker_started_ends_the_launcher_with_one_line(tmp_path):
    port = _free_port()
    # a rendezvous of 2 nodes with only this one: torchrun waits, no worker starts
    job = _start(
        [
            sys.executable,
            "-m",
            "relax_gdn.launch",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "ctrl-c-test",
            str(ROOT / "train.py"),
        ],
        tmp_path,
    )
    wait_until(lambda: _listening(job.pid, port), 120, "the launcher waiting in its rendezvous")
    os.killpg(job.pid, signal.SIGINT)
    out, _ = job.communicate(timeout=60)
    assert job.returncode == INTERRUPTED_EXIT_CODE, out
    assert (
        out.strip().splitlines()[-1] == "relax-gdn: Ctrl-C before the workers started: stopped, nothing ran"
    )
    assert "Traceback" not in out and not descendants(job.pid)
