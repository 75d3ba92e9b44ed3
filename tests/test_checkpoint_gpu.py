"""Distributed checkpoints on GPUs (NCCL, bf16, Megatron-Core DDP + distributed optimizer), the
reduced 9B: saved in both forms of the optimizer state (``checkpoint.optimizer_sharding``), inline
and with ``checkpoint.async_save=true`` (Megatron-Core's async calls queue), then resumed at
another layout, the two steps after the resume agreeing with the uninterrupted run to bf16 kernel
noise. Two GPUs: saved at CP 2, resumed at CP 1 (DP 2). One GPU: saved and resumed at TP 1.
Prints the save times (training blocked / until published)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed import job_runtime, run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _overrides(**extra) -> dict:
    return {
        "model.preset": "qwen3_5_9b_reduced",
        "train.device": "cuda",
        "train.precision": "bf16",
        "train.steps": 4,
        "train.global_batch_size": 16,
        "train.max_tokens_per_gpu": 2048,
        "data.max_sample_tokens": 2048,
        "data.synthetic_max_steps": 20,
        "data.num_samples": 256,
        "optim.warmup_steps": 1,
        "optim.lr": 1e-5,
        "optim.min_lr": 1e-6,
        "logging.console": False,
        "logging.jsonl": False,
        **extra,
    }


def _save_then_resume(tmp: str, save_cp: int, resume_cp: int, sharding: str, async_save: bool) -> dict:
    from relax_gdn.config import RunConfig
    from relax_gdn.train import run_training

    def run(**extra):
        return run_training(RunConfig().with_overrides(_overrides(**extra)), None, runtime=job_runtime())

    tmp = Path(tmp)
    full = run(
        **{
            "parallel.cp": save_cp,
            "checkpoint.dir": str(tmp / "ckpt"),
            "checkpoint.every_steps": 2,
            "checkpoint.async_save": async_save,
            "checkpoint.optimizer_sharding": sharding,
        }
    )
    resumed = run(**{"parallel.cp": resume_cp, "checkpoint.resume": str(tmp / "ckpt" / "step_000002")})
    return {
        "full": full.records,
        "resumed": resumed.records,
        "start": resumed.start_step,
        "saved": sorted(p.name for p in (tmp / "ckpt").iterdir()),
        "timings": full.save_timings,
    }


# (optimizer form, async save)
CASES = [
    pytest.param("dp_reshardable", True, id="dp_reshardable-async"),
    pytest.param("dp_reshardable", False, id="dp_reshardable-sync"),
    pytest.param("fully_reshardable", False, id="fully_reshardable-sync"),
]


def _check(out: dict, case: str) -> None:
    full, resumed = out["full"], out["resumed"]
    print(f"{case} save timings (step, blocked s, total s): {out['timings']}")
    assert out["start"] == 2 and [r["step"] for r in resumed] == [3, 4]
    assert out["saved"] == ["latest", "step_000002", "step_000004"]
    # bf16 with FLA's atomics in the backward: agreement to kernel noise, not bit-equality; step 4
    # also needs Adam's state back (its per-parameter step sets the bias correction)
    for got, want in zip(resumed, full[2:]):
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-6)
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-3), (full, resumed)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-2), (full, resumed)


@pytest.fixture
def ckpt_tmp(tmp_path):
    """A directory whose checkpoints (11 GiB each for the reduced 9B) are deleted after the test:
    pytest keeps the last runs' tmp_path, and three cases would fill a 64 GiB disk."""
    yield tmp_path
    shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("sharding,async_save", CASES)
def test_save_at_cp2_resumes_at_cp1(ckpt_tmp, sharding, async_save):
    for out in run_distributed(
        _save_then_resume, 2, str(ckpt_tmp), 2, 1, sharding, async_save, backend="nccl"
    ):
        _check(out, f"{sharding}, async={async_save}")


@pytest.mark.parametrize("sharding,async_save", CASES)
def test_save_on_one_gpu_resumes(ckpt_tmp, sharding, async_save):
    out = run_distributed(_save_then_resume, 1, str(ckpt_tmp), 1, 1, sharding, async_save, backend="nccl")[0]
    _check(out, f"{sharding}, async={async_save}")
