"""relax_gdn.model.hf_checkpoint on CPU.

* Plain state dicts (this process, no transformers): the exact row layouts of the gated
  ``linear_qkv`` and the GDN ``in_proj``, exact round trips, the VLM layout, TP shard arithmetic,
  norm-convention offsets, and the errors.
* One spawned pair of gloo processes (imports dominate the run time, so they are paid once):
  - a tiny random ``Qwen3_5ForCausalLM`` saved by transformers is imported into
    ``build_qwen3_5_model`` (TP = 1, CP = 1, torch kernels) and gives transformers' logits (fp32,
    transformers forced onto its pure-torch path), while a query/gate swap visibly breaks them;
  - export -> re-import is bitwise, the exported files equal the originals, and transformers
    loads the export (no missing/unexpected keys) with identical logits;
  - the VLM layout (sharded, with vision and MTP tensors) imports to the same weights; broken
    checkpoints raise errors naming the tensor or config field;
  - TP = 2: the shards gather back to the TP = 1 weights, give the same logits, and export the
    same files; the drop-in export in the VLM layout is that checkpoint, bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relax_gdn.gdn.options import GDNOptions
from relax_gdn.model import hf_checkpoint as hfc
from tests.helpers import force_transformers_pure_torch as _force_transformers_pure_torch
from tests.hf_sources import HF_TEXT_CONFIG, MODEL_VOCAB, random_hf_state

SEQ = 53
LOGIT_TOL = 1e-4  # max |ours - transformers| relative to max |logit| (fp32; scan order differs)


def _dims(**overrides) -> hfc.Qwen3_5Dims:
    return hfc.dims_from_hf_config({**HF_TEXT_CONFIG, **overrides})


# ---------------------------------------------------------------------------------------------
# Plain state dicts
# ---------------------------------------------------------------------------------------------


def test_gated_qkv_rows_are_grouped_query_gate_key_value():
    """Megatron's linear_qkv with attention_output_gate: per KV group [its q heads, their gates, k, v];
    HF's q_proj: per head [query, gate]. Checked row by row with rows labelled by origin."""
    d = _dims()
    heads, groups, dim = d.num_attention_heads, d.num_query_groups, d.head_dim
    state = random_hf_state(d)
    # label each HF row: value = 1000 * kind + row (kind 0: q_proj, 1: k_proj, 2: v_proj)
    prefix = "model.layers.3.self_attn."
    for kind, name in enumerate(("q_proj", "k_proj", "v_proj")):
        rows = state[f"{prefix}{name}.weight"].shape[0]
        state[f"{prefix}{name}.weight"] = (
            (1000 * kind + torch.arange(rows, dtype=torch.float32))[:, None].expand(-1, d.hidden_size).clone()
        )
    qkv = hfc.hf_to_mcore_state_dict(state, d)["decoder.layers.3.self_attention.linear_qkv.weight"][:, 0]

    expected = []
    per_group = heads // groups
    for g in range(groups):
        group_heads = range(g * per_group, (g + 1) * per_group)
        expected += [h * 2 * dim + i for h in group_heads for i in range(dim)]  # query half of q_proj head h
        expected += [h * 2 * dim + dim + i for h in group_heads for i in range(dim)]  # gate half
        expected += [1000 + g * dim + i for i in range(dim)]  # k head g
        expected += [2000 + g * dim + i for i in range(dim)]  # v head g
    assert qkv.tolist() == [float(x) for x in expected]


def test_gdn_in_proj_conv_and_mlp_stacking():
    d = _dims()
    state = random_hf_state(d)
    m = hfc.hf_to_mcore_state_dict(state, d)
    a = "model.layers.0.linear_attn."
    in_proj = torch.cat([state[f"{a}in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")])
    assert torch.equal(m["decoder.layers.0.self_attention.in_proj.weight"], in_proj)
    assert torch.equal(m["decoder.layers.0.self_attention.conv1d.weight"], state[f"{a}conv1d.weight"])
    assert torch.equal(m["decoder.layers.0.self_attention.out_norm.weight"], state[f"{a}norm.weight"])
    fc1 = torch.cat(
        [state["model.layers.2.mlp.gate_proj.weight"], state["model.layers.2.mlp.up_proj.weight"]]
    )
    assert torch.equal(m["decoder.layers.2.mlp.linear_fc1.weight"], fc1)
    assert torch.equal(
        m["decoder.layers.3.pre_mlp_layernorm.weight"],
        state["model.layers.3.post_attention_layernorm.weight"],
    )


def test_plain_round_trip_is_exact_and_vlm_layout_maps_to_the_same_weights():
    d = _dims()
    state = random_hf_state(d)
    mcore = hfc.hf_to_mcore_state_dict(state, d)
    assert set(mcore) == {rule.mcore for rule in hfc.conversion_plan(d)}
    back = hfc.mcore_to_hf_state_dict(mcore, d)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)

    vlm = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in state.items()
    }
    vlm["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(12, 4)
    vlm["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    vlm["mtp.fc.weight"] = torch.randn(64, 128)
    from_vlm = hfc.hf_to_mcore_state_dict(vlm, d)
    assert from_vlm.keys() == mcore.keys() and all(torch.equal(from_vlm[k], mcore[k]) for k in mcore)


def test_padded_vocabulary_is_zero_filled_and_trimmed():
    d = replace(_dims(), padded_vocab_size=MODEL_VOCAB)
    state = random_hf_state(d)
    mcore = hfc.hf_to_mcore_state_dict(state, d)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert mcore[name].shape == (MODEL_VOCAB, d.hidden_size) and not mcore[name][d.vocab_size :].any()
    back = hfc.mcore_to_hf_state_dict(mcore, d)
    assert torch.equal(back["lm_head.weight"], state["lm_head.weight"])


def test_norm_convention_offsets_and_tied_checkpoint():
    # a model whose GDN output norm were zero-centred (x_hat * (1 + w)) stores w_hf - 1
    d = replace(_dims(), norms=hfc.NormConventions(gdn_out_one_plus=True))
    state = random_hf_state(d)
    mcore = hfc.hf_to_mcore_state_dict(state, d)
    name = "model.layers.1.linear_attn.norm.weight"
    assert torch.equal(mcore["decoder.layers.1.self_attention.out_norm.weight"], state[name] - 1)
    assert torch.allclose(hfc.mcore_to_hf_state_dict(mcore, d)[name], state[name])

    # a tied checkpoint (no lm_head) into an untied model: the output layer starts as the embedding
    tied = replace(_dims(), lm_head_from_embedding=True)
    state = random_hf_state(tied)
    assert "lm_head.weight" not in state
    mcore = hfc.hf_to_mcore_state_dict(state, tied)
    assert torch.equal(mcore["output_layer.weight"], state["model.embed_tokens.weight"])
    assert "lm_head.weight" in hfc.mcore_to_hf_state_dict(mcore, tied)  # export writes it (it trains apart)


def test_tp_shards_cut_every_section_by_heads_and_gather_back():
    d = _dims()
    mcore = hfc.hf_to_mcore_state_dict(random_hf_state(d), d)
    for rule in hfc.conversion_plan(d):
        full = mcore[rule.mcore]
        shards = [hfc.shard_for_tp(full, rule.tp, 2, r, rule.mcore) for r in range(2)]
        assert torch.equal(hfc.unshard_from_tp(shards, rule.tp), full), rule.mcore
    # GDN in_proj rank 1 = second half (by heads) of each of q, k, v, z, beta, alpha
    rule = next(r for r in hfc.conversion_plan(d) if r.mcore.endswith("0.self_attention.in_proj.weight"))
    full = mcore[rule.mcore]
    qk, v, hv = 32, 64, 8
    sections = full.split([qk, qk, v, v, hv, hv])
    assert torch.equal(
        hfc.shard_for_tp(full, rule.tp, 2, 1), torch.cat([s[s.shape[0] // 2 :] for s in sections])
    )
    with pytest.raises(ValueError, match="tensor parallel size 3"):
        hfc.shard_for_tp(full, rule.tp, 3, 0, rule.mcore)


def test_missing_misshaped_and_unknown_tensors_are_named():
    d = _dims()
    state = random_hf_state(d)
    missing = dict(state)
    del missing["model.layers.1.linear_attn.in_proj_z.weight"]
    with pytest.raises(
        hfc.CheckpointMismatchError, match=r"model\.layers\.1\.linear_attn\.in_proj_z\.weight"
    ):
        hfc.hf_to_mcore_state_dict(missing, d)

    bad = dict(state)
    bad["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    with pytest.raises(hfc.CheckpointMismatchError, match=r"k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        hfc.hf_to_mcore_state_dict(bad, d)

    extra = dict(state)
    extra["model.layers.4.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(
        hfc.CheckpointMismatchError, match=r"no place for.*model\.layers\.4\.mlp\.up_proj\.weight"
    ):
        hfc.hf_to_mcore_state_dict(extra, d)

    both = dict(state)
    both["model.language_model.norm.weight"] = state["model.norm.weight"]
    with pytest.raises(hfc.CheckpointMismatchError, match="mixed VLM and text layouts"):
        hfc.hf_to_mcore_state_dict(both, d)


def test_config_overrides_from_hf(tmp_path):
    vlm = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**HF_TEXT_CONFIG, "model_type": "qwen3_5_text"},
        "vision_config": {"depth": 2},
    }
    (tmp_path / "config.json").write_text(json.dumps(vlm))
    overrides, model_kwargs = hfc.qwen3_5_config_from_hf(tmp_path)
    assert overrides["linear_attention_freq"] == 4 and overrides["kv_channels"] == 16
    assert overrides["num_query_groups"] == 2 and overrides["ffn_hidden_size"] == 128
    assert model_kwargs == dict(vocab_size=250, max_sequence_length=128, rotary_base=1e7, rotary_percent=0.25)
    odd = {
        **HF_TEXT_CONFIG,
        "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
    }
    assert hfc.qwen3_5_config_from_hf(odd)[0]["linear_attention_freq"] == [0, 1, 1, 0]
    exported = hfc.hf_text_config(hfc.dims_from_hf_config(vlm), base=vlm)
    assert exported["model_type"] == "qwen3_5_text" and "text_config" not in exported
    assert hfc.dims_from_hf_config(exported) == hfc.dims_from_hf_config(vlm)


# ---------------------------------------------------------------------------------------------
# Against transformers and the real model: ONE spawned pair of gloo processes (imports cost
# ~20 s per process on 2 cores). Rank 0 makes the checkpoint with transformers; then rank 0 runs
# the TP = 1 parity/export checks while rank 1 runs the VLM and error checks; then both run TP = 2.
# ---------------------------------------------------------------------------------------------


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _build_model(checkpoint_dir, tp_group, single_group):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from relax_gdn.model.qwen3_5 import Qwen3_5Options, build_qwen3_5_model, qwen3_5_config

    overrides, model_kwargs = hfc.qwen3_5_config_from_hf(checkpoint_dir)
    config = qwen3_5_config(
        "qwen3_5_tiny", **overrides, use_cpu_initialization=True, tensor_model_parallel_size=tp_group.size()
    )
    model_kwargs["vocab_size"] = MODEL_VOCAB
    groups = ProcessGroupCollection(tp=tp_group, cp=single_group, pp=single_group, embd=single_group)
    options = Qwen3_5Options(
        gdn=GDNOptions(kernel_backend="torch", training=False),
        spec_provider="local",
        attention_backend="sdpa",
        **model_kwargs,
    )
    return build_qwen3_5_model(config, options, groups).eval()


def _logits(model, ids, tp_group) -> torch.Tensor:
    """``[t, vocab]`` logits of one unpacked sequence (vocab shards gathered over TP)."""
    import torch.distributed as dist

    with torch.no_grad():
        out = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)
    out = (
        out.reshape(-1, out.shape[-1])
        if out.shape[0] == 1
        else out.transpose(0, 1).reshape(-1, out.shape[-1])
    )
    if tp_group.size() > 1:
        parts = [torch.empty_like(out) for _ in range(tp_group.size())]
        dist.all_gather(parts, out.contiguous(), group=tp_group)
        out = torch.cat(parts, dim=-1)
    return out


def _write_checkpoint(out: Path, state: dict, config: dict, files: int = 1) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    keys = sorted(state)
    if files == 1:
        save_file({k: state[k].contiguous() for k in keys}, str(out / "model.safetensors"))
        return
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = keys[i::files]
        save_file({k: state[k].contiguous() for k in part}, str(out / name))
        weight_map.update({k: name for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _error(fn) -> str | None:
    try:
        fn()
    except (hfc.CheckpointMismatchError, ValueError, FileNotFoundError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _make_checkpoint(work: Path) -> None:
    """A random tiny Qwen3_5ForCausalLM saved by transformers, and its logits on a fixed sequence."""
    _force_transformers_pure_torch()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**HF_TEXT_CONFIG, attn_implementation="eager")).eval()
    with (
        torch.no_grad()
    ):  # HF initialises norms, A_log, dt_bias to constants/patterns: make every tensor matter
        for name, p in hf.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(work / "text")
    ids = torch.randint(0, HF_TEXT_CONFIG["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = hf(input_ids=ids).logits[0]
    torch.save({"ids": ids, "logits": logits}, work / "reference.pt")


def _parity_and_export_checks(work: Path, single) -> dict:
    from transformers import Qwen3_5ForCausalLM

    reference = torch.load(work / "reference.pt")
    ids, ref_logits = reference["ids"], reference["logits"]
    vocab = ref_logits.shape[1]
    r = {}
    model = _build_model(work / "text", single, single)
    r["norms"] = hfc.norm_conventions_of(model)
    dims = hfc.load_hf_checkpoint(model, work / "text")
    r["dims_vocab"] = (dims.vocab_size, dims.model_vocab_size)
    ours = _logits(model, ids, single)
    r["logit_scale"] = ref_logits.abs().max().item()
    r["logit_err"] = (ours[:, :vocab] - ref_logits).abs().max().item()
    r["padded_logits_zero"] = not ours[:, vocab:].any()
    imported = {k: v.detach().clone() for k, v in _weights(model).items()}

    # negative control: query and gate swapped in the attention layer must break parity
    qkv = model.decoder.layers[3].self_attention.linear_qkv.weight
    saved = qkv.detach().clone()
    with torch.no_grad():
        groups = qkv.view(2, -1, qkv.shape[-1])  # 2 KV groups of [q (2 heads x 16), gate (2 x 16), k, v]
        query, gate = groups[:, :32].clone(), groups[:, 32:64].clone()
        groups[:, :32], groups[:, 32:64] = gate, query
    r["swapped_gate_err"] = (_logits(model, ids, single)[:, :vocab] - ref_logits).abs().max().item()
    with torch.no_grad():
        qkv.copy_(saved)

    # export (several files + index): the files are the original tensors; re-import is bitwise
    export_dir = work / "export"
    hfc.save_hf_checkpoint(model, export_dir, base_config=work / "text", max_shard_bytes=64 * 1024)
    r["export_files"] = sorted(p.name for p in export_dir.iterdir())
    original, exported = hfc.read_hf_state_dict(work / "text"), hfc.read_hf_state_dict(export_dir)
    r["export_equals_original"] = exported.keys() == original.keys() and all(
        torch.equal(exported[k], original[k]) for k in original
    )
    again = _build_model(export_dir, single, single)
    hfc.load_hf_checkpoint(again, export_dir)
    again_weights = _weights(again)
    r["reimport_bitwise"] = again_weights.keys() == imported.keys() and all(
        torch.equal(again_weights[k], imported[k]) for k in imported
    )
    reloaded, info = Qwen3_5ForCausalLM.from_pretrained(
        export_dir, output_loading_info=True, attn_implementation="eager"
    )
    r["transformers_loading_info"] = {k: list(v) for k, v in info.items() if v}
    with torch.no_grad():
        r["export_logit_err"] = (reloaded.eval()(input_ids=ids).logits[0] - ref_logits).abs().max().item()
    torch.save(imported, work / "tp1_weights.pt")
    return r


def _vlm_and_error_checks(work: Path, single) -> dict:
    r = {}
    text = hfc.read_hf_state_dict(work / "text")
    text_config = json.loads((work / "text" / "config.json").read_text())
    model = _build_model(work / "text", single, single)
    hfc.load_hf_checkpoint(model, work / "text")
    from_text = _weights(model)

    # VLM layout: language model under model.language_model., vision tower and MTP ignored, sharded files
    vlm = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in text.items()
    }
    vlm["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 16, 16)
    vlm["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(24, 8)
    vlm["mtp.fc.weight"] = torch.randn(64, 128)
    vlm["mtp.layers.0.mlp.gate_proj.weight"] = torch.randn(128, 64)
    vlm_config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "vision_config": {"depth": 1},
        "tie_word_embeddings": False,
    }
    _write_checkpoint(work / "vlm", vlm, vlm_config, files=3)
    vlm_model = _build_model(work / "vlm", single, single)
    hfc.load_hf_checkpoint(vlm_model, work / "vlm")
    from_vlm = _weights(vlm_model)
    r["vlm_equal"] = from_vlm.keys() == from_text.keys() and all(
        torch.equal(from_vlm[k], from_text[k]) for k in from_text
    )

    # broken checkpoints: each error names the tensor (or config field) and what to do
    def broken(name: str, edit) -> Path:
        state, config = dict(text), dict(text_config)
        edit(state, config)
        _write_checkpoint(work / name, state, config)
        return work / name

    cases = {
        "missing": broken("missing", lambda s, c: s.pop("model.layers.1.linear_attn.in_proj_z.weight")),
        "misshaped": broken(
            "misshaped",
            lambda s, c: s.update({"model.layers.3.self_attn.k_proj.weight": torch.zeros(16, 64)}),
        ),
        "unknown": broken(
            "unknown",
            lambda s, c: s.update({"model.layers.0.linear_attn.in_proj_qkvz.weight": torch.zeros(4, 64)}),
        ),
        "config": broken("config", lambda s, c: c.update(linear_num_value_heads=16)),
    }
    for case, path in cases.items():
        r[f"error_{case}"] = _error(lambda path=path: hfc.load_hf_checkpoint(model, path))
    r["error_no_files"] = _error(lambda: hfc.load_hf_checkpoint(model, work / "vlm" / ".."))
    return r


def _tp2_checks(work: Path, tp_group, single) -> dict:
    import torch.distributed as dist

    model = _build_model(work / "text", tp_group, single)
    hfc.load_hf_checkpoint(model, work / "text")  # the TP group comes from model.pg_collection
    tp1 = torch.load(work / "tp1_weights.pt")
    dims = hfc.dims_from_model(model, vocab_size=HF_TEXT_CONFIG["vocab_size"])
    local = _weights(model)
    reference = torch.load(work / "reference.pt")
    logits = _logits(model, reference["ids"], tp_group)[:, : reference["logits"].shape[1]]
    export_dir = work / "export_tp2"
    hfc.save_hf_checkpoint(model, export_dir, base_config=work / "text")
    # the VLM checkpoint's text weights are the ones loaded: its drop-in export is itself, bit for bit
    hfc.save_drop_in_checkpoint(model, work / "drop_in_tp2", work / "vlm")
    dist.barrier()
    exported, original = hfc.read_hf_state_dict(export_dir), hfc.read_hf_state_dict(work / "text")
    drop_in, vlm = hfc.read_hf_state_dict(work / "drop_in_tp2"), hfc.read_hf_state_dict(work / "vlm")
    in_proj = "decoder.layers.0.self_attention.in_proj.weight"
    return {
        "gathered_equal": all(
            torch.equal(hfc.gather_from_tp(local[rule.mcore], rule.tp, tp_group), tp1[rule.mcore])
            for rule in hfc.conversion_plan(dims)
        ),
        "sharded": 2 * local[in_proj].shape[0] == tp1[in_proj].shape[0],
        "logit_err": (logits - reference["logits"]).abs().max().item(),
        "logit_scale": reference["logits"].abs().max().item(),
        "export_equal": exported.keys() == original.keys()
        and all(torch.equal(exported[k], original[k]) for k in original),
        "drop_in_equal": drop_in.keys() == vlm.keys() and all(torch.equal(drop_in[k], vlm[k]) for k in vlm),
        "drop_in_files": hfc.HFCheckpoint.read(work / "drop_in_tp2").tensors
        == hfc.HFCheckpoint.read(work / "vlm").tensors,
    }


def _spawned_checks(workdir: str) -> dict:
    import torch.distributed as dist

    from tests.gdn_harness import self_group

    torch.set_num_threads(1)
    work, rank = Path(workdir), dist.get_rank()
    single, pair = self_group(), dist.new_group([0, 1])  # every group made by every rank, up front
    if rank == 0:
        _make_checkpoint(work)
    dist.barrier()
    r = _parity_and_export_checks(work, single) if rank == 0 else _vlm_and_error_checks(work, single)
    dist.barrier()
    r["tp2"] = _tp2_checks(work, pair, single)
    return r


@pytest.fixture(scope="module")
def spawned(gloo, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hf_checkpoint")
    return gloo(_spawned_checks, 2, str(workdir))


def test_import_gives_transformers_logits(spawned):
    r = spawned[0]
    assert r["norms"] == hfc.NormConventions(hidden_one_plus=True, qk_one_plus=True, gdn_out_one_plus=False)
    assert r["dims_vocab"] == (HF_TEXT_CONFIG["vocab_size"], MODEL_VOCAB)
    assert r["logit_scale"] > 1.0  # the logits are not dominated by tiny random weights
    assert r["logit_err"] < LOGIT_TOL * r["logit_scale"], r
    assert r["padded_logits_zero"]
    assert r["swapped_gate_err"] > 100 * LOGIT_TOL * r["logit_scale"], (
        "the parity check cannot see a q/gate swap"
    )


def test_export_round_trips_and_loads_in_transformers(spawned):
    r = spawned[0]
    assert r["export_equals_original"] and r["reimport_bitwise"]
    assert "model.safetensors.index.json" in r["export_files"] and "config.json" in r["export_files"]
    assert len([f for f in r["export_files"] if f.endswith(".safetensors")]) > 1
    assert r["transformers_loading_info"] == {}, r["transformers_loading_info"]
    assert r["export_logit_err"] == 0.0


def test_vlm_layout_imports_the_same_weights(spawned):
    assert spawned[1]["vlm_equal"]


def test_broken_checkpoints_raise_errors_naming_the_tensor(spawned):
    r = spawned[1]
    assert (
        "CheckpointMismatchError" in r["error_missing"]
        and "model.layers.1.linear_attn.in_proj_z.weight" in r["error_missing"]
    )
    assert (
        "model.layers.3.self_attn.k_proj.weight" in r["error_misshaped"]
        and "(16, 64)" in r["error_misshaped"]
    )
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in r["error_unknown"]
    assert "linear_num_value_heads: checkpoint 16, model 8" in r["error_config"]
    assert "FileNotFoundError" in r["error_no_files"] and "model.safetensors" in r["error_no_files"]


def test_tp2_import_gathers_to_tp1_gives_the_logits_and_exports_the_same(spawned):
    for rank, r in enumerate(spawned):
        t = r["tp2"]
        assert t["gathered_equal"] and t["sharded"], (rank, t)
        assert t["logit_err"] < LOGIT_TOL * t["logit_scale"], (rank, t)
        assert t["export_equal"], (rank, t)
        assert t["drop_in_equal"] and t["drop_in_files"], (rank, t)
