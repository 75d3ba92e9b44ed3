"""Multi-token prediction (relax_gdn.model.mtp, ``model.mtp.*``) on CPU.

* In this process: the MTP targets of a packed micro-batch (the next position's label within the
  document, never the next document's; equal to Megatron-Core's own packed roll at CP 1, and every
  CP rank's shard the zigzag rows of the whole); the ``mtp.*`` conversion plan and its exact round
  trip; what the drop-in export writes, copies or adds; the configuration's rules and the
  resolution of ``model.mtp.num_layers=null`` from a checkpoint; FLOPs and memory of the layer;
  ``mtp_loss`` in the console and in ``relax_gdn.compare``.
* One spawn of 4 gloo processes (slow): the MTP logits and loss of the model at CP 1 equal a pure-
  torch reference written from the HF layout (:mod:`relax_gdn.model.mtp_reference`, fp64); the
  tiny model with its MTP layer at CP 2 (every GDN mode, dynamic CP) and CP 4 (every GDN mode) and
  TP 2 x CP 2 (SP, recompute) equals CP 1 on the same weights (per-token LM and MTP losses, every
  gradient); training runs at DP 4, DP 2 x CP 2 and CP 4 log the same ``loss`` and ``mtp_loss``.
* One spawned process (slow): a tiny VLM-layout checkpoint with ``mtp.*`` (transformers' own classes)
  -> a run that imports and trains its MTP layer (``model.mtp.num_layers`` left null) -> the
  export writes the trained ``mtp.*`` (not a copy), the rest as the drop-in export does;
  transformers loads it, and its ``MtpModel`` reads the exported MTP layer to the logits our
  model computes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from relax_gdn.config import ConfigError, RunConfig, validate
from relax_gdn.model import hf_checkpoint as hfc
from relax_gdn.model.hf_checkpoint.source import SourceTensor
from tests.distributed import job_runtime
from tests.helpers import export_summary_line
from tests.model_harness import GRAD_TOL, LOSS_TOL
from tests.model_harness import tolerance as _tolerance

MTP_WEIGHT = 0.1
# document lengths: multiples of 2 x 4 (the padded layout is the same at CP 1, 2 and 4, so per-token
# results compare row by row), short ones and one spanning every rank's zigzag chunks at CP 4
LENGTHS = (16, 8, 48, 24)
# fp64 reference vs the model: Megatron-Core's attention output gate takes its sigmoid in fp32
# (``Attention._apply_output_gate``), the one step below fp64 on the MTP layer's path
REF_LOGIT_TOL = 1e-6  # relative to the largest |logit|
REF_LOSS_TOL = 1e-5  # absolute, per token: the model's cross-entropy runs in fp32


def _samples(seed: int = 0, vocab: int = 256):
    from relax_gdn.data import Sample

    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            torch.randint(0, vocab, (n,), generator=g).tolist(),
            (torch.rand(n, generator=g) > 0.3).tolist(),
            i,
        )
        for i, n in enumerate(LENGTHS)
    ]


# ---------------------------------------------------------------------------------------------
# the MTP targets of a packed micro-batch
# ---------------------------------------------------------------------------------------------


def test_mtp_targets_are_the_next_positions_label_within_the_document():
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    from relax_gdn.data import Sample, make_micro_batch
    from relax_gdn.layout import thd_rank_indices

    samples = [
        Sample([5, 6, 7, 8, 9], [True] * 5, 0),
        Sample([11, 12], [True, True], 1),
        Sample([20, 21, 22, 23, 24, 25, 26], [False, True, True, False, True, True, True], 2),
        Sample([30], [True], 3),
    ]
    mb = make_micro_batch(samples, cp_size=1, cp_rank=0, device="cpu", pad_id=0, mtp=True)
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 6, 8, 16, 18]  # padded to multiples of 2
    labels, mask = mb.mtp_labels[0].tolist(), mb.mtp_loss_mask[0].tolist()
    # position i predicts token i + 2 of its document, where predicting it counts in the LM loss
    assert labels == [7, 8, 9, 0, 0, 0, 0, 0, 22, 23, 24, 25, 26, 0, 0, 0, 0, 0]
    assert mask == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0]
    assert mb.labels[0, :6].tolist() == [6, 7, 8, 9, 0, 0]  # the MTP input: the next token, padding after
    assert sum(s.num_mtp_loss_tokens for s in samples) == sum(mask) == 7
    # Megatron-Core's own roll of the labels and loss mask within each packed document (CP 1)
    rolled_labels, _ = roll_tensor(mb.labels, shifts=-1, dims=-1, packed_seq_params=mb.packed_seq_params)
    rolled_mask, _ = roll_tensor(mb.loss_mask, shifts=-1, dims=-1, packed_seq_params=mb.packed_seq_params)
    assert torch.equal(rolled_labels, mb.mtp_labels) and torch.equal(rolled_mask, mb.mtp_loss_mask)
    # every CP rank's shard: the targets of its own rows, whose token two ahead may live on another rank
    for cp in (2, 4):
        shards = [
            make_micro_batch(samples, cp_size=cp, cp_rank=r, device="cpu", pad_id=0, mtp=True)
            for r in range(cp)
        ]
        cu = shards[0].packed_seq_params.cu_seqlens_q.tolist()
        tokens, targets, target_mask = [0] * cu[-1], [0] * cu[-1], [0.0] * cu[-1]
        for s, start in zip(samples, cu):
            tokens[start : start + len(s)] = s.input_ids
            for j in range(len(s) - 2):
                targets[start + j], target_mask[start + j] = s.input_ids[j + 2], float(s.loss_mask[j + 1])
        for r, shard in enumerate(shards):
            ids = thd_rank_indices(cu, cp, r, "zigzag").tolist()
            assert shard.tokens[0].tolist() == [tokens[i] for i in ids]
            assert shard.mtp_labels[0].tolist() == [targets[i] for i in ids], (cp, r)
            assert shard.mtp_loss_mask[0].tolist() == [target_mask[i] for i in ids], (cp, r)
        crossing = [
            i
            for i in thd_rank_indices(cu, cp, 0, "zigzag").tolist()
            if target_mask[i] and i + 2 not in set(thd_rank_indices(cu, cp, 0, "zigzag").tolist())
        ]
        assert crossing, cp  # rank 0 holds targets whose token is another rank's
    assert make_micro_batch(samples, cp_size=1, cp_rank=0, device="cpu", pad_id=0).mtp_labels is None


# ---------------------------------------------------------------------------------------------
# the HF mapping
# ---------------------------------------------------------------------------------------------

MTP_HF_NAMES = {
    "mtp.fc.weight": (64, 128),
    "mtp.pre_fc_norm_embedding.weight": (64,),
    "mtp.pre_fc_norm_hidden.weight": (64,),
    "mtp.norm.weight": (64,),
    "mtp.layers.0.input_layernorm.weight": (64,),
    "mtp.layers.0.post_attention_layernorm.weight": (64,),
    "mtp.layers.0.self_attn.q_proj.weight": (128, 64),
    "mtp.layers.0.self_attn.k_proj.weight": (32, 64),
    "mtp.layers.0.self_attn.v_proj.weight": (32, 64),
    "mtp.layers.0.self_attn.o_proj.weight": (64, 64),
    "mtp.layers.0.self_attn.q_norm.weight": (16,),
    "mtp.layers.0.self_attn.k_norm.weight": (16,),
    "mtp.layers.0.mlp.gate_proj.weight": (128, 64),
    "mtp.layers.0.mlp.up_proj.weight": (128, 64),
    "mtp.layers.0.mlp.down_proj.weight": (64, 128),
}


def test_mtp_conversion_plan_names_shapes_and_exact_round_trip():
    from tests.hf_sources import HF_TEXT_CONFIG, random_hf_state

    dims = hfc.dims_from_hf_config({**HF_TEXT_CONFIG, "mtp_num_hidden_layers": 1})
    assert dims.mtp_num_layers == 1 and hfc.dims_from_hf_config(HF_TEXT_CONFIG).mtp_num_layers == 0
    rules = [r for r in hfc.conversion_plan(dims) if r.mcore.startswith("mtp.")]
    written = {name: shape for r in rules for name, shape in zip(r.hf, r.hf_shapes)}
    assert written == MTP_HF_NAMES
    by_mcore = {r.mcore: r.hf for r in rules}
    assert by_mcore["mtp.layers.0.eh_proj.weight"] == ("mtp.fc.weight",)
    assert by_mcore["mtp.layers.0.enorm.weight"] == ("mtp.pre_fc_norm_embedding.weight",)
    assert by_mcore["mtp.layers.0.hnorm.weight"] == ("mtp.pre_fc_norm_hidden.weight",)
    assert by_mcore["mtp.layers.0.final_layernorm.weight"] == ("mtp.norm.weight",)
    assert by_mcore["mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.weight"] == tuple(
        f"mtp.layers.0.self_attn.{p}_proj.weight" for p in "qkv"
    )
    state = random_hf_state(dims)
    mcore = hfc.hf_to_mcore_state_dict(state, dims)
    back = hfc.mcore_to_hf_state_dict(mcore, dims)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    # the plain model (no MTP layer) ignores the checkpoint's mtp.* tensors
    plain = hfc.dims_from_hf_config(HF_TEXT_CONFIG)
    assert set(hfc.hf_to_mcore_state_dict(state, plain)) == {r.mcore for r in hfc.conversion_plan(plain)}
    # a text-layout export says how many MTP layers it holds, and only then
    config = hfc.hf_text_config(dims, base={**HF_TEXT_CONFIG, "mtp_num_hidden_layers": 3})
    assert config["mtp_num_hidden_layers"] == 1 and config["mtp_use_dedicated_embeddings"] is False
    assert "mtp_num_hidden_layers" not in hfc.hf_text_config(plain, base={"mtp_num_hidden_layers": 1})


def _source(tensors: dict[str, tuple[int, ...]], config: dict) -> hfc.HFCheckpoint:
    return hfc.HFCheckpoint(
        Path("/src"),
        {n: SourceTensor("model.safetensors", torch.bfloat16, s) for n, s in tensors.items()},
        ("model.safetensors",),
        False,
        {},
        config,
    )


def test_export_writes_a_trained_mtp_layer_and_adds_it_to_a_source_without_one(tmp_path):
    from relax_gdn.model.hf_checkpoint.drop_in import _write_config

    text = {
        "model.language_model.embed_tokens.weight": (8, 4),
        "lm_head.weight": (8, 4),
        "model.visual.blocks.0.attn.qkv.weight": (3, 2),
    }
    trained = {"model.embed_tokens.weight": (8, 4), "lm_head.weight": (8, 4), **MTP_HF_NAMES}
    with_mtp = _source({**text, **MTP_HF_NAMES}, {})
    origins, added = hfc.tensor_origins(with_mtp, trained)
    assert added == [] and all(origins[n] is hfc.Origin.TRAINED for n in MTP_HF_NAMES)
    assert origins["model.visual.blocks.0.attn.qkv.weight"] is hfc.Origin.COPIED
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"hidden_size": 4}}
    origins, added = hfc.tensor_origins(_source(text, config), trained)
    assert sorted(added) == sorted(MTP_HF_NAMES) and hfc.Origin.TRAINED in origins.values()
    source = hfc.HFCheckpoint(tmp_path, {}, (), False, {}, config)
    (tmp_path / "out").mkdir()
    changes = _write_config(source, tmp_path / "out", added)
    assert changes == {"text_config.mtp_num_hidden_layers": (None, 1)}
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["text_config"]["mtp_num_hidden_layers"] == 1 and "mtp_num_hidden_layers" not in written
    # without a run that trains it, a source's MTP layer is copied as before
    origins, _ = hfc.tensor_origins(with_mtp, {k: v for k, v in trained.items() if not k.startswith("mtp.")})
    assert all(origins[n] is hfc.Origin.COPIED for n in MTP_HF_NAMES)


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


def _problems(**mtp) -> str:
    cfg = RunConfig().with_overrides({f"model.mtp.{k}" if "." not in k else k: v for k, v in mtp.items()})
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    return str(e.value)


def test_mtp_configuration_rules_and_defaults():
    assert RunConfig().model.mtp.num_layers is None and RunConfig().model.mtp.loss_weight == 0.1
    for ok in (0, 1, None):
        validate(RunConfig().with_overrides({"model.mtp.num_layers": ok}), 1)
    assert "model.mtp.num_layers=2 must be 0 (off), 1 (Qwen3.5's one MTP layer" in _problems(num_layers=2)
    for weight in (0, -1.0, math.inf, "x", True):
        assert f"model.mtp.loss_weight={weight!r} must be a number > 0" in _problems(loss_weight=weight), (
            weight
        )
    te = _problems(num_layers=1, **{"model.spec_provider": "te"})
    assert (
        te.count("model.mtp") == 2
        and "use model.spec_provider=auto (or local), or model.mtp.num_layers=0" in te
    )


def test_null_num_layers_is_what_the_checkpoint_holds(tmp_path):
    from safetensors.torch import save_file

    from relax_gdn.train.build import resolve_mtp_layers

    def checkpoint(name, tensors):
        (tmp_path / name).mkdir()
        save_file({k: torch.zeros(2) for k in tensors}, str(tmp_path / name / "model.safetensors"))
        return str(tmp_path / name)

    with_mtp = checkpoint("with", ["model.embed_tokens.weight", *MTP_HF_NAMES])
    without = checkpoint("without", ["model.embed_tokens.weight"])
    layers = {}
    for name, source, num_layers in (
        ("with", with_mtp, None),
        ("without", without, None),
        ("none", None, None),
        ("explicit", with_mtp, 0),
    ):
        cfg = RunConfig().with_overrides({"model.hf_checkpoint": source, "model.mtp.num_layers": num_layers})
        layers[name] = resolve_mtp_layers(cfg).model.mtp.num_layers
    assert layers == {"with": 1, "without": 0, "none": 0, "explicit": 0}


# ---------------------------------------------------------------------------------------------
# FLOPs, memory, metrics and the comparison
# ---------------------------------------------------------------------------------------------


def test_flops_and_memory_count_the_mtp_layer():
    from dataclasses import replace

    from relax_gdn.model import qwen3_5_config
    from relax_gdn.train.flops import ModelShape, megatron_flops_breakdown
    from relax_gdn.train.memory import estimate_memory, parameter_count

    shape = ModelShape.from_transformer_config(qwen3_5_config("qwen3_5_9b"), 248_320)
    mtp = replace(shape, mtp_num_layers=1)
    plain, more = megatron_flops_breakdown(shape, 8192, 8192**2), megatron_flops_breakdown(mtp, 8192, 8192**2)
    attention = (plain.attention_projections + plain.attention_core) / shape.num_attention_layers
    h = shape.hidden_size
    fusion = 6 * 8192 * (2 * h * h + 3 * h)  # eh_proj and its norms, fwd + bwd
    assert more.mtp == pytest.approx(
        attention + plain.mlp / shape.num_layers + fusion + plain.logits, rel=1e-12
    )
    assert more.total - plain.total == pytest.approx(more.mtp, rel=1e-12)
    assert 0.15 < more.mtp / plain.total < 0.17  # the 9B at 8k: an attention layer and a second output layer
    # the parameters of one attention layer, its MLP, eh_proj [h, 2h] and three norms
    assert parameter_count(mtp) - parameter_count(shape) == pytest.approx(
        58.72e6 + 150.99e6 + 2 * h * h + 3 * h, rel=1e-4
    )
    settings = dict(tokens_per_gpu=8192, recompute="selective")
    base, with_mtp = estimate_memory(shape, **settings), estimate_memory(mtp, **settings)
    assert with_mtp.activations > base.activations and with_mtp.weights > base.weights
    # the chunked loss of the MTP layer holds one more output-layer gradient and one more input gradient (bf16)
    assert with_mtp.logits - base.logits == 248_320 * h * 2 + 8192 * h * 2


def test_mtp_loss_in_the_console_and_the_comparison(tmp_path):
    from relax_gdn.compare import compare_runs
    from relax_gdn.compare.report import write_reports
    from relax_gdn.compare.runs import Run
    from relax_gdn.train.console import run_summary, step_line

    def records(mtp: bool, offset: float):
        out = []
        for step in range(1, 13):
            r = {
                "step": step,
                "loss": 6 - 0.1 * step + offset,
                "grad_norm": 1.0,
                "lr": 1e-3,
                "tokens": 100,
                "tokens_per_s": 1000.0 + offset,
                "mfu": None,
                "tflops_per_gpu": 1.0,
                "step_time_s": 0.1,
            }
            if mtp:
                r["mtp_loss"] = 7 - 0.2 * step + offset
            out.append(r)
        return out

    runs = [
        Run(
            f"{name}{seed}",
            "test",
            {"model.mtp.num_layers": int(mtp), "train.seed": seed},
            records(mtp, 1e-3 * seed),
        )
        for name, mtp in (("on", True), ("off", False))
        for seed in (1, 2)
    ]
    line = step_line(runs[0].records[0], 12)
    assert "loss 5.901 mtp_loss 6.801 grad_norm" in line
    assert "mtp_loss" not in step_line(runs[2].records[0], 12)

    class Result:
        records, start_step, preempted_at, run_dir, checkpoints, wandb_dir = (
            runs[0].records,
            0,
            None,
            None,
            [],
            None,
        )

    rows = dict(run_summary(Result()))
    assert rows["MTP loss"] == "6.801 -> 4.601"
    summary = compare_runs(runs, ["model.mtp.num_layers=0"])
    on = next(v for v in summary["variants"] if not v["baseline"])
    assert on["stats"]["final_mtp_loss"]["median"] == pytest.approx(4.6015)
    paths = write_reports(runs, summary, tmp_path)
    assert "mtp_loss.png" in paths and "final MTP loss" in paths["summary.md"].read_text()
    only_off = compare_runs([r for r in runs if r.name.startswith("off")])
    assert (
        "final MTP loss" not in write_reports(runs[2:], only_off, tmp_path / "off")["summary.md"].read_text()
    )
    (comparison,) = summary["comparisons"]
    assert comparison["mtp_loss"]["verdict"] == "no data"  # the baseline trains no MTP layer


# ---------------------------------------------------------------------------------------------
# the model: the fp64 reference at CP 1, and CP 2 / 4, TP 2 x CP 2 against CP 1 (one 4-rank spawn)
# ---------------------------------------------------------------------------------------------


def _build(config, tp, cp, single, mode="chunkwise", mtp=None, **gdn):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import build_qwen3_5_preset_model
    from relax_gdn.model.mtp import MTPOptions

    options = {k: gdn.pop(k) for k in ("recompute_skips_unread_gemm", "fusion") if k in gdn}
    pgs = ProcessGroupCollection(tp=tp, cp=cp, pp=single, embd=single)
    return build_qwen3_5_preset_model(
        "qwen3_5_tiny",
        config,
        pg_collection=pgs,
        gdn=GDNOptions(cp_mode=mode, kernel_backend="torch", **gdn),
        attention_backend="sdpa",
        mtp=mtp or MTPOptions(1),
        **options,
    )


def _micro_batch(cp, rank, cp_group=None):
    from relax_gdn.data import make_micro_batch

    return make_micro_batch(
        _samples(),
        cp_size=cp,
        cp_rank=rank,
        device="cpu",
        pad_id=0,
        mtp=True,
        cp_group=cp_group,
        carries_cp_group=cp_group is not None,
    )


def _run(model, mb):
    """Per-token LM and MTP losses ``[2, t]`` and the gradients of the training objective's sums."""
    out = model(
        mb.tokens,
        mb.position_ids,
        None,
        labels=mb.labels,
        packed_seq_params=mb.packed_seq_params,
        mtp_input_ids=mb.labels,
        mtp_labels=mb.mtp_labels,
    )
    ((out[0] * mb.loss_mask).sum() + MTP_WEIGHT * (out[1] * mb.mtp_loss_mask).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out[:, 0].detach(), grads


def _reference_case(single) -> dict:
    """CP 1, fp64: the model's MTP logits and losses against :mod:`relax_gdn.model.mtp_reference` fed
    the model's decoder output and its weights in HF names; the summed (fused) form equals the
    per-token one."""
    import torch.nn.functional as F

    from relax_gdn.model import qwen3_5_config
    from relax_gdn.model.hf_checkpoint.convert import model_tensors
    from relax_gdn.model.mtp_reference import MTPReferenceShape, mtp_reference_logits

    torch.manual_seed(1)
    model = _build(
        qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True), single, single, single
    ).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # RoPE's frequencies in fp64 too (Megatron-Core computes them in fp32 and keeps them unregistered)
    model.rotary_pos_emb.inv_freq = 1.0 / 1e7 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    mb = _micro_batch(1, 0)
    cu = mb.packed_seq_params.cu_seqlens_q.tolist()
    captured = {}
    hook = model.decoder.register_forward_hook(lambda module, args, out: captured.setdefault("hidden", out))
    with torch.no_grad():
        logits = model(
            mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params, mtp_input_ids=mb.labels
        )
        losses = model(
            mb.tokens,
            mb.position_ids,
            None,
            labels=mb.labels,
            packed_seq_params=mb.packed_seq_params,
            mtp_input_ids=mb.labels,
            mtp_labels=mb.mtp_labels,
        )
        sums = model(
            mb.tokens,
            mb.position_ids,
            None,
            labels=mb.labels,
            loss_mask=mb.loss_mask,
            packed_seq_params=mb.packed_seq_params,
            mtp_input_ids=mb.labels,
            mtp_labels=mb.mtp_labels,
            mtp_loss_mask=mb.mtp_loss_mask,
        )
    hook.remove()
    weights = hfc.mcore_to_hf_state_dict(
        {k: v.detach() for k, v in model_tensors(model).items()}, hfc.dims_from_model(model)
    )
    shape = MTPReferenceShape.from_hf_config(hfc.hf_text_config(hfc.dims_from_model(model)))
    reference = mtp_reference_logits(
        weights, captured["hidden"][:, 0], mb.labels[0], mb.position_ids[0], cu, shape
    )
    reference_loss = F.cross_entropy(reference, mb.mtp_labels[0], reduction="none")
    swapped = dict(
        weights,
        **{
            "mtp.pre_fc_norm_embedding.weight": weights["mtp.pre_fc_norm_hidden.weight"],
            "mtp.pre_fc_norm_hidden.weight": weights["mtp.pre_fc_norm_embedding.weight"],
        },
    )
    unshifted = mtp_reference_logits(
        weights, captured["hidden"][:, 0], mb.tokens[0], mb.position_ids[0], cu, shape
    )
    scale = reference.abs().max().item()
    per_token = losses[:, 0] * torch.stack([mb.loss_mask[0], mb.mtp_loss_mask[0]])
    return {
        "dtype": str(logits.dtype),
        "shape": tuple(logits.shape),
        "logits": (logits[1, 0] - reference).abs().max().item() / scale,
        "loss": (losses[1, 0] - reference_loss).abs().max().item(),
        "sums": (sums - per_token.sum(-1)).abs().max().item(),
        # what the comparison would see with the two fusion norms swapped, or the input not shifted
        "swapped_norms": (
            mtp_reference_logits(
                swapped, captured["hidden"][:, 0], mb.labels[0], mb.position_ids[0], cu, shape
            )
            - reference
        )
        .abs()
        .max()
        .item()
        / scale,
        "unshifted": (unshifted - reference).abs().max().item() / scale,
    }


def _errors(reference, got, ids, shard=lambda n, g: g) -> dict[str, float]:
    from tests.model_harness import errors

    return errors(*reference, *got, ids, shard)


def _parity_cases() -> dict:
    import torch.distributed as dist

    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model import qwen3_5_config
    from relax_gdn.model.mtp import MTPOptions
    from tests.model_harness import FULL_RECOMPUTE, tp_shard
    from tests.model_harness import finalize_grads as _finalize_grads

    torch.set_num_threads(1)
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(4)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    single, pair, world = singles[rank], pairs[rank // 2], dist.group.WORLD
    # first: the runs make (and release) Megatron-Core's process groups; the SP models below leave
    # its global memory buffer behind
    results = {"training": _training_runs()}
    if rank == 0:
        results["reference"] = _reference_case(single)

    torch.manual_seed(0)
    base = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True)
    reference = _build(base, single, single, single)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = reference.state_dict()
    ref = _run(reference, _micro_batch(1, 0))
    cu = _micro_batch(1, 0).packed_seq_params.cu_seqlens_q.tolist()
    block = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3)
    cases = [  # (name, CP group, GDN mode, config fields, MTP options, model options)
        ("cp2 headwise", pair, "headwise", {}, MTPOptions(1), {}),
        ("cp2 chunkwise", pair, "chunkwise", {}, MTPOptions(1), {}),
        (
            "cp2 all_gather, MTP recomputed whole",
            pair,
            "all_gather",
            FULL_RECOMPUTE,
            MTPOptions(1, recompute_whole_layer=True),
            {},
        ),
        ("cp4 headwise", world, "headwise", {}, MTPOptions(1), {}),
        ("cp4 chunkwise", world, "chunkwise", {}, MTPOptions(1), {}),
        (
            "cp4 all_gather, skip_unused",
            world,
            "all_gather",
            block,
            MTPOptions(1),
            {"recompute_skips_unread_gemm": True},
        ),
    ]
    for name, group, mode, fields, mtp, options in cases:
        config = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True, **fields)
        model = _build(config, single, group, single, mode, mtp, **options)
        model.load_state_dict(state)
        cp, cp_rank = group.size(), group.rank()
        got = _run(model, _micro_batch(cp, cp_rank))
        grads = _finalize_grads(model, got[1], config, single, group)
        results[name] = _errors(ref, (got[0], grads), thd_rank_indices(cu, cp, cp_rank, "zigzag"))

    # dynamic CP: the model's CP group is all 4 ranks, the micro-batch runs on a pair it carries
    model = _build(base, single, world, single, "chunkwise", max_cp_size=4)
    model.load_state_dict(state)
    got = _run(model, _micro_batch(2, pair.rank(), cp_group=pair))
    results["cp2 dynamic"] = _errors(
        ref,
        (got[0], _finalize_grads(model, got[1], base, single, pair)),
        thd_rank_indices(cu, 2, pair.rank(), "zigzag"),
    )

    # TP 2 x CP 2: TP groups {0,1},{2,3}; CP groups {0,2},{1,3}
    tp_group, cp_group = pairs[rank // 2], strided[rank % 2]
    ids = thd_rank_indices(cu, 2, cp_group.rank(), "zigzag")
    selective = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    for name, sp, fields, mtp in (
        ("tp2cp2 sp", True, {}, MTPOptions(1)),
        ("tp2cp2 selective", False, selective, MTPOptions(1, recompute_core_attention=True)),
    ):
        config = qwen3_5_config(
            "qwen3_5_tiny",
            use_cpu_initialization=True,
            tensor_model_parallel_size=2,
            sequence_parallel=sp,
            **fields,
        )
        model = _build(config, tp_group, cp_group, single, "chunkwise", mtp)
        params = dict(model.named_parameters())

        def shard(n, full, params=params, config=config):
            return tp_shard(n, full, params[n], config, 2, tp_group.rank())

        model.load_state_dict({k: shard(k, v) if k in params else v for k, v in state.items()})
        got = _run(model, _micro_batch(2, cp_group.rank()))
        grads = _finalize_grads(model, got[1], config, tp_group, cp_group)
        results[name] = _errors(ref, (got[0], grads), ids, shard)
    return results


def _training_runs() -> dict:
    """Step 1 of the same global batch at DP 4, DP 2 x CP 2 (chunkwise) and CP 4 (all_gather, full
    recompute): the logged LM and MTP losses and the gradient norm (the objective's) agree."""
    from relax_gdn.train import run_training
    from tests.helpers import small_config as _cfg

    runs = {
        "dp4": {},
        "cp2": {"parallel__cp": 2},
        "cp4": {"parallel__cp": 4, "gdn__cp_mode": "all_gather", "recompute__granularity": "full"},
    }
    out = {}
    for name, fields in runs.items():
        cfg = _cfg(
            train__steps=1,
            train__global_batch_size=8,
            logging__jsonl=False,
            data__synthetic_max_steps=1,
            model__mtp__num_layers=1,
            model__mtp__loss_weight=0.3,
            **fields,
        )
        records = run_training(cfg, None, runtime=job_runtime()).records
        out[name] = [{k: r.get(k) for k in ("loss", "mtp_loss", "grad_norm")} for r in records]
    return out


@pytest.fixture(scope="module")
def parity(gloo):
    return gloo(_parity_cases, 4)


def test_mtp_logits_and_loss_equal_the_fp64_reference_from_the_hf_layout(parity):
    ref = parity[0]["reference"]
    print("fp64 reference vs the model:", ref)
    assert ref["dtype"] == "torch.float64" and ref["shape"] == (2, 1, sum(LENGTHS), 256)
    assert ref["logits"] < REF_LOGIT_TOL and ref["loss"] < REF_LOSS_TOL and ref["sums"] < 1e-3, ref
    # the comparison sees what a mapping or shift error would do
    assert ref["swapped_norms"] > 1e3 * REF_LOGIT_TOL and ref["unshifted"] > 1e3 * REF_LOGIT_TOL, ref


def test_mtp_at_cp2_cp4_every_mode_dynamic_and_tp2_sp_equals_cp1(parity):
    names = (
        "cp2 headwise",
        "cp2 chunkwise",
        "cp2 all_gather, MTP recomputed whole",
        "cp4 headwise",
        "cp4 chunkwise",
        "cp4 all_gather, skip_unused",
        "cp2 dynamic",
        "tp2cp2 sp",
        "tp2cp2 selective",
    )
    for rank, results in enumerate(parity):
        for name in names:
            errors = results[name]
            assert sum(k.startswith("mtp.") for k in errors) == 12, name  # every MTP parameter's gradient
            assert len(errors) > 50, name
            bad = {k: v for k, v in errors.items() if not v < _tolerance(k)}
            assert not bad, (rank, name, bad)
    worst = {name: max((v, k) for k, v in parity[0][name].items()) for name in names}
    print("largest error per case (rank 0):", worst)
    assert LOSS_TOL < 1e-4 and GRAD_TOL <= 1e-4  # the bounds of the model's own CP tests


def test_mtp_training_at_dp4_cp2_and_cp4_logs_the_same_losses(parity):
    runs = parity[0]["training"]
    assert all(r == parity[0]["training"] for r in (p["training"] for p in parity))  # every rank logs alike
    for name in ("cp2", "cp4"):
        for got, want in zip(runs[name], runs["dp4"]):
            for key in ("loss", "mtp_loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (name, key, got, want)
    assert runs["dp4"][0]["mtp_loss"] > 0 and len(runs["dp4"]) == 1


# ---------------------------------------------------------------------------------------------
# a run from an HF checkpoint with mtp.*: import, train, export, load in transformers (one process)
# ---------------------------------------------------------------------------------------------


def _transformers_mtp_logits(export: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' ``MtpModel`` on the export's MTP layer, fed its main model's last hidden
    states: the MTP logits of every position but the last (``MtpModel`` asks the config for
    ``num_mtp_layers`` and the MTP layers' types, which Qwen3.5's config does not name)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    main = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    text = main.config.get_text_config()
    text.num_mtp_layers, text.mtp_layer_types = 1, ["full_attention"]
    mtp = MtpModel.from_pretrained(main).float().eval()
    with torch.no_grad():
        hidden = main(ids, output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(ids.shape[1])[None]
        out = mtp.forward_layer(0, hidden[:, :-1], positions[:, 1:], None, input_ids=ids[:, 1:])
        return mtp._project_to_logits(out)[0]


def _our_mtp_logits(export: Path, ids: torch.Tensor) -> torch.Tensor:
    """The model with an MTP layer built at TP 1 and loaded from ``export``: the MTP logits of the
    one document ``ids`` (fp32)."""
    from megatron.core import parallel_state

    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import build_qwen3_5_preset_model, qwen3_5_config
    from relax_gdn.model.mtp import MTPOptions
    from tests.gdn_harness import packed_params

    parallel_state.initialize_model_parallel(1, context_parallel_size=1, create_gloo_process_groups=False)
    try:
        model = build_qwen3_5_preset_model(
            "qwen3_5_tiny",
            qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True),
            vocab_size=320,
            gdn=GDNOptions(kernel_backend="torch", training=False),
            attention_backend="sdpa",
            mtp=MTPOptions(1),
        )
        loaded = hfc.load_hf_checkpoint(model, export)
        n = ids.shape[1]
        with torch.no_grad():
            logits = model(
                ids,
                torch.arange(n)[None],
                None,
                packed_seq_params=packed_params([0, n], "cpu"),
                mtp_input_ids=torch.cat([ids[:, 1:], ids[:, :1]], dim=1),
            )
    finally:
        parallel_state.destroy_model_parallel()
    assert loaded.mtp_num_layers == 1
    return logits[1, 0, : n - 1]


def _export_cases(tmp: str) -> dict:
    """Run in a process without a Runtime: the export CLI installs its own, as an entry point does,
    and the library calls around it run inside one each."""
    from relax_gdn.config.hydra_io import load_run_config
    from relax_gdn.runtime import Runtime
    from relax_gdn.train import run_training
    from tests.helpers import force_transformers_pure_torch as _force_transformers_pure_torch
    from tests.hf_sources import export_cli, make_vlm_source, run_weights_in_hf_names

    torch.set_num_threads(1)
    tmp = Path(tmp)
    source_dir, export = tmp / "source", tmp / "export"
    make_vlm_source(source_dir)
    cfg = RunConfig().with_overrides(
        {
            "model.hf_checkpoint": str(source_dir),
            "data.tokenizer": str(source_dir),
            "train.steps": 3,
            "train.global_batch_size": 4,
            "train.max_tokens_per_gpu": 1024,
            "data.max_sample_tokens": 512,
            "data.synthetic_max_steps": 1,
            "data.num_samples": 32,
            "optim.warmup_steps": 1,
            "logging.console": False,
            "checkpoint.dir": str(tmp / "ckpt"),
            "checkpoint.save_final": True,
        }
    )  # model.mtp.num_layers left null: the source's MTP layer is trained
    with Runtime() as runtime:
        result = run_training(cfg, tmp / "run", runtime=runtime)
    out = {
        "records": [{k: r.get(k) for k in ("loss", "mtp_loss")} for r in result.records],
        "mtp_layers": load_run_config(tmp / "run" / "config.yaml").model.mtp.num_layers,
    }
    out["cli"] = export_cli(str(tmp / "ckpt"), str(export))
    source, exported = hfc.HFCheckpoint.read(source_dir), hfc.HFCheckpoint.read(export)
    out["layout"] = (source.tensors == exported.tensors, source.files == exported.files)
    saved, original = hfc.read_hf_state_dict(export), hfc.read_hf_state_dict(source_dir)
    with Runtime():
        run = run_weights_in_hf_names(tmp / "ckpt" / "step_000003", source)
        out["imported"] = _imported_mtp_equals_source(source_dir, original)
    mtp = sorted(n for n in original if n.startswith("mtp."))
    out["mtp"] = {
        "count": len(mtp),
        "in_run": all(n in run for n in mtp),
        "equal_to_run": all(torch.equal(saved[n], run[n]) for n in mtp if n in run),
        "unchanged_from_source": [n for n in mtp if torch.equal(saved[n], original[n])],
    }
    out["visual_copied"] = all(
        torch.equal(saved[n], original[n]) for n in original if n.startswith("model.visual.")
    )
    out["config_equal"] = (export / "config.json").read_bytes() == (source_dir / "config.json").read_bytes()

    _force_transformers_pure_torch()
    from transformers import Qwen3_5ForConditionalGeneration

    _, info = Qwen3_5ForConditionalGeneration.from_pretrained(export, output_loading_info=True)
    out["loading_info"] = {k: list(v) for k, v in info.items() if v}
    ids = torch.randint(0, 264, (1, 24), generator=torch.Generator().manual_seed(4))
    theirs = _transformers_mtp_logits(export, ids)
    with Runtime():
        ours = _our_mtp_logits(export, ids)
    out["mtp_logits"] = ((theirs - ours).abs().max() / theirs.abs().max()).item()
    return out


def _imported_mtp_equals_source(source_dir: Path, original: dict) -> bool:
    """A model with an MTP layer loaded from the source holds its mtp.* tensors (through the plan)."""
    from megatron.core import parallel_state

    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import build_qwen3_5_preset_model, qwen3_5_config
    from relax_gdn.model.hf_checkpoint.convert import model_tensors
    from relax_gdn.model.mtp import MTPOptions

    parallel_state.initialize_model_parallel(1, context_parallel_size=1, create_gloo_process_groups=False)
    try:
        model = build_qwen3_5_preset_model(
            "qwen3_5_tiny",
            qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True),
            vocab_size=320,
            gdn=GDNOptions(kernel_backend="torch"),
            attention_backend="sdpa",
            mtp=MTPOptions(1),
        )
        hfc.load_hf_checkpoint(model, source_dir)
        weights = hfc.mcore_to_hf_state_dict(
            {k: v.detach() for k, v in model_tensors(model).items()},
            hfc.dims_from_model(model, vocab_size=320),
        )
    finally:
        parallel_state.destroy_model_parallel()
    mtp = [n for n in original if n.startswith("mtp.")]
    return len(mtp) == 15 and all(torch.equal(weights[n], original[n].float()) for n in mtp)


@pytest.fixture(scope="module")
def exported(gloo, tmp_path_factory):
    return gloo(_export_cases, 1, str(tmp_path_factory.mktemp("mtp_export")), runtime=False)[0]


def test_run_from_a_checkpoint_with_mtp_trains_it_and_exports_it_trained(exported):
    assert exported["mtp_layers"] == 1  # null resolved from the checkpoint, in the run's config.yaml
    records = exported["records"]
    assert len(records) == 3 and all(math.isfinite(r["mtp_loss"]) and r["mtp_loss"] > 0 for r in records)
    assert exported["imported"]  # the source's mtp.* reached the model
    rc, out, err = exported["cli"]
    assert rc == 0, err[-3000:]
    assert "mtp.*: 15" in export_summary_line(out, "written from the run:"), out
    assert "mtp.*" not in export_summary_line(out, "copied bit for bit from the source")
    mtp = exported["mtp"]
    assert mtp["count"] == 15 and mtp["in_run"] and mtp["equal_to_run"], mtp
    assert mtp["unchanged_from_source"] == [], mtp  # trained: every MTP tensor moved
    assert exported["layout"] == (True, True) and exported["visual_copied"] and exported["config_equal"]


def test_exported_mtp_layer_loads_in_transformers_and_gives_our_logits(exported):
    assert exported["loading_info"] == {}  # Qwen3_5ForConditionalGeneration: nothing missing or unexpected
    # transformers' MtpModel on the exported mtp.* (its own main model's hidden states, pure-torch kernels)
    assert exported["mtp_logits"] < 1e-4, exported["mtp_logits"]
