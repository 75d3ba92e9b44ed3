"""The one place a run's model is built: from a config and a :class:`~relax_gdn.parallel.ParallelContext`.

* :func:`build` (the Trainer and the benchmarks): the padded vocabulary (:func:`padded_vocab_size`),
  the memory model's choice of whole-layer recomputes (:func:`resolve_full_layers`), the
  memory-fit verdict (:func:`check_memory_fits`, before anything is built), the C++ extension
  ``mlp_act``'s recompute needs (:func:`~relax_gdn.compat.share_storage.build_share_storage`), then
  the model on this rank's device with the weights it starts from (:func:`load_base_weights`).
  Nothing in it is a collective; a caller that runs it on every rank wraps it in
  :func:`~relax_gdn.train.agreement.agree_on_errors`.
* :func:`build_checkpoint_model` (``python -m relax_gdn.export_hf`` and the tools that read a
  checkpoint's weights): the model a checkpoint's manifest describes, uninitialised (every weight
  comes from the checkpoint) and with the pure-torch GDN kernels (nothing runs forward).
* what is decided before the build: the device and precision (:func:`select_device`,
  :func:`select_bf16`), the MTP layers a Hugging Face checkpoint brings (:func:`resolve_mtp_layers`).

Every choice that changes the math or the kernels goes into the frozen options the model is built
with (:func:`model_options`); the process-wide change one of them needs (Megatron-Core's fused
wgrad GEMM) is handed to the Runtime, which undoes it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from relax_gdn.compat.share_storage import build_share_storage
from relax_gdn.config import ParallelDims, RunConfig
from relax_gdn.errors import ConfigError, MemoryFitError
from relax_gdn.model import Qwen3_5Options, build_qwen3_5_model, qwen3_5_config, qwen3_5_preset
from relax_gdn.model.fusion import Fusion
from relax_gdn.model.hf_checkpoint import HFCheckpoint, load_hf_checkpoint, run_vocab_size
from relax_gdn.model.lora import seed_base_weights
from relax_gdn.model.mtp import MTPOptions
from relax_gdn.model.recompute import (
    apply_mixed_recompute,
    mtp_recompute,
    recompute_config_fields,
    recomputes,
)
from relax_gdn.parallel import ParallelContext, launcher_rank
from relax_gdn.train.flops import ModelShape
from relax_gdn.train.memory import GIB, MemoryEstimate, estimate_memory, fewest_full_layers, settings_that_fit

logger = logging.getLogger("relax_gdn.train")


@dataclass(frozen=True)
class BuiltModel:
    """What :func:`build` made."""

    cfg: RunConfig  # the config as built: ``recompute.full_layers`` resolved (:func:`resolve_full_layers`)
    tconfig: Any  # Megatron-Core's TransformerConfig
    model: torch.nn.Module  # the Qwen3.5 model on this rank's device, with its starting weights
    vocab_size: int  # rows of the embedding and the output layer (:func:`padded_vocab_size`)


# ---------------------------------------------------------------------------------------------
# before the build
# ---------------------------------------------------------------------------------------------


def select_device(cfg: RunConfig) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(["train.device=cuda but CUDA is not available here; use train.device=auto or cpu"])
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        # torchrun sets LOCAL_RANK; a caller that made the process group itself has already
        # chosen this process's GPU with torch.cuda.set_device
        local_rank = os.environ.get("LOCAL_RANK")
        return torch.device(
            "cuda", int(local_rank) if local_rank is not None else torch.cuda.current_device()
        )
    return torch.device("cpu")


def select_bf16(cfg: RunConfig, device: torch.device) -> bool:
    if cfg.train.precision == "bf16" and device.type != "cuda":
        raise ConfigError(
            [
                "train.precision=bf16 needs CUDA (the CPU path trains in fp32); use "
                "train.precision=auto or fp32 on CPU"
            ]
        )
    return cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")


def resolve_mtp_layers(cfg: RunConfig) -> RunConfig:
    """``model.mtp.num_layers=null``: the MTP layers ``model.hf_checkpoint`` holds (its ``mtp.*``
    tensors; 0 without a checkpoint), so a run from a checkpoint with an MTP layer trains it and its
    export serves MTP speculative decoding with a layer that matches the fine-tuned model; 0 for a
    LoRA run (adapters only: the export copies the checkpoint's MTP layer). ``cfg`` as it is
    otherwise. Logged on rank 0."""
    if cfg.model.mtp.num_layers is not None:
        return cfg
    layers = 0
    if cfg.model.hf_checkpoint and not cfg.model.lora.rank:  # a LoRA run copies the MTP layer unchanged
        try:
            layers = HFCheckpoint.read(cfg.model.hf_checkpoint).mtp_layers()
        except FileNotFoundError as e:
            raise ConfigError(f"model.hf_checkpoint={cfg.model.hf_checkpoint!r}: {e}") from e
    if layers and launcher_rank() == 0:
        logger.info(
            "model.mtp.num_layers=null: model.hf_checkpoint holds %d MTP layer(s), trained with weight "
            "model.mtp.loss_weight=%g (model.mtp.num_layers=0 copies them into the export unchanged)",
            layers,
            cfg.model.mtp.loss_weight,
        )
    return cfg.with_overrides({"model.mtp.num_layers": layers})


def padded_vocab_size(cfg: RunConfig, tokenizer_vocab_size: int, tp: int) -> int:
    """Rows of the embedding and the output layer for a tokenizer of ``tokenizer_vocab_size`` words."""
    if cfg.model.hf_checkpoint:  # the checkpoint's (its other sizes checked against the preset)
        return run_vocab_size(cfg.model.hf_checkpoint, cfg.model.preset, tokenizer_vocab_size, tp)
    # Megatron pads to a multiple of 128 x TP; padding to 128 x 8 instead gives every TP <= 8 the
    # SAME padded vocabulary, so a checkpoint written at one TP loads at another (the embedding and
    # output layer keep their global shape). The initial values still differ between TP sizes:
    # Megatron-Core initialises each TP shard from its own RNG stream.
    multiple = 128 * max(8, tp)
    return -(-tokenizer_vocab_size // multiple) * multiple


# ---------------------------------------------------------------------------------------------
# the memory-fit verdict
# ---------------------------------------------------------------------------------------------


def device_memory_bytes(device: torch.device) -> int | None:
    """What the memory model checks against: the GPU's total memory (None off CUDA)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def memory_inputs(cfg: RunConfig, dims: ParallelDims, bf16: bool, vocab_size: int) -> tuple[ModelShape, dict]:
    """The model's shape and the run's settings as :func:`~relax_gdn.train.memory.estimate_memory` takes them."""
    shape = ModelShape.from_transformer_config(
        qwen3_5_config(cfg.model.preset),
        vocab_size,
        mtp_num_layers=cfg.model.mtp.num_layers or 0,
        lora=cfg.lora_options,
    )
    settings = dict(
        tokens_per_gpu=cfg.train.max_tokens_per_gpu,
        tp=dims.tp,
        cp=dims.cp,
        dp=dims.dp,
        sequence_parallel=cfg.parallel.sp,
        bf16=bf16,
        recompute=cfg.recompute.granularity,
        full_layers=cfg.recompute.full_layers or 0,
        fused_norms=cfg.model.fused_norms,
        fused_cross_entropy=cfg.model.fused_cross_entropy,
        optimizer=cfg.optim.name,
        fp8=cfg.model.fp8.recipe,
        fp8_frozen_on_host=cfg.model.fp8.frozen_weights_on_host,
    )
    return shape, settings


def memory_estimate(
    cfg: RunConfig, dims: ParallelDims, *, bf16: bool, vocab_size: int, optimizer: str | None = None
) -> MemoryEstimate:
    """The memory model's per-GPU estimate of ``cfg`` (``optimizer``: instead of ``optim.name``)."""
    shape, settings = memory_inputs(cfg, dims, bf16, vocab_size)
    return estimate_memory(shape, **{**settings, "optimizer": optimizer or settings["optimizer"]})


def resolve_full_layers(
    cfg: RunConfig, dims: ParallelDims, device: torch.device, bf16: bool, vocab_size: int
) -> RunConfig:
    """``recompute.granularity=mixed`` with ``recompute.full_layers=null``: the fewest whole-layer
    recomputes the memory model fits on this GPU (every layer when none fits: the check then refuses;
    none without a GPU to fit). ``cfg`` as it is otherwise."""
    if cfg.recompute.granularity != "mixed" or cfg.recompute.full_layers is not None:
        return cfg
    capacity = device_memory_bytes(device)
    layers = 0
    if capacity is not None:
        shape, settings = memory_inputs(cfg, dims, bf16, vocab_size)
        chosen = fewest_full_layers(shape, capacity, **settings)
        layers = shape.num_layers if chosen is None else chosen
    return cfg.with_overrides({"recompute.full_layers": layers})


def check_memory_fits(
    cfg: RunConfig, dims: ParallelDims, device: torch.device, bf16: bool, vocab_size: int, log: bool
) -> None:
    """On a GPU: log the per-GPU memory model and refuse (before building the model) a run whose
    estimate exceeds the GPU's memory, naming the settings the model says would fit
    (:class:`~relax_gdn.errors.MemoryFitError`). (A CPU run has no GPU memory to estimate.)"""
    capacity = device_memory_bytes(device)
    if capacity is None:
        return
    shape, settings = memory_inputs(cfg, dims, bf16, vocab_size)
    estimate = estimate_memory(shape, **settings)
    recompute = cfg.recompute.granularity + (
        f" ({cfg.recompute.full_layers} layers whole)" if cfg.recompute.granularity == "mixed" else ""
    )
    if log:
        logger.info(
            "memory model (%s, recompute %s, %d tokens/GPU): %s",
            cfg.model.preset,
            recompute,
            cfg.train.max_tokens_per_gpu,
            estimate.summary(),
        )
    if estimate.total > capacity:
        fits = [a.describe() for a in settings_that_fit(shape, capacity, **settings)]
        advice = (
            "The memory model says these fit: " + "; ".join(fits)
            if fits
            else "Nothing the memory model tries fits (other recompute settings, a smaller "
            "train.max_tokens_per_gpu, no optimizer state, more CP ranks)"
        )
        raise MemoryFitError(
            f"{cfg.model.preset} will not fit this GPU: {estimate.summary()} with recompute {recompute}, above its "
            f"{capacity / GIB:.0f} GiB. {advice} (optim.name=none is for benchmarks: gradients without an update)",
            estimate_gib=estimate.as_gib(),
            capacity_gib=round(capacity / GIB, 2),
            fits=fits,
        )


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------


def parallel_dims(parallel: ParallelContext) -> ParallelDims:
    """The sizes of ``parallel``'s groups as the config side names them."""
    return ParallelDims(parallel.tp * parallel.cp * parallel.dp, parallel.tp, parallel.cp)


def build(
    cfg: RunConfig,
    parallel: ParallelContext,
    *,
    tokenizer_vocab_size: int,
    device: torch.device,
    bf16: bool,
    runtime,
    log: bool = False,
) -> BuiltModel:
    """The model of ``cfg`` on ``parallel``'s groups (made first: ``ParallelContext.initialize``),
    checked against this GPU's memory before anything is built (a :class:`MemoryFitError` names
    what fits). ``runtime``: the installed :class:`relax_gdn.runtime.Runtime` (it takes over the
    process-wide change a fused wgrad GEMM needs); ``log``: this rank logs the memory model."""
    dims = parallel_dims(parallel)
    vocab_size = padded_vocab_size(cfg, tokenizer_vocab_size, parallel.tp)
    # mixed recompute without a layer count: the memory model's choice, kept in the run's config
    cfg = resolve_full_layers(cfg, dims, device, bf16, vocab_size)
    check_memory_fits(cfg, dims, device, bf16, vocab_size, log=log)
    fuse_wgrad = False
    if cfg.model.fused_grad_accumulation and device.type == "cuda":
        from relax_gdn.compat.wgrad import enable_wgrad_accumulation_fusion

        fuse_wgrad, undo = enable_wgrad_accumulation_fusion()
        runtime.adopt(undo)  # Megatron-Core patched: the Runtime undoes it
    options = model_options(cfg, vocab_size)
    if options.recompute_mlp_activation:
        # its recompute's C++ extension, built here rather than inside step 1's backward
        build_share_storage()
    tconfig = training_transformer_config(cfg, parallel.tp, device=device, bf16=bf16, fuse_wgrad=fuse_wgrad)
    model = build_qwen3_5_model(tconfig, options)
    if cfg.recompute.granularity == "mixed":
        apply_mixed_recompute(model, cfg.recompute.full_layers, cfg.recompute.modules)
    if device.type == "cuda":
        model.cuda(device)
    load_base_weights(model, cfg)
    return BuiltModel(cfg=cfg, tconfig=tconfig, model=model, vocab_size=vocab_size)


def training_transformer_config(
    cfg: RunConfig, tp: int, *, device: torch.device, bf16: bool, fuse_wgrad: bool
):
    """Megatron-Core's ``TransformerConfig`` of a training run of ``cfg`` at TP ``tp``."""
    return qwen3_5_config(
        cfg.model.preset,
        tensor_model_parallel_size=tp,
        sequence_parallel=cfg.parallel.sp,
        use_cpu_initialization=device.type == "cpu",
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        deterministic_mode=cfg.train.deterministic,
        calculate_per_token_loss=True,  # DDP sums gradients; the loss is already per global token
        bias_activation_fusion=cfg.model.fused_swiglu and device.type == "cuda",  # compiled SwiGLU kernels
        gradient_accumulation_fusion=fuse_wgrad,
        **recompute_config_fields(
            cfg.recompute.granularity,
            cfg.recompute.modules,
            skip_unused=cfg.recompute.skip_unused,
            num_layers=qwen3_5_preset(cfg.model.preset).config["num_layers"],
            full_layers=cfg.recompute.full_layers,
        ),
    )


def model_options(cfg: RunConfig, vocab_size: int) -> Qwen3_5Options:
    """What every module of ``cfg``'s model is told when it is built (kernels, fusions, recompute,
    the MTP layer, LoRA)."""
    granularity, modules, skip_unused = (
        cfg.recompute.granularity,
        cfg.recompute.modules,
        cfg.recompute.skip_unused,
    )
    return Qwen3_5Options.for_preset(
        cfg.model.preset,
        vocab_size=vocab_size,
        gdn=cfg.gdn_options,
        attention_backend=cfg.model.attention_backend,
        spec_provider=cfg.model.spec_provider,
        contiguous_between_layers=cfg.gdn.contiguous_between_layers,
        fusion=Fusion(
            norms=cfg.model.fused_norms,
            cross_entropy=cfg.model.fused_cross_entropy,
            embedding_grad_into_main_grad=cfg.model.fused_grad_accumulation,
        ),
        recompute_mlp_activation=recomputes(granularity, modules, "mlp_act"),
        recompute_skips_unread_gemm=skip_unused,  # acts under full recompute only
        mtp=MTPOptions(
            cfg.model.mtp.num_layers or 0, **mtp_recompute(granularity, modules, skip_unused=skip_unused)
        ),
        lora=cfg.lora_options,
        fp8=cfg.fp8_options,
    )


def load_base_weights(model, cfg: RunConfig) -> None:
    """The weights ``model`` starts from besides its initialisation: ``model.hf_checkpoint``'s, or
    with ``model.lora`` and no checkpoint the seeded base (the same at every TP size: a LoRA
    checkpoint holds only the adapters, and the base is rebuilt from what its manifest names)."""
    if cfg.model.hf_checkpoint:
        loaded = load_hf_checkpoint(model, cfg.model.hf_checkpoint)
        mtp_layers = cfg.model.mtp.num_layers or 0
        if mtp_layers and not loaded.mtp_num_layers and dist.get_rank() == 0:
            logger.warning(
                "model.mtp.num_layers=%d but model.hf_checkpoint has no MTP layer (mtp.*): the MTP layer "
                "starts from random weights (its loss starts near log(vocabulary))",
                mtp_layers,
            )
    elif cfg.lora_options is not None:
        seed_base_weights(model, cfg.train.seed)


def build_checkpoint_model(manifest: dict[str, Any], parallel: ParallelContext, device: torch.device):
    """The model a checkpoint's ``manifest`` describes (its run's config, vocabulary, parameter
    dtype and MTP layers) on ``parallel``'s groups, for its weights to be loaded into: no random
    initialisation, the pure-torch GDN kernels (nothing trains). Its config is ``manifest["config"]``."""
    from relax_gdn.config import run_config_from_dict
    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import build_qwen3_5_preset_model

    cfg = run_config_from_dict(manifest["config"])
    saved = manifest["model"]
    dtype = getattr(torch, saved.get("dtype", "float32"))  # the run's parameter dtype
    tconfig = qwen3_5_config(
        cfg.model.preset,
        tensor_model_parallel_size=parallel.tp,
        perform_initialization=False,
        use_cpu_initialization=device.type == "cpu",
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    model = build_qwen3_5_preset_model(
        cfg.model.preset,
        tconfig,
        vocab_size=saved["vocab_size"],
        gdn=GDNOptions(kernel_backend="torch", training=False),
        spec_provider=cfg.model.spec_provider,
        attention_backend=cfg.model.attention_backend,
        mtp=MTPOptions(saved.get("mtp_num_layers", 0)),
        lora=cfg.lora_options,
        fusion=Fusion(cross_entropy=cfg.model.fused_cross_entropy),
    )
    return model.to(device)
