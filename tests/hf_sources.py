"""Hugging Face checkpoints made for tests with transformers' own classes: a tiny Qwen3.5 VLM
(text, vision tower, MTP tensors) in the layout of the published ones; the text config and random
HF state dicts of the conversion tests; reading an export back (its files, the export CLI, a run's
weights in HF names)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch

from relax_gdn.model import hf_checkpoint as hfc

# qwen3_5_tiny's sizes in HF terms, with a vocabulary of the checkpoint's own (not the preset's 256
# nor the embedded tokenizer's 264): the run must take it from the checkpoint
TINY_TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    tie_word_embeddings=False,
)
# The same sizes for the import/export parity tests: a vocabulary of 250 (padded to 256 in the
# model, as Megatron pads to TP multiples, so the padding path runs) and a wider initialisation
HF_TEXT_CONFIG = {**TINY_TEXT, "vocab_size": 250, "max_position_embeddings": 128, "initializer_range": 0.1}
TINY_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    patch_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
)
PROCESSOR_FILE = "preprocessor_config.json"


def mtp_tensors(text: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Qwen3.5's multi-token-prediction layer (one gated-attention layer and its input fusion),
    as the published checkpoints name it; transformers has no module for it, so it is added."""
    h, f, d = text["hidden_size"], text["intermediate_size"], text["head_dim"]
    q, kv = text["num_attention_heads"] * d, text["num_key_value_heads"] * d
    layer = "mtp.layers.0."
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        f"{layer}input_layernorm.weight": (h,),
        f"{layer}post_attention_layernorm.weight": (h,),
        f"{layer}self_attn.q_proj.weight": (2 * q, h),
        f"{layer}self_attn.k_proj.weight": (kv, h),
        f"{layer}self_attn.v_proj.weight": (kv, h),
        f"{layer}self_attn.o_proj.weight": (h, q),
        f"{layer}self_attn.q_norm.weight": (d,),
        f"{layer}self_attn.k_norm.weight": (d,),
        f"{layer}mlp.gate_proj.weight": (f, h),
        f"{layer}mlp.up_proj.weight": (f, h),
        f"{layer}mlp.down_proj.weight": (h, f),
    }
    gen = torch.Generator().manual_seed(5)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}


def make_vlm_source(out: Path, text: dict = TINY_TEXT) -> None:
    """A random ``Qwen3_5ForConditionalGeneration`` of ``text``'s sizes (and a tiny vision tower)
    saved by transformers in bf16 with fp32 ``A_log`` over two shards, plus MTP tensors, the
    embedded tokenizer (so the run's tokenizer is the source's), a processor file and a generation
    config."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from relax_gdn.data.tokenizer import ByteChatTokenizer

    config = Qwen3_5Config(
        text_config=text,
        vision_config={**TINY_VISION, "out_hidden_size": text["hidden_size"]},
        image_token_id=300,
        video_token_id=301,
        vision_start_token_id=302,
        vision_end_token_id=303,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    for name, param in model.named_parameters():
        if name.endswith("A_log"):
            param.data = param.data.float()  # as the published checkpoints keep it
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=int(size * 0.6))
    index_path = out / hfc.source.SAFETENSORS_INDEX
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2, files
    last = files[-1]
    mtp = mtp_tensors(text, torch.bfloat16)
    save_file({**load_file(out / last), **mtp}, str(out / last), metadata={"format": "pt"})
    index["weight_map"].update({name: last for name in mtp})
    index_path.write_text(json.dumps(index, indent=2))
    ByteChatTokenizer().save_pretrained(out)
    (out / PROCESSOR_FILE).write_text(json.dumps({"processor_class": "Qwen3VLProcessor", "patch_size": 2}))


# HF_TEXT_CONFIG keeps every structural feature of Qwen3.5 (GQA, the output gate, partial RoPE, the
# 3:1 GDN/attention pattern, GVA, untied embeddings); its vocabulary of 250 is padded to this in the model
MODEL_VOCAB = 256


def random_hf_state(dims: hfc.Qwen3_5Dims, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors for every HF tensor of ``dims``' conversion plan."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen)
        for rule in hfc.conversion_plan(dims)
        for name, shape in zip(rule.hf, rule.hf_shapes)
    }


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file of ``directory`` (not its subdirectories) by name, as bytes."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def export_cli(*args: str) -> tuple[int, str, str]:
    """``python -m relax_gdn.export_hf ARGS`` in this process: (exit code, stdout, stderr)."""
    from relax_gdn.export_hf import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def run_weights_in_hf_names(checkpoint: Path, source: hfc.HFCheckpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's weights (loaded into a fresh model) in HF names and the source's dtypes, by
    the plain state-dict conversion: independent of the export's gathering and sharding."""
    from relax_gdn.model.hf_checkpoint.convert import model_tensors
    from relax_gdn.parallel import ParallelContext
    from relax_gdn.train.build import build_checkpoint_model
    from relax_gdn.train.checkpoint import read_manifest
    from relax_gdn.train.checkpoint_state import load_model_weights

    manifest = read_manifest(checkpoint)
    parallel = ParallelContext.initialize(tp=1, cp=1, dynamic_max_cp=None)
    try:
        model = build_checkpoint_model(manifest, parallel, torch.device("cpu"))
        load_model_weights(checkpoint, model)
    finally:
        ParallelContext.destroy()
    dims = hfc.dims_from_model(model, vocab_size=320)
    text = hfc.mcore_to_hf_state_dict({k: v.detach() for k, v in model_tensors(model).items()}, dims)
    by_text = source.by_text_name()
    return {by_text[name]: tensor.to(source.tensors[by_text[name]].dtype) for name, tensor in text.items()}
