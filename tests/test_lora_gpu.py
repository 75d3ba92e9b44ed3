"""LoRA on one GPU (bf16, Megatron-Core DDP + distributed optimizer, the local specs with the fused
ops on): the reduced 9B with adapters on every projection trains; only the adapters have DDP
gradient buffers and optimizer state; a checkpoint holds them alone and resumes at the same loss
(both optimizer forms); the export writes the merged model, which transformers loads; the memory
model admits the 9B with Adam only with LoRA; the 9B with LoRA trains a step with Adam."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import job_runtime, run_distributed
from tests.helpers import checkpoint_model_keys

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
LOSS_TOL = 1e-3  # bf16, relative: a resumed run repeats the uninterrupted one (same kernels, same order)


def _overrides(**extra) -> dict:
    return {
        "model.preset": "qwen3_5_9b_reduced",
        "model.lora.rank": 16,
        "train.device": "cuda",
        "train.precision": "bf16",
        "train.steps": 4,
        "train.global_batch_size": 8,
        "train.max_tokens_per_gpu": 2048,
        "data.max_sample_tokens": 2048,
        "data.synthetic_max_steps": 8,
        "data.num_samples": 256,
        "optim.warmup_steps": 1,
        "logging.console": False,
        "logging.jsonl": False,
        "logging.count_host_syncs": True,
        **extra,
    }


def _gpu_lora_cases(tmp: str) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    from relax_gdn.config import RunConfig
    from relax_gdn.train import run_training
    from relax_gdn.train.loop import Trainer

    tmp = Path(tmp)

    def run(run_dir=None, **extra):
        return run_training(RunConfig().with_overrides(_overrides(**extra)), run_dir, runtime=job_runtime())

    out = {}
    for sharding in ("dp_reshardable", "fully_reshardable"):
        full = run(
            tmp / f"full_{sharding}",
            **{
                "checkpoint.every_steps": 2,
                "checkpoint.optimizer_sharding": sharding,
                "checkpoint.export_hf_final": True,
            },
        )
        resumed = run(
            tmp / f"resumed_{sharding}",
            **{"checkpoint.resume": str(full.checkpoints[0]), "checkpoint.optimizer_sharding": sharding},
        )
        keys = sorted(FileSystemReader(str(full.checkpoints[0])).read_metadata().state_dict_metadata)
        out[sharding] = {
            "full": full.records,
            "resumed": resumed.records,
            "start": resumed.start_step,
            "keys": keys,
            "bytes": sum(f.stat().st_size for f in full.checkpoints[0].rglob("*") if f.is_file()),
            "export": str(tmp / f"full_{sharding}" / "hf"),
        }
    # the DDP buffers and optimizer of a LoRA model: adapters only
    cfg = RunConfig().with_overrides(_overrides())
    from relax_gdn.config import validate

    trainer = Trainer(
        cfg, None, dims=validate(cfg, 1), device=torch.device("cuda", 0), bf16=True, runtime=job_runtime()
    )
    try:
        trainer.setup()
        model = trainer.core_model
        adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora." in n)
        buffered = sum(
            p.numel() for buffer in trainer.model.buffers for p in buffer.params
        )  # Megatron-Core DDP
        out["ddp"] = {
            "adapters": adapters,
            "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad),
            "requires_grad": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "buffered": buffered,
            "no_main_grad": all(
                getattr(p, "main_grad", None) is None
                for n, p in model.named_parameters()
                if ".lora." not in n
            ),
        }
    finally:
        trainer.close()
    # the full 9B with LoRA r 16 and Adam: one step at 8k tokens, no recompute
    nine_b = run(
        **{
            "model.preset": "qwen3_5_9b",
            "train.steps": 2,
            "train.max_tokens_per_gpu": 8192,
            "train.global_batch_size": 2,
            "data.max_sample_tokens": 8192,
        }
    )
    out["9b"] = nine_b.records
    return out


@pytest.fixture(scope="module")
def gpu_lora(tmp_path_factory):
    return run_distributed(
        _gpu_lora_cases, 1, str(tmp_path_factory.mktemp("lora_gpu")), backend="nccl", timeout_s=1800
    )[0]


@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable"])
def test_lora_trains_and_resumes_on_the_distributed_optimizer(gpu_lora, sharding):
    r = gpu_lora[sharding]
    full, resumed = r["full"], r["resumed"]
    assert full[-1]["loss"] < full[0]["loss"]
    assert r["start"] == 2
    # every step's loss in the message: a first step that differs points at the weights, a later one
    # at the optimizer state
    assert [x["loss"] for x in resumed] == pytest.approx([x["loss"] for x in full[2:]], rel=LOSS_TOL), (
        [x["loss"] for x in full],
        [x["loss"] for x in resumed],
    )
    # model weights: adapters only; optimizer state: per adapter (fully_reshardable) or the flat
    # buckets of the DDP buffers (dp_reshardable), which hold the adapters alone
    # (test_only_adapters_have_gradient_buffers)
    model_keys = checkpoint_model_keys(r["keys"])
    assert model_keys and [k for k in model_keys if ".lora." not in k] == [], model_keys[:10]
    assert all(
        ".lora." in k or k.startswith(("optimizer.param_groups", "optimizer.distributed.")) or "common" in k
        for k in r["keys"]
        if k.startswith("optimizer.")
    ), r["keys"][:10]
    # adapters with fp32 main copies and Adam moments (~14 bytes each) stay far below the bf16 base
    assert r["bytes"] < 0.1 * 2 * gpu_lora["ddp"]["frozen"], (r["bytes"], gpu_lora["ddp"])
    assert all(x["host_syncs"] == 0 for x in full[1:])


def test_only_adapters_have_gradient_buffers(gpu_lora):
    d = gpu_lora["ddp"]
    assert d["requires_grad"] == d["adapters"] > 0
    assert d["buffered"] == d["adapters"]
    assert d["no_main_grad"]


def test_the_merged_export_loads_in_transformers(gpu_lora):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        gpu_lora["fully_reshardable"]["export"], output_loading_info=True
    )
    assert not any(info.values()), info


def test_the_9b_trains_with_adam_and_lora_on_one_gpu(gpu_lora):
    records = gpu_lora["9b"]
    assert len(records) == 2 and all(r["loss"] == r["loss"] for r in records)
    assert records[-1]["peak_mem_gb"] < 141
