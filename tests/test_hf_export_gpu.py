"""The Hugging Face export where training ran: one GPU visible (NCCL, bf16, Megatron-Core DDP and
distributed optimizer), the reduced 9B.

* A run from scratch, then ``python -m relax_gdn.export_hf`` with CUDA visible (the model rebuilt
  on the GPU): transformers loads the export (no missing / unexpected tensors) and computes finite
  logits on the GPU; a run from that export takes its vocabulary (the embedded tokenizer's 264,
  not the preset's) and exports the same tensor set again.
* A run from a VLM-layout reduced-9B checkpoint (bf16 with fp32 ``A_log``, vision tower, MTP):
  with ``checkpoint.optimizer_sharding=fully_reshardable`` the export at the end of the run and the
  export of its checkpoint are equal bit for bit, in the source's layout, and write ``A_log`` in
  float32 from the fp32 main parameters (bits a bf16 weight cannot hold); the export of a
  ``dp_reshardable`` checkpoint writes them from the bf16 weights and says so.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax_gdn.model import hf_checkpoint as hfc
from tests.distributed import child_env, job_runtime, run_distributed
from tests.helpers import REDUCED_9B_GPU_RUN, export_summary_line

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[1]

# the reduced 9B's sizes in HF terms, with a small vocabulary of the checkpoint's own
REDUCED_TEXT = dict(
    vocab_size=1024,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    tie_word_embeddings=False,
)


def _overrides(**extra) -> dict:
    # the model-level GPU run for three steps, without the host-sync counter (the default)
    return {**REDUCED_9B_GPU_RUN, "train.steps": 3, "logging.count_host_syncs": False, **extra}


def _train(run_dir: str | None, extra: dict) -> int:
    from relax_gdn.config import RunConfig
    from relax_gdn.train import run_training

    return len(
        run_training(RunConfig().with_overrides(_overrides(**extra)), run_dir, runtime=job_runtime()).records
    )


def _export(checkpoint: Path, out: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "relax_gdn.export_hf", str(checkpoint), str(out), *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture
def tmp(tmp_path):
    """Checkpoints of the reduced 9B are GiBs each: removed after the test."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_export_on_the_gpu_host_loads_in_transformers_and_trains_again(tmp):
    steps = run_distributed(
        _train, 1, None, {"checkpoint.dir": str(tmp / "ckpt"), "checkpoint.save_final": True}, backend="nccl"
    )[0]
    assert steps == 3
    out = _export(tmp / "ckpt", tmp / "hf")
    assert "Qwen3_5ForCausalLM (text layout)" in out

    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        tmp / "hf", dtype=torch.bfloat16, output_loading_info=True
    )
    assert not any(info.values()), info
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.cuda().eval()(input_ids=ids.cuda()).logits
    assert logits.shape == (1, 64, 264) and torch.isfinite(logits).all()
    del model, logits
    torch.cuda.empty_cache()

    again = {"model.hf_checkpoint": str(tmp / "hf"), "checkpoint.export_hf_final": True}
    assert run_distributed(_train, 1, str(tmp / "run2"), again, backend="nccl")[0] == 3
    assert hfc.HFCheckpoint.read(tmp / "run2" / "hf").tensors == hfc.HFCheckpoint.read(tmp / "hf").tensors


def _make_reduced_vlm_source(out: Path) -> None:
    from tests.hf_sources import make_vlm_source

    make_vlm_source(out, text=REDUCED_TEXT)


def test_drop_in_export_of_a_bf16_run_writes_fp32_a_log_from_the_main_parameters(tmp):
    source = tmp / "source"
    _make_reduced_vlm_source(source)
    common = {
        "model.hf_checkpoint": str(source),
        "data.tokenizer": str(source),
        "checkpoint.save_final": True,
    }
    full = {
        **common,
        "checkpoint.dir": str(tmp / "ckpt_full"),
        "checkpoint.optimizer_sharding": "fully_reshardable",
        "checkpoint.export_hf_final": True,
    }
    assert run_distributed(_train, 1, str(tmp / "run"), full, backend="nccl")[0] == 3
    flat = {
        **common,
        "checkpoint.dir": str(tmp / "ckpt_dp"),
        "checkpoint.optimizer_sharding": "dp_reshardable",
    }
    assert run_distributed(_train, 1, None, flat, backend="nccl")[0] == 3

    out_full = _export(tmp / "ckpt_full", tmp / "hf_full")
    out_dp = _export(tmp / "ckpt_dp", tmp / "hf_dp")
    assert "float32 from the fp32 main parameters: 3 tensors" in out_full, out_full
    assert "float32 from the run's lower-precision weights" in out_dp, out_dp

    original, in_run = hfc.HFCheckpoint.read(source), hfc.HFCheckpoint.read(tmp / "run" / "hf")
    assert hfc.HFCheckpoint.read(tmp / "hf_full").tensors == original.tensors == in_run.tensors
    src, full_w = hfc.read_hf_state_dict(source), hfc.read_hf_state_dict(tmp / "hf_full")
    run_w, dp_w = hfc.read_hf_state_dict(tmp / "run" / "hf"), hfc.read_hf_state_dict(tmp / "hf_dp")
    assert all(torch.equal(full_w[n], run_w[n]) for n in full_w)  # the run's export = its checkpoint's
    # the vision tower copied bit for bit; the source's MTP layer trained with the model (its default)
    # and written from the run. Its matrices moved; a norm vector of N(0, 1) values can round back to
    # its bf16 source after three small steps (tests/test_mtp.py checks every tensor in fp32)
    visual, mtp = ([n for n in src if n.startswith(prefix)] for prefix in ("model.visual.", "mtp."))
    assert visual and [n for n in visual if not torch.equal(full_w[n], src[n])] == []
    assert f"mtp.*: {len(mtp)}" in export_summary_line(out_full, "written from the run:"), out_full
    assert mtp and [n for n in mtp if src[n].dim() > 1 and torch.equal(full_w[n], src[n])] == []
    a_logs = [n for n in src if n.endswith("A_log")]
    assert len(a_logs) == 3
    for name in a_logs:
        main, rounded = full_w[name], dp_w[name]
        assert main.dtype == rounded.dtype == torch.float32
        assert not torch.equal(main, src[name])  # trained
        assert (main != main.to(torch.bfloat16).float()).any(), name  # fp32 bits a bf16 weight lacks
        assert torch.equal(rounded, rounded.to(torch.bfloat16).float()), name

    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    for cls in (AutoModelForCausalLM, Qwen3_5ForConditionalGeneration):
        _, info = cls.from_pretrained(tmp / "hf_full", output_loading_info=True)
        assert not any(info.values()), (cls.__name__, info)
