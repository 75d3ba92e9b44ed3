"""What this machine can run (``relax_gdn.config.machine``), checked by ``train.py`` and ``train.py
--check`` before anything is written: the rules for any machine (pure, given the machine's facts),
and as a user meets them on this CPU machine: one message naming every key, exit 2, no run
directory. (The line of a check that passes: tests/test_train_entry.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from relax_gdn.config import RunConfig
from relax_gdn.config.machine import FA4_SM_MAJORS, Machine, machine_problems
from tests.distributed import child_env
from tests.helpers import ROOT

CPU = Machine(cuda=False, installed=lambda module: True)
H200 = Machine(cuda=True, gpu=("NVIDIA H200", 9, 139.8), installed=lambda module: True)
A100 = Machine(cuda=True, gpu=("NVIDIA A100", 8, 79.2), installed=lambda module: True)
BARE_H200 = Machine(cuda=True, gpu=("NVIDIA H200", 9, 139.8), installed=lambda module: False)


def _problems(machine: Machine, **overrides) -> list[str]:
    return machine_problems(RunConfig().with_overrides(overrides), machine)


def test_the_default_runs_on_any_machine():
    for machine in (CPU, H200, A100, BARE_H200):
        assert _problems(machine) == []


@pytest.mark.parametrize(
    "key,value,needs",
    [
        ("model.attention_backend", "fa4", "needs a CUDA GPU of SM 9.x-11.x"),
        ("model.attention_backend", "varlen", "needs CUDA and bf16"),
        ("model.attention_backend", "flex", "FlexAttention has no backward on CPU"),
        ("gdn.kernel_backend", "fla", "needs CUDA: use gdn.kernel_backend=auto"),
        ("checkpoint.async_save", True, "needs CUDA (Megatron-Core's async writer): set it false here"),
        ("train.precision", "bf16", "needs CUDA (a CPU run trains in fp32)"),
        ("train.device", "cuda", "CUDA is not available here: use train.device=auto or cpu"),
    ],
)
def test_cuda_only_choices_are_refused_on_cpu_and_pass_on_a_gpu(key, value, needs):
    (problem,) = _problems(CPU, **{key: value})
    assert (
        problem.startswith(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
        and needs in problem
    )
    assert _problems(H200, **{key: value}) == []
    if key != "train.device":  # the same on a GPU machine told to train on its CPU
        assert _problems(H200, **{key: value, "train.device": "cpu"}) == [problem]


def test_gpu_generations_and_packages_a_backend_needs():
    (old_gpu,) = _problems(A100, **{"model.attention_backend": "fa4"})
    assert "this GPU (NVIDIA A100) is SM 8.x" in old_gpu and "model.attention_backend=auto" in old_gpu
    (no_fa4,) = _problems(BARE_H200, **{"model.attention_backend": "fa4"})
    assert "flash-attn-4 is not installed: pip install '.[fa4]'" in no_fa4
    (no_fla,) = _problems(BARE_H200, **{"gdn.kernel_backend": "fla"})
    assert "FLA's kernels are not installed" in no_fla
    (no_te,) = _problems(BARE_H200, **{"model.spec_provider": "te"})
    assert no_te.startswith("model.spec_provider=te needs Transformer Engine")
    assert (
        "needs CUDA and bf16"
        in _problems(H200, **{"model.attention_backend": "varlen", "train.precision": "fp32"})[0]
    )


def test_online_wandb_needs_a_key_and_offline_does_not():
    keyless = Machine(cuda=False, installed=lambda module: True, wandb_logged_in=lambda: False)
    (problem,) = _problems(keyless, **{"logging.wandb.mode": "online"})
    assert (
        problem.startswith("logging.wandb.mode=online but W&B has no API key") and "`wandb login`" in problem
    )
    assert _problems(keyless, **{"logging.wandb.mode": "offline"}) == []
    logged_in = Machine(cuda=False, installed=lambda module: True, wandb_logged_in=lambda: True)
    assert _problems(logged_in, **{"logging.wandb.mode": "online"}) == []


def test_the_fa4_generations_are_the_kernels_own():
    from relax_gdn.model import attention_kernels

    assert FA4_SM_MAJORS == attention_kernels.FA4_SM_MAJORS


def _train_py(tmp_path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


CUDA_ONLY = ("model.attention_backend=fa4", "gdn.kernel_backend=fla", "checkpoint.async_save=true")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of a machine without CUDA")
@pytest.mark.parametrize("check", [True, False], ids=["--check", "train.py"])
def test_cuda_only_choices_are_one_message_and_exit_2_before_anything_is_written(tmp_path, check):
    args = (
        ("--check", "--world-size", "2", "parallel.cp=2") if check else (f"hydra.run.dir={tmp_path / 'run'}",)
    )
    done = _train_py(tmp_path, *args, *CUDA_ONLY)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[0] == "error: 3 configuration problems:" and len(lines) == 4, done.stderr
    for key in CUDA_ONLY:
        assert sum(line.startswith(f"  - {key} ") for line in lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == "" and list(tmp_path.iterdir()) == []


def test_online_wandb_without_a_key_is_one_message_and_exit_2_before_anything_is_written(tmp_path_factory):
    """As on a fresh node: no WANDB_API_KEY, no ~/.netrc. Without the check, wandb.init asks rank 0's
    terminal for a key, or the run goes on untracked."""
    run, home = tmp_path_factory.mktemp("run"), tmp_path_factory.mktemp("home")
    env = child_env({"HOME": str(home)})
    env.pop("WANDB_API_KEY", None)
    done = _train_py(run, f"hydra.run.dir={run / 'run'}", "logging.wandb.mode=online", env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().startswith(
        "error: configuration problem: logging.wandb.mode=online but W&B has no API key on this machine"
    ), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == "" and list(run.iterdir()) == []
