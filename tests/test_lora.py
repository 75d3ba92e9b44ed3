"""LoRA (relax_gdn.model.lora, model.lora.*): the rules and arithmetic in this process; the model, its
checkpoints and its exports in spawned gloo groups (slow).

* In this process: targets and groups resolve to HF module names; every ``model.lora`` rule is one
  message naming its key; the learning rate of a LoRA run; the FLOPs count no weight gradient of a
  frozen weight and add the adapters'; the memory model fits the 9B with Adam on one H200 with
  LoRA (not without); the seeded base of a run without an HF checkpoint is the same at every TP
  split; PEFT names and vocabulary trimming; a drop-in export copies what LoRA left unchanged; a
  LoRA checkpoint refuses to continue into another model.
* Four gloo processes (slow): the tiny Qwen3.5 with adapters on every projection of both layer
  types, the embedding and the output layer, at CP 2 in every GDN mode, under dynamic CP and at TP
  2 x CP 2 with and without sequence parallelism, equals the same adapters at TP = CP = 1 (loss
  and every adapter gradient, gradients synced by the CPU optimizer); B = 0 is the base model
  exactly; recompute (full, selective, skip_unused) and the fused ops change nothing; the frozen
  base gets no gradient; dropout under full recompute draws the same masks.
* Two gloo processes (slow): from a transformers-made HF base, 3 steps of LoRA at CP 1 and at CP 2
  in every mode; the merged export's logits in transformers equal the model's (rel 1e-5, fp32);
  transformers + peft with the adapter export equal them too (rel 1e-5), and PEFT's
  ``merge_and_unload`` of the adapter export is the merged export bit for bit.
* Two gloo processes (slow): LoRA checkpoints hold the adapters and their optimizer state only,
  resume at another TP / CP (and with ``checkpoint.resume=auto``) as if uninterrupted, and refuse
  to continue as full fine-tuning.
* One process (slow): a LoRA run from a VLM-layout checkpoint writes the merged drop-in export and
  the PEFT adapter at its end, ``python -m relax_gdn.export_hf`` writes the same from its
  checkpoint, and transformers + peft (``AutoModelForCausalLM`` and the VLM class) gives the merged
  export's logits.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from relax_gdn.config import ConfigError, RunConfig, validate
from relax_gdn.config.hydra_io import compose_run_config
from relax_gdn.model.lora_options import LORA_GROUPS, LORA_MODULES, resolve_targets
from tests.distributed import job_runtime
from tests.helpers import ROOT


def _cfg(**dotted) -> RunConfig:
    return RunConfig().with_overrides({key.replace("__", "."): value for key, value in dotted.items()})


def _problems(cfg: RunConfig) -> str:
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# options and validation
# ---------------------------------------------------------------------------------------------


def test_targets_resolve_to_hf_modules_in_one_order():
    assert resolve_targets(["all_linear"]) == tuple(
        m for m in LORA_MODULES if m not in ("embed_tokens", "lm_head")
    )
    assert resolve_targets(["mlp", "gdn_in_proj"]) == (
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    assert resolve_targets(["q_proj", "attention_qkv", "output"]) == ("q_proj", "k_proj", "v_proj", "lm_head")
    for group, modules in LORA_GROUPS.items():
        assert set(resolve_targets([group])) == set(modules), group
    # every projection of both layer types has a name (the list)
    assert set(resolve_targets(["gdn", "attention"])) == {
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "out_proj",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    }


def test_lora_is_off_by_default_and_its_options_come_from_the_config():
    assert RunConfig().lora_options is None
    options = _cfg(model__lora__rank=16, model__lora__targets=["gdn"], train__seed=7).lora_options
    assert (options.rank, options.alpha, options.scaling, options.init_seed) == (16, 32.0, 2.0, 7)
    assert options.modules == resolve_targets(["gdn"])
    assert _cfg(model__lora__rank=8, model__lora__alpha=4).lora_options.scaling == 0.5
    validate(_cfg(model__lora__rank=8), 1)


def test_every_lora_rule_names_its_key():
    assert "model.lora.rank=-1 must be an integer >= 0" in _problems(_cfg(model__lora__rank=-1))
    assert "model.lora.rank=2.5" in _problems(_cfg(model__lora__rank=2.5))
    text = _problems(
        _cfg(
            model__lora__rank=4,
            model__lora__alpha=0,
            model__lora__dropout=1.0,
            model__lora__targets=["gdn", "qkv_proj"],
        )
    )
    assert "model.lora.alpha=0 must be a number > 0" in text
    assert "model.lora.dropout=1.0 must be a number in [0, 1)" in text
    assert "unknown: ['qkv_proj']" in text and "in_proj_qkv" in text
    assert "must be a non-empty list" in _problems(_cfg(model__lora__rank=4, model__lora__targets=[]))
    te = _problems(_cfg(model__lora__rank=4, model__spec_provider="te"))
    assert "model.lora needs the local layer specs" in te and "model.spec_provider=auto" in te
    head = _problems(_cfg(model__lora__rank=4, model__lora__targets=["output"]))
    assert "model.fused_cross_entropy=false" in head
    validate(
        _cfg(
            model__lora__rank=4,
            model__lora__targets=["output", "embedding"],
            model__fused_cross_entropy=False,
        ),
        1,
    )
    # rank 0 switches LoRA off: the rules of LoRA's other keys do not apply, but setting them is
    # refused (they would do nothing; tests/test_lora_options.py)
    validate(_cfg(model__lora__rank=0, model__spec_provider="te"), 1)
    assert "model.lora.targets set but model.lora.rank is 0" in _problems(_cfg(model__lora__targets=[]))


def test_a_lora_run_takes_the_presets_lora_rate():
    from relax_gdn.model.presets import PRESETS

    for name, preset in PRESETS.items():
        assert _cfg(model__preset=name, model__lora__rank=8).learning_rates[0] == preset.lora_lr
        assert _cfg(model__preset=name).learning_rates[0] == preset.sft_lr
        assert preset.lora_lr > preset.sft_lr
    assert _cfg(model__lora__rank=8, optim__lr=5e-4).learning_rates == (5e-4, 5e-5)


# ---------------------------------------------------------------------------------------------
# FLOPs and memory
# ---------------------------------------------------------------------------------------------


def _shape(preset: str = "qwen3_5_9b", **lora):
    from relax_gdn.model import qwen3_5_config
    from relax_gdn.model.presets import qwen3_5_preset
    from relax_gdn.train.flops import ModelShape

    options = _cfg(model__preset=preset, **{f"model__lora__{k}": v for k, v in lora.items()}).lora_options
    return ModelShape.from_transformer_config(
        qwen3_5_config(preset), qwen3_5_preset(preset).vocab_size, lora=options
    )


def test_flops_count_no_weight_gradient_of_a_frozen_weight():
    from relax_gdn.train.flops import megatron_flops_breakdown, relax_flops

    full, lora = _shape(), _shape(rank=16)
    a, b = megatron_flops_breakdown(full, 1, 8192), megatron_flops_breakdown(lora, 1, 8192)
    for part in ("mlp", "gdn_projections", "gdn_conv", "attention_projections", "logits"):
        assert getattr(b, part) == pytest.approx(getattr(a, part) * 2 / 3, rel=1e-12), part
    assert (b.attention_core, b.gdn_core) == (a.attention_core, a.gdn_core)  # no weights: unchanged
    # the adapters by hand: 3 passes x 2 FLOPs x r x (in + out), per module and layer (9B widths)
    h, ffn = 4096, 12288
    per_gdn = (h + 8192) + (h + 4096) + 2 * (h + 32) + (4096 + h)
    per_attention = (h + 8192) + 2 * (h + 1024) + (4096 + h)
    per_mlp = 2 * (h + ffn) + (ffn + h)
    expect = 6 * 16 * (24 * per_gdn + 8 * per_attention + 32 * per_mlp)
    assert b.lora_adapters == pytest.approx(expect, rel=1e-12)
    assert b.total == pytest.approx(
        a.total - (a.mlp + a.gdn_projections + a.gdn_conv + a.attention_projections + a.logits) / 3 + expect,
        rel=1e-12,
    )
    assert b.total / a.total == pytest.approx(0.685, abs=0.005)  # the work LoRA does per token at s_eff 8192
    # the Relax accounting's embedding GEMM has no weight gradient either
    embedding = 2 * 2 * 4096 * 248_320
    assert relax_flops(lora, 1, 8192) - b.total == pytest.approx(embedding, rel=1e-12)
    # the embedding adapter: a lookup of A and the product with B
    emb = megatron_flops_breakdown(_shape(rank=16, targets=["embedding"]), 1, 8192)
    assert emb.lora_adapters == 6 * 16 * 4096


def test_memory_model_fits_the_9b_with_adam_on_one_h200_only_with_lora():
    from relax_gdn.train.memory import GIB, estimate_memory, lora_parameter_count, settings_that_fit

    h200 = 141 * 10**9
    full = estimate_memory(_shape(), tokens_per_gpu=8192, recompute="full")
    assert full.total > h200  # weights, fp32 gradients and Adam state alone: ~150 GiB
    for rank in (16, 64):
        shape = _shape(rank=rank)
        trained = lora_parameter_count(shape)
        assert trained == pytest.approx(
            rank
            * (
                24 * (4 * 4096 + 8192 + 4096 + 64 + 4096 + 4096)
                + 8 * (3 * 4096 + 8192 + 2048 + 4096 + 4096)
                + 32 * 3 * (4096 + 12288)
            ),
            rel=1e-12,
        )
        for tokens, recompute in ((8192, "none"), (32768, "full")):
            estimate = estimate_memory(shape, tokens_per_gpu=tokens, recompute=recompute)
            assert estimate.gradients == trained * 4 and estimate.optimizer == trained * 12
            assert estimate.total < h200, (rank, tokens, recompute, estimate.summary())
    # TP 2: a column layer's B and a row layer's A are split, the other matrix replicated
    shape = _shape(rank=16, targets=["mlp_fc1", "mlp_fc2"])
    per_layer = 16 * (2 * (4096 + 12288 / 2) + (12288 / 2 + 4096))
    assert lora_parameter_count(shape, tp=2) == pytest.approx(32 * per_layer, rel=1e-12)
    # what the memory model offers for a full fine-tuning run that does not fit includes nothing with
    # Adam on one GPU; with LoRA the run fits as asked
    offered = settings_that_fit(_shape(), h200, tokens_per_gpu=8192, recompute="full")
    assert all("optim.name" in a.overrides or "parallel.cp" in a.overrides for a in offered)
    assert (
        estimate_memory(_shape(rank=64), tokens_per_gpu=32768, recompute="mixed", full_layers=16).total / GIB
        < 139
    )


# ---------------------------------------------------------------------------------------------
# the seeded base, PEFT names, drop-in origins, resuming
# ---------------------------------------------------------------------------------------------


def test_the_seeded_base_is_the_same_at_every_tp_split():
    from relax_gdn.model.hf_checkpoint.plan import ROW, TensorRule, TPSplit
    from relax_gdn.model.seeded_draws import seeded_values

    def rule(shape, split):
        return TensorRule("w", ("w",), (shape,), shape, lambda t: t[0], lambda t: [t], split)

    def draw(r, tp=1, rank=0, dtype=torch.float32):
        target = torch.empty(r.mcore_shape if tp == 1 else _local_shape(r, tp), dtype=dtype)
        group = SimpleNamespace(size=lambda: tp, rank=lambda: rank)
        return seeded_values(r, target, group, 99, lambda u: u)

    def _local_shape(r, tp):
        shape = list(r.mcore_shape)
        shape[r.tp.dim] //= tp
        return tuple(shape)

    sections = rule((24, 4, 3), TPSplit(0, (8, 8, 8)))  # a conv1d-like weight of three sections
    whole = draw(sections)
    assert whole.shape == (24, 4, 3) and 0 < whole.min() and whole.max() < 1
    assert whole.unique().numel() == whole.numel()  # no element repeats another's draw
    halves = [draw(sections, 2, r) for r in range(2)]
    assert torch.equal(halves[0], torch.cat([whole[0:4], whole[8:12], whole[16:20]]))
    assert torch.equal(halves[1], torch.cat([whole[4:8], whole[12:16], whole[20:24]]))
    row = rule((6, 8), ROW)
    assert torch.equal(torch.cat([draw(row, 4, r) for r in range(4)], dim=1), draw(row))
    other_key = seeded_values(row, torch.empty(6, 8), None, 100, lambda u: u)
    assert not torch.equal(other_key, draw(row))
    # a pure function of the place: the same values in float64 arithmetic on any device
    assert torch.equal(draw(row, dtype=torch.bfloat16), draw(row).to(torch.bfloat16))


def test_peft_names_follow_the_bases_layout_and_trim_the_vocabulary():
    from relax_gdn.model.hf_checkpoint.peft import peft_adapter_config, peft_adapter_state

    vlm = SimpleNamespace(
        by_text_name=lambda: {
            "model.layers.0.linear_attn.in_proj_qkv.weight": "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
            "model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
            "lm_head.weight": "lm_head.weight",
        }
    )
    a, b = torch.zeros(4, 64), torch.zeros(96, 4)
    adapters = {
        "model.layers.0.linear_attn.in_proj_qkv": (a, b),
        "model.embed_tokens": (torch.zeros(4, 1024), torch.zeros(64, 4)),
        "lm_head": (torch.zeros(4, 64), torch.zeros(1024, 4)),
    }
    state = peft_adapter_state(adapters, vlm, vocab_size=1000)
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight": (4, 64),
        "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_B.weight": (96, 4),
        "base_model.model.model.language_model.embed_tokens.lora_embedding_A": (4, 1000),
        "base_model.model.model.language_model.embed_tokens.lora_embedding_B": (64, 4),
        "base_model.model.lm_head.lora_A.weight": (4, 64),
        "base_model.model.lm_head.lora_B.weight": (1000, 4),
    }
    config = peft_adapter_config(rank=4, alpha=8, dropout=0.0, target_modules=["in_proj_qkv"], base="/b")
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"]) == (
        "LORA",
        4,
        8,
        ["in_proj_qkv"],
    )


def test_a_drop_in_export_copies_what_lora_left_unchanged():
    from relax_gdn.model.hf_checkpoint import Origin, tensor_origins
    from relax_gdn.model.hf_checkpoint.source import HFCheckpoint, SourceTensor

    names = {
        "model.language_model.layers.0.mlp.up_proj.weight": (8, 4),
        "model.language_model.layers.0.mlp.down_proj.weight": (4, 8),
        "model.language_model.norm.weight": (4,),
        "mtp.fc.weight": (4, 8),
    }
    source = HFCheckpoint(
        directory=None,
        config={},
        files=("a.safetensors",),
        sharded=False,
        tensors={n: SourceTensor("a.safetensors", torch.bfloat16, s) for n, s in names.items()},
        index_metadata={},
    )
    trained = {
        "model.layers.0.mlp.up_proj.weight": (8, 4),
        "model.layers.0.mlp.down_proj.weight": (4, 8),
        "model.norm.weight": (4,),
        "lm_head.weight": (9, 4),
    }
    unchanged = {"model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"}
    origins, added = tensor_origins(source, trained, unchanged)
    assert origins == {
        "model.language_model.layers.0.mlp.up_proj.weight": Origin.TRAINED,
        "model.language_model.layers.0.mlp.down_proj.weight": Origin.COPIED,
        "model.language_model.norm.weight": Origin.COPIED,
        "mtp.fc.weight": Origin.COPIED,
    }
    assert added == []  # an unchanged output layer of a tied source stays tied: nothing to add


def test_a_lora_checkpoint_continues_only_into_its_own_model(tmp_path):
    from relax_gdn.train.resume import lora_manifest, lora_resume_problem

    cfg = _cfg(model__lora__rank=8)
    mine = lora_manifest(cfg)
    assert mine["base"] == {
        "preset": "qwen3_5_tiny",
        "seed": 1234,
        "init": "relax_gdn.model.lora.seed_base_weights",
    }
    assert mine["adapters"]["modules"] == list(resolve_targets(["all_linear"]))
    assert lora_resume_problem(tmp_path, mine, lora_manifest(cfg)) is None
    assert lora_resume_problem(tmp_path, None, None) is None
    assert "it holds only LoRA adapters" in lora_resume_problem(tmp_path, mine, None)
    assert "it is a full fine-tuning checkpoint" in lora_resume_problem(tmp_path, None, mine)
    # what differs, each key with both values, and the whole command-line fix
    other = lora_resume_problem(tmp_path, mine, lora_manifest(_cfg(model__lora__rank=16)))
    assert "model.lora.rank: 8 (this run: 16); model.lora.alpha: 16.0 (this run: 32.0))" in other
    assert "(model.lora.rank=8 model.lora.alpha=16.0 model.lora.dropout=0.0 model.lora.targets=[" in other
    hf = lora_manifest(_cfg(model__lora__rank=8, model__hf_checkpoint=str(tmp_path)))
    assert hf["base"] == {"hf_checkpoint": str(tmp_path.absolute())}
    assert (
        f"model.preset: qwen3_5_tiny (this run: not set); model.hf_checkpoint: not set (this run: "
        f"{tmp_path.absolute()})" in lora_resume_problem(tmp_path, mine, hf)
    )
    # the overrides a full fine-tuning run is told to resume a LoRA checkpoint with build its manifest
    full = lora_resume_problem(tmp_path, mine, None)
    told = re.search(r"written with \((model\.lora\.rank=.*?)\)", full).group(1)
    assert lora_manifest(compose_run_config(ROOT / "conf", told.split())) == mine
    assert math.isfinite(mine["adapters"]["alpha"])


# ---------------------------------------------------------------------------------------------
# the model over CP and TP: one spawn of 4 gloo processes
# ---------------------------------------------------------------------------------------------

EVERY_TARGET = ["all_linear", "embedding", "output"]  # every projection, the embedding, the output layer


def _lora_build(
    config, tp, cp, single, mode="chunkwise", *, targets=EVERY_TARGET, dropout=0.0, fusion=None, **options
):
    """The tiny Qwen3.5 with rank-4 adapters on ``targets`` (the fused loss off: it cannot take an
    adapted output layer)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import build_qwen3_5_preset_model
    from relax_gdn.model.fusion import Fusion
    from relax_gdn.model.lora_options import LoRAOptions

    gdn = {k: options.pop(k) for k in list(options) if k in ("max_cp_size", "recompute_core")}
    lora = LoRAOptions(rank=4, alpha=8.0, dropout=dropout, modules=resolve_targets(targets), init_seed=3)
    pgs = ProcessGroupCollection(tp=tp, cp=cp, pp=single, embd=single)
    return build_qwen3_5_preset_model(
        "qwen3_5_tiny",
        config,
        pg_collection=pgs,
        gdn=GDNOptions(cp_mode=mode, kernel_backend="torch", **gdn),
        attention_backend="sdpa",
        fusion=fusion or Fusion(cross_entropy=False),
        lora=lora,
        **options,
    )


def _shard_state(model, state, config, tp_size: int, tp_rank: int) -> dict:
    """A TP = 1 state (base and adapters) cut for this TP rank: the base as Megatron-Core cuts it,
    each adapter matrix as its layout says."""
    from relax_gdn.model.hf_checkpoint.plan import shard_for_tp
    from relax_gdn.model.lora import LoRAAdapter
    from tests.model_harness import tp_shard

    adapters = {n: m for n, m in model.named_modules() if isinstance(m, LoRAAdapter)}
    params = dict(model.named_parameters())
    out = {}
    for key, value in state.items():
        owner, _, leaf = key.rpartition(".")
        if owner in adapters:
            layout = adapters[owner].layout
            split = layout.a_split if leaf == "lora_A" else layout.b_split
            out[key] = (
                value if split is None or tp_size == 1 else shard_for_tp(value, split, tp_size, tp_rank)
            )
        elif key in params:
            out[key] = tp_shard(key, value, params[key], config, tp_size, tp_rank)
        else:
            out[key] = value
    return out


def _lora_run(model, batch, ids=None, cp_group=None, *, tp_group, dp_cp_group, sp=False):
    """Per-token loss and the adapters' gradients of ``sum(loss)`` on rows ``ids``, synced by the CPU
    optimizer (DP x CP sum, TP-partial sums); whether any frozen parameter got a gradient."""
    from relax_gdn.train.optimizer import CPUGradSyncOptimizer
    from tests.gdn_harness import packed_params
    from tests.model_harness import CU

    tokens, labels, positions = batch
    if ids is not None:
        tokens, labels, positions = tokens[:, ids], labels[:, ids], positions[:, ids]
    optimizer = CPUGradSyncOptimizer(
        model, RunConfig(), dp_cp_group=dp_cp_group, tp_group=tp_group, sequence_parallel=sp
    )
    optimizer.zero_grad()
    dynamic = {} if cp_group is None else {"cp_group": cp_group, "local_cp_size": cp_group.size()}
    loss = model(
        tokens, positions, None, labels=labels, packed_seq_params=packed_params(CU, "cpu", **dynamic)
    )
    loss.sum().backward()
    optimizer._finish_grad_sync()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    return loss.detach(), grads, frozen_grads


def _lora_errors(reference, result, ids, shard=lambda n, g: g) -> dict[str, float]:
    ref_loss, ref_grads, _ = reference
    loss, grads, frozen = result
    errors = {
        "loss": (loss - ref_loss[:, ids] if ids is not None else loss - ref_loss).abs().max().item(),
        "frozen_with_grads": float(len(frozen)),
        "adapters": float(len(grads)),
    }
    for n, g in ref_grads.items():
        expect = shard(n, g)
        assert grads[n].shape == expect.shape, (n, grads[n].shape, expect.shape)
        errors[n] = (grads[n] - expect).abs().max().item() / max(g.abs().max().item(), 1e-12)
    return errors


def _recompute_variants(reference_state, batch, single, case: int) -> dict:
    """One of four TP = CP = 1 checks (one per rank): full recompute with and without its skips,
    selective recompute, the fused loss, dropout masks under full recompute, B = 0."""
    from relax_gdn.model import qwen3_5_config
    from relax_gdn.model.fusion import Fusion
    from relax_gdn.model.recompute import recompute_config_fields

    groups = dict(tp_group=single, dp_cp_group=single)
    plain = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True)

    def run(config, state=reference_state, **build):
        model = _lora_build(config, single, single, single, **build)
        model.load_state_dict(state)
        return _lora_run(model, batch, **groups)

    if case == 0:  # full recompute: plain, and leaving out what no gradient reads (linear_fc2's GEMM)
        ref = run(plain)
        full = dict(use_cpu_initialization=True, **recompute_config_fields("full"))
        skip = dict(
            use_cpu_initialization=True, **recompute_config_fields("full", skip_unused=True, num_layers=4)
        )
        # the default targets leave the embedding frozen: the first layer's input has no grad, and
        # the layers recomputed whole must still give their adapters gradients
        linear = dict(targets=["all_linear"])
        state = {
            k: v
            for k, v in reference_state.items()
            if not (".lora." in k and k.startswith(("embedding.", "output_layer.")))
        }
        frozen_ref = run(plain, state, **linear)
        mixed = dict(use_cpu_initialization=True, **recompute_config_fields("mixed", full_layers=2))
        return {
            "full": _lora_errors(ref, run(qwen3_5_config("qwen3_5_tiny", **full)), None),
            "full_skip_unused": _lora_errors(
                ref, run(qwen3_5_config("qwen3_5_tiny", **skip), recompute_skips_unread_gemm=True), None
            ),
            "full_frozen_embedding": _lora_errors(
                frozen_ref, run(qwen3_5_config("qwen3_5_tiny", **full), state, **linear), None
            ),
            "mixed_frozen_embedding": _lora_errors(
                frozen_ref, run(qwen3_5_config("qwen3_5_tiny", **mixed), state, **linear), None
            ),
        }
    if case == 1:  # selective: core attention, the SwiGLU, the GDN core
        ref = run(plain)
        selective = qwen3_5_config(
            "qwen3_5_tiny",
            use_cpu_initialization=True,
            **recompute_config_fields("selective", ["core_attn", "mlp_act", "gdn_core"]),
        )
        return {
            "selective": _lora_errors(
                ref, run(selective, recompute_mlp_activation=True, recompute_core=True), None
            )
        }
    if case == 2:  # the fused loss and norms against the plain forms (adapters on every projection)
        state = {k: v for k, v in reference_state.items() if "output_layer.lora" not in k}
        linear = dict(targets=["all_linear", "embedding"])
        ref = run(plain, state, fusion=Fusion(norms=False, cross_entropy=False), **linear)
        return {"fused": _lora_errors(ref, run(plain, state, fusion=Fusion(), **linear), None)}
    # dropout: full recompute re-runs each layer with the masks of its first forward
    torch.manual_seed(5)
    ref = run(plain, dropout=0.3)
    torch.manual_seed(5)
    full = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True, **recompute_config_fields("full"))
    out = {"dropout_full_recompute": _lora_errors(ref, run(full, dropout=0.3), None)}
    without = run(plain)  # no dropout: another loss (the masks act)
    out["dropout_acts"] = (ref[0] - without[0]).abs().max().item()
    return out


def _record_unfoldable_linear_inputs(model) -> set[str]:
    """The names of the model's parallel linears whose ``[S, B, D]`` input (filled in as the model
    runs) has leading strides that do not flatten to ``[S*B, D]`` by the plain stride rule. torch <
    2.12 (the GPU host's) then runs ``input @ W.t()`` of a frozen weight as S batched one-row GEMMs
    instead of one GEMM (pytorch#186148: a size-1 dim's odd stride counts too); the GDN out_proj's
    input was such a tensor. This machine's torch folds them anyway, so the strides are checked."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    unfoldable: set[str] = set()

    def check(name):
        def hook(module, args):
            x = args[0]
            if any(x.stride(i) != x.stride(i + 1) * x.shape[i + 1] for i in range(x.dim() - 2)):
                unfoldable.add(name)

        return hook

    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.register_forward_pre_hook(check(name))
    return unfoldable


def _zero_b_is_the_base(single, batch) -> dict:
    """A model built with adapters (B = 0) gives the base model's loss bit for bit; its counts."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import build_qwen3_5_preset_model, qwen3_5_config
    from relax_gdn.model.fusion import Fusion
    from tests.gdn_harness import packed_params
    from tests.model_harness import CU

    tokens, labels, positions = batch
    config = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True)
    pgs = ProcessGroupCollection(tp=single, cp=single, pp=single, embd=single)
    base = build_qwen3_5_preset_model(
        "qwen3_5_tiny",
        config,
        pg_collection=pgs,
        attention_backend="sdpa",
        gdn=GDNOptions(kernel_backend="torch"),
        fusion=Fusion(cross_entropy=False),
    )
    model = _lora_build(config, single, single, single)
    missing = model.load_state_dict(base.state_dict(), strict=False).missing_keys
    psp = packed_params(CU, "cpu")
    unfoldable = _record_unfoldable_linear_inputs(model)
    with torch.no_grad():
        same = torch.equal(
            base(tokens, positions, None, labels=labels, packed_seq_params=psp),
            model(tokens, positions, None, labels=labels, packed_seq_params=psp),
        )
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "equal": same,
        "missing_are_adapters": all(".lora." in k for k in missing),
        "trained": trained,
        "unfoldable_linear_inputs": sorted(unfoldable),
        "frozen_requires_grad": sum(
            p.requires_grad for n, p in model.named_parameters() if ".lora." not in n
        ),
        "b_zero": all(
            not p.any()
            for n, p in model.named_parameters()
            if n.endswith("lora_B") and "word_embeddings" not in n
        ),
    }


def _lora_model_cases():
    import torch.distributed as dist

    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model import qwen3_5_config, qwen3_5_preset
    from tests.helpers import GDN_MODES
    from tests.model_harness import CU, FULL_RECOMPUTE
    from tests.model_harness import batch as _batch

    torch.set_num_threads(1)
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(4)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    single, pair = singles[rank], pairs[rank // 2]
    batch = _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size)

    torch.manual_seed(0)
    base_config = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True)
    reference = _lora_build(base_config, single, single, single)
    with torch.no_grad():  # every base weight and adapter matters (B starts at zero)
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = reference.state_dict()
    ref = _lora_run(reference, batch, tp_group=single, dp_cp_group=single)
    results = {}

    ids = thd_rank_indices(CU, 2, pair.rank(), "zigzag")
    for mode in GDN_MODES:  # CP 2, every GDN mode
        config = qwen3_5_config(
            "qwen3_5_tiny", use_cpu_initialization=True, **(FULL_RECOMPUTE if mode == "all_gather" else {})
        )
        model = _lora_build(config, single, pair, single, mode)
        model.load_state_dict(state)
        results[("cp2", mode)] = _lora_errors(
            ref, _lora_run(model, batch, ids, tp_group=single, dp_cp_group=pair), ids
        )
    model = _lora_build(
        base_config, single, dist.group.WORLD, single, "chunkwise", max_cp_size=4
    )  # dynamic CP
    model.load_state_dict(state)
    results[("cp2", "chunkwise", "dynamic")] = _lora_errors(
        ref, _lora_run(model, batch, ids, pair, tp_group=single, dp_cp_group=pair), ids
    )

    tp_group, cp_group = pairs[rank // 2], strided[rank % 2]  # TP 2 x CP 2
    ids = thd_rank_indices(CU, 2, cp_group.rank(), "zigzag")
    for mode, sp in (("chunkwise", False), ("chunkwise", True), ("headwise", True), ("all_gather", False)):
        config = qwen3_5_config(
            "qwen3_5_tiny",
            use_cpu_initialization=True,
            tensor_model_parallel_size=2,
            sequence_parallel=sp,
            **(FULL_RECOMPUTE if mode == "all_gather" else {}),
        )
        model = _lora_build(config, tp_group, cp_group, single, mode)
        model.load_state_dict(_shard_state(model, state, config, 2, tp_group.rank()))
        shards = _shard_state(model, ref[1], config, 2, tp_group.rank())
        result = _lora_run(model, batch, ids, tp_group=tp_group, dp_cp_group=cp_group, sp=sp)
        results[("tp2cp2", mode, f"sp={sp}")] = _lora_errors(ref, result, ids, lambda n, g, s=shards: s[n])
        if sp and mode == "chunkwise":  # negative control: the sequence-parallel partial sums left unsummed
            result = _lora_run(model, batch, ids, tp_group=tp_group, dp_cp_group=cp_group, sp=False)
            results["tp2cp2_unsummed"] = _lora_errors(ref, result, ids, lambda n, g, s=shards: s[n])
    results["recompute"] = _recompute_variants(state, batch, single, rank)
    if rank == 0:
        results["zero_b"] = _zero_b_is_the_base(single, batch)
    return results


@pytest.fixture(scope="module")
def lora_model(gloo):
    return gloo(_lora_model_cases, 4)


def _assert_close(errors: dict, what) -> None:
    from tests.model_harness import tolerance as _tolerance

    assert errors.pop("frozen_with_grads") == 0, what
    # 33 adapters (A and B each): 5 per GDN layer x 3, 4 in the attention layer, 3 per MLP x 4, embedding, output
    assert errors.pop("adapters") == 66, what
    bad = {k: v for k, v in errors.items() if not v <= _tolerance(k)}
    assert not bad, (what, bad)


@pytest.mark.parametrize(
    "case",
    [
        ("cp2", "headwise"),
        ("cp2", "chunkwise"),
        ("cp2", "all_gather"),
        ("cp2", "chunkwise", "dynamic"),
        ("tp2cp2", "chunkwise", "sp=False"),
        ("tp2cp2", "chunkwise", "sp=True"),
        ("tp2cp2", "headwise", "sp=True"),
        ("tp2cp2", "all_gather", "sp=False"),
    ],
    ids=lambda c: "-".join(c),
)
def test_adapters_over_cp_and_tp_equal_one_rank(lora_model, case):
    for rank_result in lora_model:
        _assert_close(dict(rank_result[case]), case)


def test_the_parity_check_sees_unsummed_sequence_parallel_gradients(lora_model):
    for rank_result in lora_model:
        errors = rank_result["tp2cp2_unsummed"]
        # a column layer's A (replicated, fed sequence-sharded rows) and a row layer's B
        worst = {k: v for k, v in errors.items() if v > 0.1}
        assert any(k.endswith("in_proj.lora.in_proj_qkv.lora_A") for k in worst), errors
        assert any(k.endswith("linear_fc2.lora.down_proj.lora_B") for k in worst), errors
        assert errors["loss"] < 1e-4  # the forward is right; only the gradients' sum is missing


def test_recompute_and_fused_ops_change_nothing_and_dropout_masks_replay(lora_model):
    for rank, rank_result in enumerate(lora_model):
        for name, errors in rank_result["recompute"].items():
            if name == "dropout_acts":
                assert errors > 1e-3  # dropout changed the loss: the masks were drawn
                continue
            errors = dict(errors)
            adapters = errors.pop("adapters")
            # fused: no output-layer adapter; frozen_embedding: neither an embedding nor an output one
            assert adapters == {"fused": 64, "full_frozen_embedding": 62, "mixed_frozen_embedding": 62}.get(
                name, 66
            ), name
            assert errors.pop("frozen_with_grads") == 0
            from tests.model_harness import tolerance as _tolerance

            bad = {k: v for k, v in errors.items() if not v <= _tolerance(k)}
            assert not bad, (rank, name, bad)


def test_zero_b_is_the_base_model_exactly_and_only_adapters_train(lora_model):
    r = lora_model[0]["zero_b"]
    assert r["equal"] and r["missing_are_adapters"] and r["b_zero"]
    assert r["unfoldable_linear_inputs"] == []  # each frozen projection is one GEMM on every torch
    assert r["frozen_requires_grad"] == 0
    shape = _shape("qwen3_5_tiny", rank=4, targets=EVERY_TARGET)
    from relax_gdn.train.memory import lora_parameter_count

    # the model's vocabulary is the preset's 256, the shape's too
    assert r["trained"] == lora_parameter_count(shape)


# ---------------------------------------------------------------------------------------------
# exports: 3 steps from a transformers-made base, merged and PEFT, at CP 1 and CP 2 (2 processes)
# ---------------------------------------------------------------------------------------------

EVAL_TOKENS = 48  # the sequence the logits are compared on (a multiple of 2 x CP)


def _hf_lora_model(base_dir, cp_group, single, mode: str):
    """The LoRA model (every target, rank 4) on ``base_dir``'s sizes with its weights, padded
    vocabulary (256 for the checkpoint's 250) and the fused loss off."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import hf_checkpoint as hfc
    from relax_gdn.model.fusion import Fusion
    from relax_gdn.model.lora_options import LoRAOptions
    from relax_gdn.model.qwen3_5 import Qwen3_5Options, build_qwen3_5_model, qwen3_5_config
    from tests.hf_sources import MODEL_VOCAB
    from tests.model_harness import FULL_RECOMPUTE

    overrides, model_kwargs = hfc.qwen3_5_config_from_hf(base_dir)
    config = qwen3_5_config(
        "qwen3_5_tiny",
        **overrides,
        use_cpu_initialization=True,
        **(FULL_RECOMPUTE if mode == "all_gather" else {}),
    )
    options = Qwen3_5Options(
        **{**model_kwargs, "vocab_size": MODEL_VOCAB},
        gdn=GDNOptions(cp_mode=mode, kernel_backend="torch"),
        spec_provider="local",
        attention_backend="sdpa",
        fusion=Fusion(cross_entropy=False),
        lora=LoRAOptions(rank=4, alpha=8.0, modules=resolve_targets(EVERY_TARGET), init_seed=3),
    )
    model = build_qwen3_5_model(
        config, options, ProcessGroupCollection(tp=single, cp=cp_group, pp=single, embd=single)
    )
    hfc.load_hf_checkpoint(model, base_dir, tp_group=single)
    return model


def _train_three_steps(model, cp_group, single) -> list[float]:
    """3 AdamW steps (the CPU optimizer, lr 1e-2, gradients summed over CP) on a packed batch."""
    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.train.optimizer import CPUGradSyncOptimizer
    from tests.gdn_harness import packed_params
    from tests.model_harness import CU
    from tests.model_harness import batch as _batch

    tokens, labels, positions = _batch(250, seed=4)
    ids = thd_rank_indices(CU, cp_group.size(), cp_group.rank(), "zigzag")
    optimizer = CPUGradSyncOptimizer(
        model,
        _cfg(optim__lr=1e-2, optim__weight_decay=0.0),
        dp_cp_group=cp_group,
        tp_group=single,
        sequence_parallel=False,
    )
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(
            tokens[:, ids],
            positions[:, ids],
            None,
            labels=labels[:, ids],
            packed_seq_params=packed_params(CU, "cpu"),
        ).sum()
        (loss / CU[-1]).backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _our_logits(model, ids, cp_group) -> torch.Tensor:
    """``[t, vocab]`` logits of one document, this CP group's zigzag shares gathered."""
    import torch.distributed as dist

    from relax_gdn.layout import thd_rank_indices
    from tests.gdn_harness import packed_params

    cu = [0, ids.shape[1]]
    cp = cp_group.size()
    rows = thd_rank_indices(cu, cp, cp_group.rank(), "zigzag")
    with torch.no_grad():
        out = model.eval()(
            ids[:, rows],
            torch.arange(ids.shape[1])[None, rows],
            None,
            packed_seq_params=packed_params(cu, "cpu"),
        )[0]  # logits [batch, tokens, vocab]
    model.train()
    if cp == 1:
        return out
    parts = [torch.empty_like(out) for _ in range(cp)]
    dist.all_gather(parts, out.contiguous(), group=cp_group)
    logits = torch.empty(ids.shape[1], out.shape[-1])
    for r, part in enumerate(parts):
        logits[thd_rank_indices(cu, cp, r, "zigzag")] = part
    return logits


def _peft_merges_to_the_export(work: Path, adapter: Path, merged: Path) -> bool:
    """PEFT's own ``merge_and_unload`` of the adapter export onto the base gives the merged export's
    tensors bit for bit."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(work / "text", dtype=torch.float32)
    state = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    written = load_file(merged / "model.safetensors")
    return written.keys() <= state.keys() and all(torch.equal(state[k], v) for k, v in written.items())


def _transformers_logits(
    work: Path, ids: torch.Tensor, *, merged: Path | None = None, adapter: Path | None = None
):
    """transformers' logits of the merged export, or of the base with the PEFT adapter (fp32)."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import force_transformers_pure_torch as _force_transformers_pure_torch

    _force_transformers_pure_torch()
    model, info = AutoModelForCausalLM.from_pretrained(
        merged or work / "text", output_loading_info=True, attn_implementation="eager", dtype=torch.float32
    )
    assert not any(info.values()), info
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits[0]


def _make_base(work: Path) -> None:
    """A random Qwen3_5ForCausalLM saved by transformers into ``work/text`` (the sizes of
    tests/test_hf_checkpoint.py), its norms and decay parameters moved off their constants. Weights
    of std 0.05: this tiny model turns fp32 rounding into its logits ~140 times over at std 0.1
    (1e-7 relative noise on every weight moves them by 1.4e-5), ~40 times here: well under the 1e-5
    checked, with logits still of order 1."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tests.helpers import force_transformers_pure_torch as _force_transformers_pure_torch
    from tests.hf_sources import HF_TEXT_CONFIG

    _force_transformers_pure_torch()
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**{**HF_TEXT_CONFIG, "initializer_range": 0.05}, attn_implementation="eager")
    hf = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(work / "text")


def _export_cases(workdir: str) -> dict:
    import torch.distributed as dist

    from relax_gdn.model import hf_checkpoint as hfc
    from relax_gdn.train.hf_export import HFExportSpec, write_adapter_export, write_merged_lora_export
    from tests.gdn_harness import self_group

    torch.set_num_threads(1)
    work, rank = Path(workdir), dist.get_rank()
    single, pair = self_group(), dist.new_group([0, 1])
    if rank == 0:
        _make_base(work)
    dist.barrier()
    ids = torch.randint(0, 250, (1, EVAL_TOKENS), generator=torch.Generator().manual_seed(7))
    spec = HFExportSpec(vocab_size=256, tokenizer_vocab_size=None, tokenizer=None, like=work / "text")
    results = {}
    for cp, mode in [(1, "chunkwise"), (2, "headwise"), (2, "chunkwise"), (2, "all_gather")]:
        group = single if cp == 1 else pair
        model = _hf_lora_model(work / "text", group, single, mode)
        losses = _train_three_steps(model, group, single)
        ours = _our_logits(model, ids, group)[:, :250]
        out = work / f"cp{cp}_{mode}_rank{rank}"
        # each rank writes its own copies: rank 0 checks the merged model, rank 1 the adapter
        adapter = write_adapter_export(model, out / "adapter", spec, writer=True)
        merged = write_merged_lora_export(model, out / "merged", spec, writer=True)
        merged_logits = _transformers_logits(work, ids, merged=out / "merged")
        scale = ours.abs().max().item()
        result = {"losses": losses, "err": (ours - merged_logits).abs().max().item() / scale, "scale": scale}
        if rank == 0:
            source, written = hfc.read_hf_state_dict(work / "text"), hfc.read_hf_state_dict(out / "merged")
            result |= {
                "changed": sorted(k for k in source if not torch.equal(source[k], written[k])),
                "copied": merged.copied,
            }
        else:
            with_adapter = _transformers_logits(work, ids, adapter=out / "adapter")
            result |= {
                "peft_vs_merged": (with_adapter - merged_logits).abs().max().item() / scale,
                "peft_vs_ours": (with_adapter - ours).abs().max().item() / scale,
                "peft_merge": _peft_merges_to_the_export(work, out / "adapter", out / "merged"),
                "changed": adapter.target_modules,
            }
        results[(cp, mode)] = result
    return results


@pytest.fixture(scope="module")
def exports(gloo, tmp_path_factory):
    return gloo(_export_cases, 2, str(tmp_path_factory.mktemp("lora_exports")))


@pytest.mark.parametrize(
    "case",
    [(1, "chunkwise"), (2, "headwise"), (2, "chunkwise"), (2, "all_gather")],
    ids=lambda c: f"cp{c[0]}-{c[1]}",
)
def test_merged_and_peft_exports_give_the_models_logits_in_transformers(exports, case):
    merged, peft = exports[0][case], exports[1][case]
    assert merged["losses"][-1] < merged["losses"][0]  # it trained
    assert merged["scale"] > 1.0  # logits not dominated by tiny weights
    for rank_result in (merged, peft):  # each rank's own export: transformers on the merged model
        assert rank_result["err"] < 1e-5, rank_result
    # PEFT merging the adapter export onto the base writes the merged export, bit for bit
    assert peft["peft_merge"]
    # transformers + peft, unmerged (W·x + s·B·(A·x), rounded otherwise than (W + s·B·A)·x)
    assert peft["peft_vs_merged"] < 1e-5 and peft["peft_vs_ours"] < 1e-5, peft
    # the merged export changed exactly the adapted tensors; the rest are the base's, copied
    assert all(
        name.endswith(".weight") and any(m in name for m in LORA_MODULES) for name in merged["changed"]
    )
    assert len(merged["changed"]) == 33
    assert "model.layers.0.linear_attn.A_log" in merged["copied"] and "model.norm.weight" in merged["copied"]
    assert peft["changed"] == sorted(LORA_MODULES)


# ---------------------------------------------------------------------------------------------
# runs: checkpoints hold the adapters, resume at another TP / CP, the end-of-run exports
# ---------------------------------------------------------------------------------------------

RESUME_PAIRS = (("cp2", "tp2"), ("tp2", "cp2"), ("cp2", "cp1"), ("cp2", "dynamic"))


def _lora_run_cfg(layout: str, steps: int, **dotted):
    from tests.helpers import reshard_run_config

    return reshard_run_config(layout, "chunkwise", steps, model__lora__rank=4, **dotted)


def _lora_resume_cases(tmp: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader

    from relax_gdn.train import run_training
    from tests.helpers import step_values

    torch.set_num_threads(1)
    tmp = Path(tmp)
    out = {"reference": {}, "resumed": {}}
    saved = {}
    for layout in ("cp2", "tp2"):  # 4 steps, the checkpoint of step 2 kept
        run = run_training(
            _lora_run_cfg(layout, 4, checkpoint__dir=str(tmp / layout), checkpoint__every_steps=2),
            None,
            runtime=job_runtime(),
        )
        out["reference"][layout] = [step_values(r) for r in run.records]
        saved[layout] = run.checkpoints[0]
    for source, target in RESUME_PAIRS:
        resumed = run_training(
            _lora_run_cfg(target, 4, checkpoint__resume=str(saved[source])), None, runtime=job_runtime()
        )
        out["resumed"][(source, target)] = (resumed.start_step, [step_values(r) for r in resumed.records])
    # checkpoint.resume=auto: a run stopped after step 2 continues where it stopped
    auto = _lora_run_cfg("cp2", 4, checkpoint__dir=str(tmp / "auto"), checkpoint__resume="auto")
    run_training(
        _lora_run_cfg("cp2", 2, checkpoint__dir=str(tmp / "auto"), checkpoint__save_final=True),
        None,
        runtime=job_runtime(),
    )
    resumed = run_training(auto, None, runtime=job_runtime())
    out["auto"] = (resumed.start_step, [step_values(r) for r in resumed.records])
    meta = FileSystemReader(str(saved["cp2"])).read_metadata()
    out["keys"] = sorted(meta.state_dict_metadata)
    out["bytes"] = sum(p.stat().st_size for p in Path(saved["cp2"]).glob("*.distcp"))
    # a full fine-tuning run may not continue a LoRA checkpoint
    try:
        run_training(_run_cfg_full(checkpoint__resume=str(saved["cp2"])), None, runtime=job_runtime())
        out["full_from_lora"] = None
    except Exception as e:  # noqa: BLE001 - the RecipeError's message is asserted in the parent
        out["full_from_lora"] = f"{type(e).__name__}: {e}"
    out["seeded_checkpoint"] = str(saved["cp2"])
    dist.barrier()
    return out


def _run_cfg_full(**dotted):
    from tests.helpers import reshard_run_config

    return reshard_run_config("cp2", "chunkwise", 4, **dotted)


@pytest.fixture(scope="module")
def lora_resume(gloo, tmp_path_factory):
    return gloo(_lora_resume_cases, 2, str(tmp_path_factory.mktemp("lora_resume")), timeout_s=1800)


def test_a_peft_adapter_export_of_a_seeded_base_is_one_message_naming_it(lora_resume, tmp_path, capsys):
    """Adapters trained on the preset's seeded base have no Hugging Face base to load onto."""
    from relax_gdn.export_hf import main as export_main

    code = export_main([lora_resume[0]["seeded_checkpoint"], str(tmp_path / "adapter"), "--adapter"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "the seeded base of preset qwen3_5_tiny (train.seed=1234, no model.hf_checkpoint)" in err
    assert "export the merged model instead (without --adapter)" in err
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("pair", RESUME_PAIRS, ids=lambda p: f"{p[0]}_to_{p[1]}")
def test_lora_checkpoints_resume_at_another_tp_and_cp(lora_resume, pair):
    from tests.helpers import EQ_TOL

    for rank_out in lora_resume:
        start, resumed = rank_out["resumed"][pair]
        reference = rank_out["reference"][pair[0]]
        assert start == 2 and [r["step"] for r in resumed] == [3, 4]
        for got, want in zip(resumed, reference[2:]):
            for key in ("loss", "grad_norm", "lr"):
                assert got[key] == pytest.approx(want[key], rel=EQ_TOL), (pair, key, got, want)


def test_lora_checkpoints_hold_only_the_adapters_and_resume_auto(lora_resume):
    from tests.helpers import EQ_TOL, checkpoint_model_keys

    r = lora_resume[0]
    start, records = r["auto"]
    assert start == 2 and [x["step"] for x in records] == [3, 4]
    for got, want in zip(records, r["reference"]["cp2"][2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=EQ_TOL)
    model_keys = checkpoint_model_keys(r["keys"])
    tensors = model_keys + [k for k in r["keys"] if k.startswith("optimizer.state.")]
    assert model_keys and all(".lora." in k for k in tensors), [k for k in tensors if ".lora." not in k][:5]
    assert any(k.startswith("optimizer.state.exp_avg.") for k in tensors)
    # rank-4 adapters on every projection of the tiny model: 18,368 fp32 parameters and two moments
    # (220 kB; the checkpoint's files add their index and alignment); the whole model's 354,344
    # parameters alone would be 1.4 MB, with their moments 4.3 MB
    from relax_gdn.train.memory import lora_parameter_count

    trained = lora_parameter_count(_shape("qwen3_5_tiny", rank=4))
    assert trained == 18_368 and trained * 12 < r["bytes"] < 2**20, r["bytes"]
    assert "it holds only LoRA adapters" in r["full_from_lora"]


# ---------------------------------------------------------------------------------------------
# a LoRA run from a VLM-layout checkpoint: its end-of-run exports, the CLI, transformers + peft
# ---------------------------------------------------------------------------------------------


def _vlm_run_cases(tmp: str) -> dict:
    from relax_gdn.export_hf import main as export_main
    from relax_gdn.model import hf_checkpoint as hfc
    from relax_gdn.runtime import Runtime
    from relax_gdn.train import run_training
    from tests.helpers import force_transformers_pure_torch as _force_transformers_pure_torch
    from tests.hf_sources import files_of, make_vlm_source

    torch.set_num_threads(1)
    tmp = Path(tmp)
    source_dir, ckpt, run_dir = tmp / "source", tmp / "ckpt", tmp / "run"
    make_vlm_source(source_dir)  # bf16, fp32 A_log, two shards, vision tower, MTP, the byte tokenizer
    cfg = _cfg(
        model__hf_checkpoint=str(source_dir),
        data__tokenizer=str(source_dir),
        model__lora__rank=4,
        model__lora__targets=EVERY_TARGET,
        model__fused_cross_entropy=False,
        train__steps=3,
        train__global_batch_size=4,
        train__max_tokens_per_gpu=1024,
        data__max_sample_tokens=512,
        data__synthetic_max_steps=1,
        data__num_samples=32,
        optim__warmup_steps=1,
        logging__console=False,
        checkpoint__dir=str(ckpt),
        checkpoint__save_final=True,
        checkpoint__export_hf_final=True,
    )
    with (
        Runtime() as runtime
    ):  # the run as train.py has it; the CLI below installs its own, as entry points do
        run_training(cfg, run_dir, runtime=runtime)
    r = {
        "cli_merged": export_main([str(ckpt), str(tmp / "merged")]),
        "cli_adapter": export_main([str(ckpt), str(tmp / "adapter"), "--adapter"]),
    }
    r["cli_equal"] = (
        files_of(tmp / "merged") == files_of(run_dir / "hf"),
        files_of(tmp / "adapter") == files_of(run_dir / "hf_adapter"),
    )
    source, merged = hfc.read_hf_state_dict(source_dir), hfc.read_hf_state_dict(run_dir / "hf")
    r["same_names"] = sorted(source) == sorted(merged)
    r["changed"] = sorted(n for n in source if not torch.equal(source[n], merged[n]))
    r["a_log"] = {str(merged[n].dtype) for n in merged if n.endswith("A_log")}

    _force_transformers_pure_torch()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    ids = torch.randint(0, 264, (1, 29), generator=torch.Generator().manual_seed(2))

    def logits(cls, path, adapter=None):
        model = cls.from_pretrained(path, dtype=torch.float32)
        if adapter is not None and cls is AutoModelForCausalLM:
            # the text class of a VLM base names its modules model.layers...: transformers' own
            # adapter loading maps the checkpoint's names (model.language_model.layers...) as it
            # does for the base's weights; PeftModel.from_pretrained would miss them
            model.load_adapter(str(adapter))
        elif adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
        with torch.no_grad():
            return model.eval()(input_ids=ids).logits[0]

    for cls in (AutoModelForCausalLM, Qwen3_5ForConditionalGeneration):
        want = logits(cls, run_dir / "hf")
        scale = want.abs().max().item()
        r[cls.__name__] = {
            "peft": (logits(cls, source_dir, run_dir / "hf_adapter") - want).abs().max().item() / scale,
            "base": (logits(cls, source_dir) - want).abs().max().item() / scale,
        }
    r["adapter_config"] = json.loads((run_dir / "hf_adapter" / "adapter_config.json").read_text())
    return r


@pytest.fixture(scope="module")
def vlm_run(gloo, tmp_path_factory):
    return gloo(_vlm_run_cases, 1, str(tmp_path_factory.mktemp("lora_vlm")), runtime=False)[0]


BF16_EXPORT_TOL = 1e-2  # relative logits: a bf16 rounding of every adapted weight


def test_a_lora_run_from_a_vlm_checkpoint_exports_both_ways(vlm_run):
    r = vlm_run
    assert (r["cli_merged"], r["cli_adapter"]) == (0, 0)
    assert r["cli_equal"] == (True, True)  # the CLI writes what the run's own export wrote
    assert r["same_names"]  # the drop-in layout: vision tower and MTP kept
    assert len(r["changed"]) == 33 and all(
        n.startswith(("model.language_model.", "lm_head.")) for n in r["changed"]
    )
    assert r["a_log"] == {"torch.float32"}  # copied from the source, never rounded through bf16
    config = r["adapter_config"]
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert sorted(config["target_modules"]) == sorted(LORA_MODULES)
    for cls in ("AutoModelForCausalLM", "Qwen3_5ForConditionalGeneration"):
        # base + the PEFT adapter == the merged export, up to the export's one bf16 rounding of
        # W + s·B·A (the base is bf16; an fp32 base is held to 1e-5 in test_merged_and_peft_exports_give_the_models_logits_in_transformers)
        assert r[cls]["peft"] < BF16_EXPORT_TOL, (cls, r[cls])
        assert r[cls]["base"] > 30 * BF16_EXPORT_TOL, (cls, r[cls])  # and the adapters changed the model
