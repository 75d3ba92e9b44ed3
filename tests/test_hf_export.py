"""What an SFT run's Hugging Face export holds, and that it works in a user's hands (CPU).

* In this process: which source tensors a drop-in export writes, copies or refuses
  (``tensor_origins``); the vocabulary of a run started from a checkpoint and the one message
  naming every size that differs from the preset; the embedded byte tokenizer saved as a
  Hugging Face tokenizer giving the same ids; safetensors files readable as the umask allows.
* One spawned process (slow): a tiny VLM-layout checkpoint made with transformers' own classes
  (vision tower, MTP tensors, bf16 with fp32 ``A_log``, two shards, a tokenizer and a processor
  file) -> SFT 3 steps from it -> ``python -m relax_gdn.export_hf``: the export has the source's
  tensor names, shapes, dtypes, shard files and index, the vision and MTP tensors bit for bit,
  the trained tensors equal to the run's weights, the source's config and other files;
  transformers loads it as ``AutoModelForCausalLM`` and ``Qwen3_5ForConditionalGeneration``; a
  source tensor the export cannot place is refused with one message (exit 2) before anything is
  written.
* ``python train.py`` (slow): the tiny demo -> its export -> a run from that export -> its export
  again (the round trip), which transformers loads and generates 5 tokens from on the CPU with the
  shipped tokenizer; a run from it with another preset stops with one message (exit 2).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax_gdn.errors import ConfigError
from relax_gdn.model import hf_checkpoint as hfc
from relax_gdn.model.hf_checkpoint.source import SourceTensor
from relax_gdn.model.presets import PRESETS
from tests.distributed import child_env
from tests.hf_sources import (
    PROCESSOR_FILE,
    TINY_TEXT,
    export_cli,
    files_of,
    make_vlm_source,
    run_weights_in_hf_names,
)

ROOT = Path(__file__).resolve().parents[1]


def _source(tensors: dict[str, tuple[int, ...]], files: int = 1) -> hfc.HFCheckpoint:
    names = list(tensors)
    file_of = {n: f"model-{i % files + 1:05d}-of-{files:05d}.safetensors" for i, n in enumerate(names)}
    return hfc.HFCheckpoint(
        Path("/src"),
        {n: SourceTensor(file_of[n], torch.bfloat16, s) for n, s in tensors.items()},
        tuple(dict.fromkeys(file_of.values())),
        files > 1,
        {},
        {},
    )


# ---------------------------------------------------------------------------------------------
# in this process
# ---------------------------------------------------------------------------------------------


def test_tensor_origins_write_the_trained_copy_vision_and_mtp_and_refuse_the_rest():
    trained = {
        "model.embed_tokens.weight": (8, 4),
        "model.layers.0.mlp.up_proj.weight": (6, 4),
        "lm_head.weight": (8, 4),
    }
    source = _source(
        {
            "model.language_model.embed_tokens.weight": (8, 4),
            "model.language_model.layers.0.mlp.up_proj.weight": (6, 4),
            "lm_head.weight": (8, 4),
            "model.visual.blocks.0.attn.qkv.weight": (3, 2),
            "mtp.fc.weight": (4, 8),
        }
    )
    origins, added = hfc.tensor_origins(source, trained)
    assert origins == {
        "model.language_model.embed_tokens.weight": hfc.Origin.TRAINED,
        "model.language_model.layers.0.mlp.up_proj.weight": hfc.Origin.TRAINED,
        "lm_head.weight": hfc.Origin.TRAINED,
        "model.visual.blocks.0.attn.qkv.weight": hfc.Origin.COPIED,
        "mtp.fc.weight": hfc.Origin.COPIED,
    }
    assert added == []
    # an MTP tensor the run's plan writes is written, not copied (the one place that decides)
    origins, _ = hfc.tensor_origins(source, {**trained, "mtp.fc.weight": (4, 8)})
    assert origins["mtp.fc.weight"] is hfc.Origin.TRAINED

    tied = _source({"model.embed_tokens.weight": (8, 4), "model.layers.0.mlp.up_proj.weight": (6, 4)})
    assert hfc.tensor_origins(tied, trained)[1] == ["lm_head.weight"]  # a tied source gains the output layer

    unknown = _source({**{n: s for n, s in trained.items()}, "model.layers.0.mlp.experts.0.weight": (2, 2)})
    with pytest.raises(
        hfc.CheckpointMismatchError, match=r"would lose them: \['model\.layers\.0\.mlp\.experts"
    ):
        hfc.tensor_origins(unknown, trained)
    misshaped = _source({**trained, "model.layers.0.mlp.up_proj.weight": (7, 4)})
    with pytest.raises(
        hfc.CheckpointMismatchError, match=r"up_proj\.weight \(7, 4\) \(the run's: \(6, 4\)\)"
    ):
        hfc.tensor_origins(misshaped, trained)
    lacking = _source({"model.embed_tokens.weight": (8, 4), "lm_head.weight": (8, 4)})
    with pytest.raises(hfc.CheckpointMismatchError, match=r"the run has 1 tensor\(s\) .* lacks"):
        hfc.tensor_origins(lacking, trained)


def _checkpoint_dir(path: Path, text: dict, embedding_rows: int | None = None) -> Path:
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"], **text}))
    rows = embedding_rows or text["vocab_size"]
    save_file(
        {"model.embed_tokens.weight": torch.zeros(rows, text["hidden_size"])}, str(path / "model.safetensors")
    )
    return path


def test_run_vocabulary_is_the_checkpoints_and_other_sizes_must_be_the_presets(tmp_path):
    good = _checkpoint_dir(tmp_path / "good", TINY_TEXT)
    assert hfc.run_vocab_size(good, "qwen3_5_tiny", 264, 2) == 320

    def message(path, preset="qwen3_5_tiny", tokens=264, tp=1) -> str:
        with pytest.raises(ConfigError) as e:
            hfc.run_vocab_size(path, preset, tokens, tp)
        return str(e.value)

    wrong = message(good, preset="qwen3_5_9b_reduced")
    assert (
        wrong.count("configuration problem") == 1
        and "does not match model.preset=qwen3_5_9b_reduced" in wrong
    )
    assert "hidden_size: checkpoint 64, preset 4096" in wrong and "use model.preset=qwen3_5_tiny" in wrong
    deeper = _checkpoint_dir(
        tmp_path / "deeper",
        {**TINY_TEXT, "num_hidden_layers": 8, "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
    )
    with pytest.raises(
        ValueError, match="4 layer_types for num_hidden_layers=8"
    ):  # config.json itself broken
        hfc.dims_from_hf_config(deeper)
    assert "is not a Qwen3.5 config" in message(deeper)
    theta = _checkpoint_dir(tmp_path / "theta", {**TINY_TEXT, "rope_parameters": {"rope_theta": 1e6}})
    assert "rope_theta: checkpoint 1000000.0, preset 10000000.0" in message(theta)
    assert "no preset has these sizes" in message(theta)
    assert "data.tokenizer has 400 tokens, more than the 320" in message(good, tokens=400)
    assert "(320) does not split over parallel.tp=3" in message(good, tp=3)
    assert "vocab_size=320 but its model.embed_tokens.weight has 256 rows" in message(
        _checkpoint_dir(tmp_path / "rows", TINY_TEXT, embedding_rows=256)
    )
    (tmp_path / "empty").mkdir()
    assert "neither model.safetensors.index.json nor model.safetensors" in message(tmp_path / "empty")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_presets_export_config_starts_a_run_of_that_preset(tmp_path, preset):
    """What an export of each preset writes into config.json (hf_text_config of the model's sizes)
    is accepted by a run from it with that preset, which takes its vocabulary."""
    config = hfc.hf_text_config(hfc.preset_dims(preset, 1024))
    assert hfc.run_vocab_size(_checkpoint_dir(tmp_path / "export", config), preset, 264, 8) == 1024
    others = [p for p in PRESETS if p != preset]
    with pytest.raises(ConfigError, match=f"use model.preset={preset}"):
        hfc.run_vocab_size(tmp_path / "export", others[0], 264, 8)


def test_embedded_tokenizer_saved_for_transformers_gives_the_same_ids(tmp_path):
    from transformers import AutoTokenizer

    from relax_gdn.data.tokenizer import ByteChatTokenizer, HFChatTokenizer

    byte = ByteChatTokenizer()
    written = byte.save_pretrained(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(written)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert len(hf) == byte.vocab_size and hf.eos_token_id == byte.eos_id and hf.pad_token_id == byte.pad_id
    conversation = [
        {"role": "system", "content": "  Be terse.\n"},
        {"role": "user", "content": "héllo 12+3=? 日本 \t x <|x|>"},
        {"role": "assistant", "content": " 15 \n\n"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok 😀"},
    ]
    assert HFChatTokenizer(tmp_path).encode_messages(conversation) == byte.encode_messages(conversation)
    prompt = hf.apply_chat_template(conversation[:2], add_generation_prompt=True, tokenize=False)
    ids = hf(prompt, add_special_tokens=False)["input_ids"]
    assert ids == byte.encode_messages(conversation[:2])[0] + [byte.assistant_id]
    assert hf.decode(byte.encode_messages(conversation)[0]) == byte.decode(
        byte.encode_messages(conversation)[0]
    )


def test_export_ships_the_tokenizer_the_run_trained_with(tmp_path, monkeypatch):
    from relax_gdn.data.tokenizer import ByteChatTokenizer
    from relax_gdn.train.hf_export import _write_tokenizer

    written, note = _write_tokenizer(tmp_path / "embedded", "embedded")
    assert (
        written and "embedded byte tokenizer" in note and (tmp_path / "embedded" / "tokenizer.json").is_file()
    )
    ByteChatTokenizer().save_pretrained(tmp_path / "tok")
    (tmp_path / "local").mkdir()
    assert _write_tokenizer(tmp_path / "local", str(tmp_path / "tok")) == (
        True,
        f"tokenizer: data.tokenizer={tmp_path / 'tok'} (the one the run trained with)",
    )
    assert (tmp_path / "local" / "tokenizer.json").read_text() == (
        tmp_path / "tok" / "tokenizer.json"
    ).read_text()
    monkeypatch.chdir(tmp_path / "local")  # a relative data.tokenizer, exported from elsewhere
    written, note = _write_tokenizer(tmp_path / "relative", "tok")
    assert not written and "NOT written: data.tokenizer=tok is not a directory from here" in note
    assert not (tmp_path / "relative").exists()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_safetensors_files_are_readable_as_the_umask_allows(tmp_path, umask, mode):
    from relax_gdn.model.hf_checkpoint.files import write_safetensors

    old = os.umask(umask)
    try:
        write_safetensors({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == mode
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no partial file left


# ---------------------------------------------------------------------------------------------
# a drop-in export of a run started from a VLM-layout checkpoint (one spawned process)
# ---------------------------------------------------------------------------------------------


def _fp32_main_parameter_cases(tmp: Path, source_dir: Path, checkpoint: Path) -> dict:
    """A bf16 model and a checkpoint holding fp32 main parameters as Megatron-Core's
    fully_reshardable form names them (``optimizer.state.param.<key>``, written here with
    Megatron-Core's own save): the drop-in export writes the float32 source tensors from them."""
    from dataclasses import replace

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from relax_gdn.parallel import ParallelContext
    from relax_gdn.train.build import build_checkpoint_model
    from relax_gdn.train.checkpoint import read_manifest
    from relax_gdn.train.checkpoint_state import checkpoint_fp32_main_params

    manifest = read_manifest(checkpoint)
    manifest = {
        **manifest,
        "model": {**manifest["model"], "dtype": "bfloat16"},
        "optimizer": {"kind": "megatron", "sharding": "fully_reshardable"},
    }
    parallel = ParallelContext.initialize(tp=1, cp=1, dynamic_max_cp=None)
    try:
        model = build_checkpoint_model(manifest, parallel, torch.device("cpu"))
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=gen))
        weights, main, state = {}, {}, {}
        for name, sharded in model.sharded_state_dict().items():
            if isinstance(sharded, ShardedTensor) and name.endswith("A_log"):
                weights[name] = sharded.data.float()  # bf16 values
                main[name] = weights[name] + 1e-3  # bits a bf16 weight cannot hold
                key = f"optimizer.state.param.{sharded.key}"
                state[key] = replace(sharded, key=key, data=main[name].clone(), dtype=torch.float32)
        (tmp / "fp32_ckpt").mkdir()
        # with the common (non-sharded) state the checkpoint writer puts beside the tensors: a load returns it too
        dist_checkpointing.save(
            {
                "model": model.sharded_state_dict(),
                "optimizer": {"kind": "megatron", "optimizer": state},
                "scheduler": {"num_steps": 3},
                "step": 3,
            },
            str(tmp / "fp32_ckpt"),
        )
        loader = checkpoint_fp32_main_params(tmp / "fp32_ckpt", manifest, model)
        report = hfc.save_drop_in_checkpoint(model, tmp / "fp32_export", source_dir, main_params=loader)
        plain = hfc.save_drop_in_checkpoint(model, tmp / "bf16_export", source_dir)
    finally:
        ParallelContext.destroy()
    written, rounded = (
        hfc.read_hf_state_dict(tmp / "fp32_export"),
        hfc.read_hf_state_dict(tmp / "bf16_export"),
    )
    hf_name = {
        f"decoder.layers.{i}.self_attention.A_log": f"model.language_model.layers.{i}.linear_attn.A_log"
        for i in range(3)
    }
    return {
        "loaded": sorted(main) == sorted(hf_name),
        "from_main": all(torch.equal(written[hf_name[m]], main[m]) for m in hf_name),
        "from_weights": all(torch.equal(rounded[hf_name[m]], weights[m]) for m in hf_name),
        "bits_beyond_bf16": all(
            (written[n] != written[n].to(torch.bfloat16).float()).any() for n in hf_name.values()
        ),
        "reports": (sorted(report.fp32_from_main), report.fp32_from_weights, sorted(plain.fp32_from_weights)),
        "names": sorted(hf_name.values()),
    }


def _drop_in_cases(tmp: str) -> dict:
    """On a bare rank (``runtime=False``): the run and the model builds below install a Runtime as
    an entry point does, while ``python -m relax_gdn.export_hf`` (``_cli``) installs its own."""
    from relax_gdn.config import RunConfig
    from relax_gdn.runtime import Runtime
    from relax_gdn.train import run_training
    from tests.helpers import force_transformers_pure_torch as _force_transformers_pure_torch

    torch.set_num_threads(1)
    tmp = Path(tmp)
    source_dir, export = tmp / "source", tmp / "export"
    make_vlm_source(source_dir)
    cfg = RunConfig().with_overrides(
        {
            "model.hf_checkpoint": str(source_dir),
            "model.mtp.num_layers": 0,  # the source's MTP layer copied (tests/test_mtp.py trains it)
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
            "checkpoint.export_hf_final": True,
        }
    )
    with Runtime() as runtime:
        run_training(cfg, tmp / "run", runtime=runtime)
    r: dict = {"cli": export_cli(str(tmp / "ckpt"), str(export))}
    tampered = tmp / "tampered"
    shutil.copytree(source_dir, tampered)
    from safetensors.torch import load_file, save_file

    single = tampered / "model-00001-of-00002.safetensors"
    save_file(
        {**load_file(single), "model.language_model.layers.0.mlp.experts.0.weight": torch.zeros(2, 2)},
        str(single),
    )
    index = json.loads((tampered / hfc.source.SAFETENSORS_INDEX).read_text())
    index["weight_map"]["model.language_model.layers.0.mlp.experts.0.weight"] = single.name
    (tampered / hfc.source.SAFETENSORS_INDEX).write_text(json.dumps(index))
    r["refused"] = export_cli(str(tmp / "ckpt"), str(tmp / "refused"), "--like", str(tampered))
    r["refused_wrote"] = (tmp / "refused").exists()

    source, exported = hfc.HFCheckpoint.read(source_dir), hfc.HFCheckpoint.read(export)
    r["layout"] = (source.tensors == exported.tensors, source.files == exported.files, exported.sharded)
    r["index_total"] = (
        exported.index_metadata["total_size"],
        sum(t.nbytes for t in exported.tensors.values()),
    )
    saved, original = hfc.read_hf_state_dict(export), hfc.read_hf_state_dict(source_dir)
    copied = [n for n in original if n.startswith(("model.visual.", "mtp."))]
    r["copied"] = (len(copied), all(torch.equal(saved[n], original[n]) for n in copied))
    with Runtime():
        run = run_weights_in_hf_names(tmp / "ckpt" / "step_000003", source)
    r["trained"] = (
        sorted(run) == sorted(set(original) - set(copied)),
        [n for n in run if not torch.equal(saved[n], run[n])],
        [n for n in run if torch.equal(saved[n], original[n])],
    )
    r["a_log"] = {n: (saved[n].dtype, torch.equal(saved[n], run[n])) for n in saved if n.endswith("A_log")}
    theirs, ours = files_of(source_dir), files_of(export)
    r["other_files"] = {n: ours.get(n) == b for n, b in theirs.items() if not n.startswith("model")}
    r["in_run_export_equal"] = files_of(tmp / "run" / "hf") == ours
    with Runtime():
        r["fp32_main"] = _fp32_main_parameter_cases(tmp, source_dir, tmp / "ckpt" / "step_000003")

    _force_transformers_pure_torch()
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    loaded = {}
    for cls in (AutoModelForCausalLM, Qwen3_5ForConditionalGeneration):
        model, info = cls.from_pretrained(export, output_loading_info=True)
        loaded[cls.__name__] = (type(model).__name__, {k: list(v) for k, v in info.items() if v})
    r["transformers"] = loaded
    return r


@pytest.fixture(scope="module")
def drop_in(gloo, tmp_path_factory):
    return gloo(_drop_in_cases, 1, str(tmp_path_factory.mktemp("drop_in")), runtime=False)[0]


def test_drop_in_export_has_the_sources_tensors_files_and_layout(drop_in):
    rc, out, err = drop_in["cli"]
    assert rc == 0, err[-3000:]
    assert "Qwen3_5ForConditionalGeneration in the layout of" in out
    copied, bitwise = drop_in["copied"]
    assert bitwise and copied > 15, out
    assert (
        f"copied bit for bit from the source: {copied} tensors (mtp.*: 15, model.visual.*: {copied - 15})"
        in out
    )
    assert "config.json from the source: unchanged" in out and PROCESSOR_FILE in out
    assert drop_in["layout"] == (True, True, True)  # names, shapes, dtypes, files; an index
    total, summed = drop_in["index_total"]
    assert total == summed
    assert all(drop_in["other_files"].values()) and PROCESSOR_FILE in drop_in["other_files"], drop_in[
        "other_files"
    ]
    assert drop_in["in_run_export_equal"]


def test_drop_in_export_holds_the_trained_weights_and_fp32_a_log(drop_in):
    complete, differ_from_run, unchanged = drop_in["trained"]
    assert complete and differ_from_run == []
    assert "model.language_model.embed_tokens.weight" not in unchanged  # training moved the weights
    assert len(drop_in["a_log"]) == 3
    fp32 = drop_in["fp32_main"]  # a bf16 model with fp32 main parameters in its checkpoint
    assert fp32["loaded"] and fp32["from_main"] and fp32["from_weights"] and fp32["bits_beyond_bf16"], fp32
    assert fp32["reports"] == (fp32["names"], [], fp32["names"])
    assert all(dtype == torch.float32 and equal for dtype, equal in drop_in["a_log"].values()), drop_in[
        "a_log"
    ]


def test_drop_in_export_loads_in_transformers_both_ways(drop_in):
    assert drop_in["transformers"] == {  # no missing, unexpected or mis-shaped tensor either way
        "AutoModelForCausalLM": ("Qwen3_5ForCausalLM", {}),
        "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForConditionalGeneration", {}),
    }


def test_a_source_tensor_the_export_cannot_place_is_refused(drop_in):
    rc, out, err = drop_in["refused"]
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: ") and "model.language_model.layers.0.mlp.experts.0.weight" in err
    assert "would lose them" in err and "--like none" in err
    assert not drop_in["refused_wrote"]


# ---------------------------------------------------------------------------------------------
# python train.py: the tiny demo's round trip, and generating from its export on the CPU
# ---------------------------------------------------------------------------------------------


def _train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    small = (
        "train.steps=3",
        "train.global_batch_size=4",
        "data.num_samples=64",
        "data.synthetic_max_steps=1",
        "optim.warmup_steps=1",
        "logging.wandb.mode=disabled",
        "checkpoint.export_hf_final=true",
    )
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *small, *overrides],
        cwd=run_dir.parent,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )


def _generate(export: Path) -> tuple[list[int], str]:
    """What docs/checkpoints.md ("Using an export") shows, on the CPU."""
    hfc.use_torch_kernels_in_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    output = model.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    new = output[0, prompt["input_ids"].shape[1] :].tolist()
    return new, tokenizer.decode(new)


def test_tiny_demo_export_trains_again_exports_again_and_generates(short_train_py, tmp_path):
    # the tiny demo's first export: the session's 3-step run (checkpoint.export_hf_final=true)
    first, run, _, _ = short_train_py("3 steps")
    assert first.returncode == 0, first.stderr[-3000:]
    export = run / "hf"
    assert json.loads((export / "config.json").read_text())["vocab_size"] == 264
    second = _train(tmp_path / "second", f"model.hf_checkpoint={export}")
    assert second.returncode == 0, second.stderr[-3000:]
    again = tmp_path / "second" / "hf"
    assert hfc.HFCheckpoint.read(again).tensors == hfc.HFCheckpoint.read(export).tensors
    assert not torch.equal(
        hfc.read_hf_state_dict(again)["model.embed_tokens.weight"],
        hfc.read_hf_state_dict(export)["model.embed_tokens.weight"],
    )  # it trained
    new, text = _generate(again)
    assert len(new) == 5 and all(0 <= i < 264 for i in new) and isinstance(text, str)

    wrong = _train(tmp_path / "wrong", f"model.hf_checkpoint={export}", "model.preset=qwen3_5_9b_reduced")
    assert wrong.returncode == 2, wrong.stderr[-3000:]
    assert "Traceback" not in wrong.stderr and wrong.stderr.count("error: ") == 1, wrong.stderr[-3000:]
    assert "does not match model.preset=qwen3_5_9b_reduced" in wrong.stderr
    assert "use model.preset=qwen3_5_tiny" in wrong.stderr
