"""Distributed checkpoints reshard (CPU, gloo, two processes, the tiny preset in fp32).

A checkpoint written at one layout resumes at another and the run goes on as if uninterrupted:
the two steps after the resume equal those of the uninterrupted run that wrote the checkpoint
(loss, grad norm, lr; relative 1e-5). The second step after the resume depends on the Adam moments, so it also shows that the
optimizer state moved. Pairs: CP 2 -> CP 1 (DP 2), CP 1 (DP 2) -> CP 2, TP 2 -> TP 1 x CP 2 and
static CP 2 -> dynamic CP <= 2, each resumed into every GDN mode.

Then the CP 2 checkpoint is exported with ``python -m relax_gdn.export_hf`` and transformers'
``AutoModelForCausalLM`` gives the project's logits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import child_env, computed_once, job_runtime
from tests.helpers import EQ_TOL, reshard_run_config, step_values

ROOT = Path(__file__).resolve().parents[1]
MODES = ("chunkwise", "headwise", "all_gather")
# (saved at, resumed at): the CP 2 checkpoint is the reference run's own (per mode)
PAIRS = (("cp2", "cp1"), ("cp1", "cp2"), ("tp2", "cp2"), ("cp2", "dynamic"))
LOGIT_TOL = 1e-4  # max |ours - transformers| relative to max |logit| (fp32; the scans sum in another order)


def _uninterrupted(tmp: str, layout: str, mode: str) -> tuple[list[dict], str]:
    """4 steps at ``layout``, the checkpoint of step 2 kept: (records, that checkpoint); run once
    per pool rank and (layout, mode)."""

    def make():
        from relax_gdn.train import run_training

        run = run_training(
            reshard_run_config(
                layout,
                mode,
                4,
                checkpoint__dir=str(Path(tmp) / f"{layout}_{mode}"),
                checkpoint__every_steps=2,
            ),
            None,
            runtime=job_runtime(),
        )
        return [step_values(r) for r in run.records], str(run.checkpoints[0])

    return computed_once(("reshard", tmp, layout, mode), make)


def _resumed(tmp: str, mode: str, source: str, target: str) -> dict:
    """The checkpoint written at ``source`` resumed at ``target`` in ``mode`` (the pool of 2).
    Mode-independent sources (CP 1 runs no GDN CP path) are written once, by chunkwise."""
    from relax_gdn.train import run_training

    source_key = (source, mode if source == "cp2" else "chunkwise")
    reference, saved = _uninterrupted(tmp, *source_key)
    resumed = run_training(
        reshard_run_config(target, mode, 4, checkpoint__resume=saved), None, runtime=job_runtime()
    )
    return {
        "resumed": (source_key, resumed.start_step, [step_values(r) for r in resumed.records]),
        "reference": reference,
    }


def _export_source(tmp: str) -> str:
    """The CP 2 chunkwise run's last checkpoint (step 4)."""
    _uninterrupted(tmp, "cp2", "chunkwise")
    return str(Path(tmp) / "cp2_chunkwise" / "step_000004")


def _project_logits(checkpoint: str, ids: torch.Tensor) -> torch.Tensor:
    """The project's model (TP 1, CP 1) with the checkpoint's weights: ``[t, vocab]`` logits."""
    from megatron.core import parallel_state

    from relax_gdn.config import run_config_from_dict
    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import build_qwen3_5_preset_model, qwen3_5_config
    from relax_gdn.train.checkpoint import read_manifest
    from relax_gdn.train.checkpoint_state import load_model_weights

    torch.set_num_threads(1)
    manifest = read_manifest(checkpoint)
    cfg = run_config_from_dict(manifest["config"])
    parallel_state.initialize_model_parallel(1, context_parallel_size=1, create_gloo_process_groups=False)
    try:
        tconfig = qwen3_5_config(cfg.model.preset, use_cpu_initialization=True)
        model = build_qwen3_5_preset_model(
            cfg.model.preset,
            tconfig,
            vocab_size=manifest["model"]["vocab_size"],
            gdn=GDNOptions(kernel_backend="torch", training=False),
        ).eval()
        load_model_weights(Path(checkpoint), model)
        with torch.no_grad():
            logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)
        return logits.reshape(-1, logits.shape[-1])
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def reshard(tmp_path_factory):
    """The directory of the runs' checkpoints (the pool's ranks write them once, see _uninterrupted)."""
    return tmp_path_factory.mktemp("reshard")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}_to_{p[1]}")
def test_resumed_steps_equal_the_uninterrupted_run(gloo, reshard, mode, pair):
    for rank_out in gloo(_resumed, 2, str(reshard), mode, *pair):
        source, start, resumed = rank_out["resumed"]
        reference = rank_out["reference"]
        assert start == 2 and [r["step"] for r in resumed] == [3, 4]
        for got, want in zip(resumed, reference[2:]):
            assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
            for key in ("loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=EQ_TOL), (mode, pair, key, got, want)


def test_export_of_a_cp2_checkpoint_gives_the_projects_logits(gloo, reshard, tmp_path):
    from tests.helpers import force_transformers_pure_torch as _force_transformers_pure_torch

    source = gloo(_export_source, 2, str(reshard))[0]
    out = tmp_path / "hf"
    env = child_env()
    done = subprocess.run(
        [sys.executable, "-m", "relax_gdn.export_hf", source, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}

    _force_transformers_pure_torch()
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager", dtype=torch.float32
    )
    assert not any(info.values()), info  # no missing / unexpected / mismatched tensors
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (1, 47), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf.eval()(input_ids=ids).logits[0]
    ours = gloo(_project_logits, 1, source, ids)[0][:, :vocab]
    err = (ours - theirs).abs().max().item() / theirs.abs().max().item()
    assert err < LOGIT_TOL, err
