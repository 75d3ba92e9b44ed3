"""What a user sees: a 3-step CPU run through train.py prints no third-party notices (and shows
them with logging.show_third_party_warnings=true), one plain line per step without redraws when
stdout is not a terminal, and one run summary; the terminal bar has elapsed time and ETA."""

from __future__ import annotations

import io
import re

import pytest

from relax_gdn.train.console import ConsoleProgress, print_run_summary, run_summary, steady_state
from relax_gdn.train.run_result import TrainResult

# What the third-party notices look like: warnings.warn lines (with the library's file path) and
# the log lines relax_gdn.known_warnings names.
# The quiet run also profiles a step: on CPU torch.profiler's C++ backend prints nothing of its own
# (its USDT markers, "gpuGetDeviceCount failed with code 35").
THIRD_PARTY = re.compile(
    r"Warning: |site-packages|IS DEPRECATED|No CUDA runtime|Megatron-FSDP|decay style|"
    r"gpuGetDeviceCount|USDT:"
)


@pytest.fixture(scope="module")
def quiet_and_loud(short_train_py):
    """The session's 3-step train.py run (step 2 profiled), and its 1-step run with
    logging.show_third_party_warnings=true (on a .jsonl file)."""
    quiet, run_dir, _, _ = short_train_py("3 steps")
    quiet.trace = run_dir / "traces" / "rank0_steps2-2.json"
    return quiet, short_train_py("1 step on jsonl, third-party notices")[0]


def test_three_step_run_prints_no_third_party_notices_and_one_summary(quiet_and_loud):
    quiet, loud = quiet_and_loud
    assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr[-3000:] + loud.stderr[-3000:]
    lines = (quiet.stdout + quiet.stderr).splitlines()
    assert [line for line in lines if THIRD_PARTY.search(line)] == []
    # the switch brings them back (and so the pattern above does see them when they are there)
    assert len([line for line in (loud.stdout + loud.stderr).splitlines() if THIRD_PARTY.search(line)]) >= 3
    assert quiet.stdout.count("run summary") == 1
    assert quiet.trace.stat().st_size > 0  # the profiled step's trace is written all the same
    summary = quiet.stdout[quiet.stdout.index("run summary") :]
    for label in (
        "steps",
        "tokens",
        "median tok/s",
        "median MFU",
        "peak memory",
        "loss",
        "run directory",
        "metrics",
    ):
        assert re.search(rf"^  {re.escape(label)} +\S", summary, re.M), (label, summary)


def test_non_terminal_output_is_plain_lines_without_redraws(quiet_and_loud):
    quiet, _ = quiet_and_loud
    assert "\r" not in quiet.stdout and "\x1b" not in quiet.stdout
    steps = [line for line in quiet.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/3", "2/3", "3/3"]
    assert all(" eta " in line and " elapsed " in line for line in steps)


def _record(step: int, **extra) -> dict:
    return dict(
        step=step,
        loss=5.0 - step,
        grad_norm=1.0,
        lr=1e-3,
        tokens=100,
        tokens_per_s=1000.0 * step,
        tflops_per_gpu=1.0,
        mfu=0.1 * step,
        step_time_s=0.1,
        peak_mem_gb=2.0 + step,
        **extra,
    )


def test_terminal_bar_shows_elapsed_eta_loss_and_throughput():
    stream = io.StringIO()
    console = ConsoleProgress(total_steps=4, stream=stream, terminal=True)
    for step in (1, 2):
        console.log(_record(step))
    console.log(_record(3, **{"eval/loss": 1.25}))
    console.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue())
    assert "3/4" in text and "eta" in text and re.search(r"\d:\d\d:\d\d", text)
    assert "loss 2" in text and "3000 tok/s" in text and "mfu 0.3" in text
    assert "step 3: eval/loss 1.25" in text


def test_summary_uses_the_steady_state_and_names_the_outputs(tmp_path):
    records = [_record(s) for s in range(1, 21)]
    records[-1]["eval/loss"] = 0.5
    assert [r["step"] for r in steady_state(records)] == list(range(4, 21))  # 10 %, at least 3: warm-up
    (tmp_path / "metrics.jsonl").write_text("")
    result = TrainResult(
        records=records,
        run_dir=tmp_path,
        checkpoints=[tmp_path / "checkpoints" / "step_000020"],
        wandb_dir=str(tmp_path / "wandb"),
    )
    rows = dict(run_summary(result))
    assert rows["median tok/s"].startswith("12,000")  # median of 4000..20000
    assert rows["median MFU"] == "1.2" and rows["peak memory"] == "22.0 GiB (rank 0)"
    assert rows["loss"] == "4 -> -15" and rows["eval loss"].startswith("0.5 (step 20")
    assert rows["checkpoints"] == f"{tmp_path / 'checkpoints'} (last: step_000020)"
    assert rows["metrics"] == str(tmp_path / "metrics.jsonl") and rows["W&B"] == str(tmp_path / "wandb")
    plain, table = io.StringIO(), io.StringIO()
    print_run_summary(result, stream=plain, terminal=False)
    print_run_summary(result, stream=table, terminal=True)
    assert "\x1b" not in plain.getvalue() and "median tok/s" in plain.getvalue()
    assert "median tok/s" in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", table.getvalue())
