"""Benchmarks say what they need: each ``python -m relax_gdn.bench.X`` that needs CUDA (or N GPUs)
started where it cannot run prints one line on stderr naming what it needs and the command,
and exits 2 (no traceback, no third-party notices). Every benchmark module is listed here as
needing a GPU or not, so a new one is classified."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_gdn.bench.needs import gpu_problem
from tests.distributed import child_env

ROOT = Path(__file__).resolve().parents[1]
# module -> (arguments of the CPU-machine run, what its one line must say)
NEEDS_GPU = {
    "attention": (
        (),
        "needs a CUDA GPU; no CUDA GPU is visible here. Run it on a GPU host: "
        "python -m relax_gdn.bench.attention",
    ),
    "fused_ops": (
        (),
        "needs a CUDA GPU; no CUDA GPU is visible here. Run it on a GPU host: "
        "python -m relax_gdn.bench.fused_ops",
    ),
    "gemm": (
        (),
        "needs a CUDA GPU; no CUDA GPU is visible here. Run it on a GPU host: python -m relax_gdn.bench.gemm",
    ),
    "gdn_layer": (
        (),
        "needs 2 CUDA GPUs; no CUDA GPU is visible here. Run it on a GPU host: "
        "torchrun --nproc-per-node 2 -m relax_gdn.bench.gdn_layer",
    ),
    "swap": (
        (),
        "needs at least 2 CUDA GPUs; no CUDA GPU is visible here. Run it on a GPU host: "
        "torchrun --nproc-per-node 2 -m relax_gdn.bench.swap",
    ),
    "train_e2e": (
        ("--device", "cuda"),
        "needs a CUDA GPU; no CUDA GPU is visible here. Run it on a GPU host: "
        "python -m relax_gdn.bench.train_e2e",
    ),
    "peers": (
        ("--device", "cuda"),
        "needs a CUDA GPU; no CUDA GPU is visible here. Run it on a GPU host: "
        "python -m relax_gdn.bench.peers",
    ),
}
# train_e2e, peers: --device auto
RUNS_ON_CPU = {
    "batching",
    "fla_configs",
    "long_context",
    "gdn_precision",
    "gdn_runs",
    "routes",
    "train_e2e",
    "peers",
}
NOT_A_BENCHMARK = {"__init__", "needs", "timing", "trace_launchers", "hf_peer", "provenance"}


def test_every_benchmark_is_classified():
    modules = {p.stem for p in (ROOT / "relax_gdn" / "bench").glob("*.py")}
    assert modules == set(NEEDS_GPU) | RUNS_ON_CPU | NOT_A_BENCHMARK
    readme = (ROOT / "README.md").read_text()
    for module in set(NEEDS_GPU) - {"train_e2e"}:  # the README's list marks them
        (line,) = [line for line in readme.splitlines() if f"relax_gdn.bench.{module} " in line]
        assert "GPU" in line, line


@pytest.mark.parametrize("module", sorted(NEEDS_GPU))
def test_gpu_benchmark_on_a_machine_without_gpus_is_one_line_and_exit_2(module, tmp_path):
    args, says = NEEDS_GPU[module]
    done = subprocess.run(
        [sys.executable, "-m", f"relax_gdn.bench.{module}", *args],
        cwd=tmp_path,
        env=child_env({"PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [f"error: relax_gdn.bench.{module} {says}"], done.stderr[-3000:]
    assert done.stdout == ""


def test_gpu_needs_count_gpus_and_processes():
    assert gpu_problem("m", 1, False, visible=1, world_size=None) is None
    assert gpu_problem("m", 2, False, visible=8, world_size=2) is None
    assert gpu_problem("m", 2, True, visible=8, world_size=4) is None  # at least 2
    assert gpu_problem("m", 2, False, visible=1, world_size=None) == (
        "m needs 2 CUDA GPUs; 1 are visible here. Run it on a GPU host: torchrun --nproc-per-node 2 -m m"
    )
    started_alone = "m runs as 2 processes, one per GPU: torchrun --nproc-per-node 2 -m m"
    assert gpu_problem("m", 2, False, visible=2, world_size=None) == started_alone  # plain python
    assert gpu_problem("m", 2, False, visible=8, world_size=4) == started_alone  # exactly 2
    assert gpu_problem("m", 2, True, visible=8, world_size=1) == started_alone


def test_cuda_alloc_conf_is_set_before_cuda_starts_and_refused_after(monkeypatch, capsys):
    import argparse

    import torch

    from relax_gdn.bench.needs import add_cuda_alloc_conf, apply_cuda_alloc_conf

    parser = argparse.ArgumentParser(prog="bench")
    add_cuda_alloc_conf(parser)
    args = parser.parse_args(["--cuda-alloc-conf", "expandable_segments:True"])
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    apply_cuda_alloc_conf(parser, None)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    apply_cuda_alloc_conf(parser, args.cuda_alloc_conf)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    # a process whose CUDA has started would read it too late: one parser error, exit 2
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(SystemExit) as exit_:
        apply_cuda_alloc_conf(parser, "expandable_segments:False")
    assert exit_.value.code == 2
    assert "--cuda-alloc-conf must be set before CUDA starts" in capsys.readouterr().err
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
