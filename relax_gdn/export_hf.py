"""``python -m relax_gdn.export_hf CHECKPOINT OUT``: a training checkpoint as a Hugging Face directory.

CHECKPOINT is a ``step_NNNNNN`` directory or the ``checkpoint.dir`` holding them (its newest
complete one). Whatever TP / CP / dynamic CP wrote it, the model is rebuilt from the run's config
stored in the checkpoint at TP 1, CP 1 on CPU in this one process, its weights are loaded through
Megatron-Core's distributed checkpointing, and OUT receives ``config.json``, safetensors and, when
the run used a local tokenizer directory, that tokenizer: ``AutoModelForCausalLM.from_pretrained(OUT)``
loads it. Exit code 2 with one message for a missing or damaged checkpoint.

The other direction needs no command: ``model.hf_checkpoint=DIR`` starts a run from an HF
directory (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from relax_gdn.errors import USER_ERROR_EXIT_CODE, RecipeError

DTYPES = {"checkpoint": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str = "checkpoint") -> Path:
    """Write the model of ``checkpoint`` to ``out`` as an HF directory; returns ``out``. Without
    CUDA it needs an installed :class:`relax_gdn.runtime.Runtime` (``main`` installs one)."""
    import torch.distributed as dist

    from relax_gdn.config import run_config_from_dict
    from relax_gdn.train.checkpoint import load_model_weights, read_manifest, resolve_resume
    from relax_gdn.train.lifecycle import local_tokenizer_dir, write_hf_export

    directory, _ = resolve_resume(str(checkpoint), None)  # verified: damage is reported before any build
    manifest = read_manifest(directory)
    cfg = run_config_from_dict(manifest["config"])
    if not torch.cuda.is_available():  # the model is built on CPU: Megatron-Core needs the Runtime's shims
        from relax_gdn.runtime import require_runtime

        require_runtime("exporting a checkpoint on a machine without CUDA", cpu_shims=True)
    from megatron.core import parallel_state

    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import build_qwen3_5_preset_model, qwen3_5_config
    from relax_gdn.train.loop import init_distributed

    created = init_distributed(torch.device("cpu"))
    try:
        parallel_state.initialize_model_parallel(1, context_parallel_size=1, create_gloo_process_groups=False)
        tconfig = qwen3_5_config(cfg.model.preset, tensor_model_parallel_size=1, use_cpu_initialization=True,
                                 params_dtype=torch.float32)
        model = build_qwen3_5_preset_model(
            cfg.model.preset, tconfig, vocab_size=manifest["model"]["vocab_size"],
            gdn=GDNOptions(kernel_backend="torch", training=False), spec_provider=cfg.model.spec_provider,
            attention_backend=cfg.model.attention_backend,
        )
        load_model_weights(directory, model)
        target = DTYPES[dtype] or getattr(torch, manifest["model"].get("dtype", "float32"))
        model.to(target)
        out = Path(out)
        write_hf_export(model, out, vocab_size=manifest["model"]["vocab_size"],
                        tokenizer_vocab_size=manifest.get("tokenizer", {}).get("vocab_size"),
                        tokenizer_path=local_tokenizer_dir(cfg.data.tokenizer))
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if created and dist.is_initialized():
            dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax_gdn.export_hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a step_NNNNNN checkpoint directory, or the checkpoint.dir holding them")
    parser.add_argument("out", help="the Hugging Face directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="checkpoint",
                        help="weights dtype in OUT (default: the dtype the run trained in)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from relax_gdn.runtime import Runtime

    try:
        with Runtime():
            out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
