"""``python -m relax_gdn.export_hf CHECKPOINT OUT``: a training checkpoint as a Hugging Face directory.

CHECKPOINT is a ``step_NNNNNN`` directory, the checkpoint directory holding them (the one ``latest``
names) or a run directory (its checkpoints); OUT a new or empty directory, or with ``--overwrite``
one whose content the export replaces, whole: it is written beside OUT and renamed to it once
complete, and checked before anything is built (:mod:`relax_gdn.export_target`). Whatever TP /
CP / dynamic CP wrote it, the model is rebuilt from the run's config stored in the checkpoint at
TP 1, CP 1 in this one process (on the GPU where CUDA is visible, as
in training; on the CPU otherwise) and its weights are loaded through Megatron-Core's distributed
checkpointing. OUT receives, when the run started from ``model.hf_checkpoint=DIR`` (recorded in
the checkpoint; ``--like`` overrides), a drop-in replacement of DIR: its layout, architecture,
tensor names, dtypes and shard files, its vision tower copied and its MTP layer copied or, when the
run trained one (``model.mtp.num_layers``), written from the run, its config and other files;
otherwise the text layout ``Qwen3_5ForCausalLM``. Either way with a tokenizer ``transformers`` loads
(docs/checkpoints.md, "What an export holds"). It prints what it wrote, copied and changed. Exit
code 2 with one message for a missing or damaged checkpoint, or a source tensor the export could
not place.

A LoRA checkpoint (``model.lora``) holds only the adapters: the model is rebuilt on the base its
manifest names (the Hugging Face directory the run started from, or the preset's seeded base) and
OUT receives the merged model (``W + scaling · B·A``; the tensors no adapter changed copied from
the source in a drop-in export), or with ``--adapter`` the adapters alone as a PEFT adapter
directory for that base (docs/lora.md).

The other direction needs no command: ``model.hf_checkpoint=DIR`` starts a run from an HF
directory (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

import torch

from relax_gdn.errors import USER_ERROR_EXIT_CODE, RecipeError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
RECORDED = "recorded"  # --like's default: the checkpoint the run started from, as its manifest records


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    dtype: str | None = None,
    like: str | Path | None = RECORDED,
    adapter: bool = False,
    *,
    runtime,
):
    """Write the model of ``checkpoint`` to ``out`` as an HF directory; returns the
    :class:`~relax_gdn.model.hf_checkpoint.ExportReport`. ``like``: the checkpoint whose layout to
    keep (default: the one the run started from, if any; None: the text layout); ``dtype`` (text
    layout only): "float32" or "bfloat16" instead of the dtype the run trained in; ``adapter``: a
    LoRA checkpoint's adapters as a PEFT adapter directory (an
    :class:`~relax_gdn.model.hf_checkpoint.peft.AdapterReport`). ``runtime``: the installed
    :class:`relax_gdn.runtime.Runtime` (``main`` installs one; without CUDA it applied Megatron-Core's
    CPU shims)."""
    from relax_gdn.config import run_config_from_dict
    from relax_gdn.train.checkpoint import read_manifest, resolve_resume
    from relax_gdn.train.hf_export import export_spec

    directory, _ = resolve_resume(str(checkpoint), None)  # verified: damage is reported before any build
    manifest = read_manifest(directory)
    spec = export_spec(
        manifest,
        like=like if like == RECORDED or like is None else Path(like),
        dtype=DTYPES[dtype] if dtype else None,
    )
    lora = manifest["model"].get("lora")
    if adapter and not lora:
        raise RecipeError(
            f"--adapter exports LoRA adapters, and checkpoint {directory} is a full fine-tuning one "
            "(no model.lora): export it without --adapter"
        )
    if adapter and "hf_checkpoint" not in lora["base"]:
        raise RecipeError(
            f"checkpoint {directory} trained LoRA adapters on the seeded base of preset "
            f"{lora['base'].get('preset')} (train.seed={lora['base'].get('seed')}, no model.hf_checkpoint), "
            "which no Hugging Face model holds, so a PEFT adapter has nothing to load onto: export the "
            "merged model instead (without --adapter)"
        )
    if spec.like is not None:
        _check_source(spec.like, manifest, recorded=like == RECORDED)
        if dtype:
            raise RecipeError(
                f"--dtype {dtype} applies to the text layout; an export in the layout of "
                f"{spec.like} keeps each tensor's dtype there (add --like none for the text "
                "layout)"
            )
    device = _prepare_device(runtime)
    return _export(
        directory,
        manifest,
        run_config_from_dict(manifest["config"]),
        Path(out),
        spec,
        device,
        adapter=adapter,
    )


def _check_source(like: Path, manifest: dict, recorded: bool) -> None:
    """Before building anything: ``like`` reads, and the export can place every tensor of it
    (:func:`~relax_gdn.model.hf_checkpoint.drop_in_origins` on the preset's sizes raises the refusal)."""
    from relax_gdn.model.hf_checkpoint import HFCheckpoint, dims_from_hf_config, drop_in_origins, preset_dims

    where = (
        "the checkpoint the run started from (model.hf_checkpoint, recorded in its manifest)"
        if recorded
        else "--like"
    )
    try:
        source = HFCheckpoint.read(like)
        vocab = dims_from_hf_config(source.config or like).vocab_size
    except (FileNotFoundError, NotADirectoryError, KeyError, ValueError) as e:  # ValueError: not Qwen3.5
        raise RecipeError(
            f"{where} is {like}, which cannot be read ({e}); the export keeps its layout "
            "and copies its vision tower and MTP tensors: pass --like <a copy of it>, or "
            "--like none for the text layout without them"
        ) from e
    model = manifest["model"]
    drop_in_origins(source, preset_dims(model["preset"], vocab, model.get("mtp_num_layers", 0)))


def _export(directory: Path, manifest: dict, cfg, out: Path, spec, device: torch.device, *, adapter: bool):
    """Build the run's model at TP 1, CP 1, load the checkpoint's weights (a LoRA run's: its base,
    then its adapters), write the export."""
    import torch.distributed as dist

    from relax_gdn.parallel import ParallelContext, init_distributed
    from relax_gdn.train.build import build_checkpoint_model
    from relax_gdn.train.checkpoint_state import checkpoint_fp32_main_params, load_model_weights
    from relax_gdn.train.hf_export import write_hf_export

    created = init_distributed(device)
    try:
        parallel = ParallelContext.initialize(tp=1, cp=1, dynamic_max_cp=None)
        if device.type == "cuda":
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(cfg.train.seed)  # the RNG tracker Megatron-Core's layers fork
        model = build_checkpoint_model(manifest, parallel, device)
        if cfg.lora_options is not None:
            return _export_lora(directory, manifest, cfg, model, out, spec, adapter=adapter)
        load_model_weights(directory, model)
        main_params = checkpoint_fp32_main_params(directory, manifest, model)
        return write_hf_export(model, out, spec, main_params=main_params)
    finally:
        ParallelContext.destroy()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _export_lora(directory: Path, manifest: dict, cfg, model, out: Path, spec, *, adapter: bool):
    """A LoRA checkpoint: the base its manifest names (the HF directory, or ``--like`` where it
    moved), its adapters, then the merged model or (``adapter``) the PEFT adapter directory."""
    from relax_gdn.train.build import load_base_weights
    from relax_gdn.train.checkpoint_state import load_model_weights
    from relax_gdn.train.hf_export import write_adapter_export, write_merged_lora_export

    base = manifest["model"]["lora"]["base"].get("hf_checkpoint")
    if base is not None:
        base = str(spec.like) if spec.like is not None else base
        if not Path(base).is_dir():
            raise RecipeError(
                f"the LoRA checkpoint's base {base} (the model.hf_checkpoint it trained on) is not a "
                "directory here: pass --like <a copy of it>"
            )
    load_base_weights(model, replace(cfg, model=replace(cfg.model, hf_checkpoint=base)))
    load_model_weights(directory, model)
    if adapter:  # (an adapter needs an HF base: export_checkpoint refused one without)
        return write_adapter_export(
            model, out, replace(spec, like=Path(base)), dropout=cfg.lora_options.dropout
        )
    return write_merged_lora_export(model, out, spec)


def _prepare_device(runtime) -> torch.device:
    """The GPU where CUDA is visible: Megatron-Core creates GDN parameters on
    ``torch.cuda.current_device()`` and forks its CUDA RNG tracker whenever a GPU is visible, and
    the CPU shims that redirect both must not hide a GPU. The CPU otherwise (``CUDA_VISIBLE_DEVICES=``
    forces it), where the installed Runtime has applied Megatron-Core's CPU shims."""
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        return device
    runtime.require("exporting a checkpoint on a machine without CUDA", cpu_shims=True)
    return torch.device("cpu")


def _prepare(args: argparse.Namespace, like: str | None):
    """CHECKPOINT resolved and OUT checked (``relax_gdn.export_target``), before anything is built."""
    from relax_gdn.export_target import ExportTarget, estimated_bytes, resolve_checkpoint
    from relax_gdn.train.checkpoint import read_manifest
    from relax_gdn.train.hf_export import export_spec

    directory = resolve_checkpoint(args.checkpoint)
    manifest = read_manifest(directory)
    spec = export_spec(manifest, like=like if like == RECORDED or like is None else Path(like))
    needed = estimated_bytes(
        directory,
        manifest,
        like=spec.like,
        adapter=args.adapter,
        dtype_bytes=DTYPES[args.dtype].itemsize if args.dtype else None,
    )
    return directory, ExportTarget.prepare(args.out, overwrite=args.overwrite, needed_bytes=needed)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m relax_gdn.export_hf", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a step_NNNNNN checkpoint directory, the checkpoint directory holding them (its "
        "newest), or a run directory (its checkpoints)",
    )
    parser.add_argument(
        "out", metavar="OUT", help="the Hugging Face directory to write: new or empty (see --overwrite)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what OUT holds, whole: the export is written beside OUT and renamed "
        "to it once complete",
    )
    parser.add_argument(
        "--like",
        default=RECORDED,
        metavar="DIR",
        help="keep the layout of this HF checkpoint (default: the one the run started from, "
        "model.hf_checkpoint, if any); 'none': the text layout Qwen3_5ForCausalLM",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="text layout: the weights' dtype (default: the dtype the run trained in)",
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA checkpoint: write its adapters as a PEFT adapter directory for the base model "
        "(adapter_config.json, adapter_model.safetensors) instead of the merged model",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # what the export did is its report, printed below; the build's info lines are training's
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    like = None if args.like == "none" else args.like
    from relax_gdn.runtime import Runtime

    target = None
    try:
        with Runtime() as runtime:
            directory, target = _prepare(args, like)
            report = export_checkpoint(
                directory, target.partial, args.dtype, like, adapter=args.adapter, runtime=runtime
            )
    except BaseException as e:
        if target is not None:
            target.discard()
        if not isinstance(e, RecipeError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    target.commit()
    report.out = target.out
    print("\n".join(report.lines()))
    if args.adapter:
        print(
            f"load it with peft.PeftModel.from_pretrained(<the base model>, {str(report.out)!r}) (docs/lora.md)"
        )
    else:
        print(
            f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(report.out)!r}) "
            "(docs/checkpoints.md, 'Using an export')"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
