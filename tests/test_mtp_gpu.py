"""The multi-token-prediction layer on one GPU (bf16, Megatron-Core DDP, the fused output layer and
loss, the embedding's gradient straight into its main grad, FLA's kernels): the reduced 9B trains
its MTP layer (``mtp_loss`` falls), the MTP path adds no host<->device sync to a step, and the
fused forms give the plain forms' losses and gradient norm (bf16 tolerance)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import job_runtime, run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LOSS_TOL, GRAD_NORM_TOL = 1e-2, 5e-2  # bf16, relative: fused vs plain output layer, loss and embedding grad


def _overrides(**extra) -> dict:
    return {
        "model.preset": "qwen3_5_9b_reduced",
        "model.mtp.num_layers": 1,
        "train.device": "cuda",
        "train.precision": "bf16",
        "train.steps": 4,
        "train.global_batch_size": 8,
        "train.max_tokens_per_gpu": 2048,
        "data.max_sample_tokens": 2048,
        "data.synthetic_max_steps": 6,
        "data.num_samples": 64,
        "optim.warmup_steps": 1,
        "recompute.granularity": "selective",
        "logging.console": False,
        "logging.jsonl": False,
        "logging.count_host_syncs": True,
        **extra,
    }


def _gpu_cases() -> dict:
    from relax_gdn.config import RunConfig
    from relax_gdn.train import run_training

    def run(**extra):
        return run_training(
            RunConfig().with_overrides(_overrides(**extra)), None, runtime=job_runtime()
        ).records

    plain = {f"model.fused_{k}": False for k in ("norms", "cross_entropy", "swiglu", "grad_accumulation")}
    return {
        "mtp": run(),
        "no_mtp": run(**{"model.mtp.num_layers": 0}),
        "plain": run(**{**plain, "train.steps": 1}),
    }


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_gpu_cases, 1, backend="nccl")[0]


def test_reduced_9b_trains_its_mtp_layer_in_bf16(runs):
    records = runs["mtp"]
    assert all(math.isfinite(r["mtp_loss"]) and math.isfinite(r["loss"]) for r in records), records
    assert records[-1]["mtp_loss"] < records[0]["mtp_loss"], [r["mtp_loss"] for r in records]
    assert all("mtp_loss" not in r for r in runs["no_mtp"])
    # the MTP work is in the FLOPs: same tokens, more TFLOP per step
    with_mtp, without = records[-1], runs["no_mtp"][-1]
    assert with_mtp["tokens"] == without["tokens"]
    work = [r["tflops_per_gpu"] * r["step_time_s"] for r in (with_mtp, without)]
    assert work[0] > 1.05 * work[1], work


def test_mtp_adds_no_host_sync(runs):
    # after step 1, whose first calls compile and autotune kernels of their own
    assert [r["host_syncs"] for r in runs["mtp"][1:]] == [r["host_syncs"] for r in runs["no_mtp"][1:]], (
        runs["mtp"],
        runs["no_mtp"],
    )


def test_fused_forms_give_the_plain_forms_mtp_loss(runs):
    fused, plain = runs["mtp"][0], runs["plain"][0]
    for key, tol in (("loss", LOSS_TOL), ("mtp_loss", LOSS_TOL), ("grad_norm", GRAD_NORM_TOL)):
        assert fused[key] == pytest.approx(plain[key], rel=tol), (key, fused, plain)
