"""The training loop: :func:`run_training` (the entry point) runs a :class:`Trainer`.

:func:`run_training` validates the config (nothing built yet; ``model.mtp.num_layers=null`` is
resolved from the checkpoint's tensors, :func:`resolve_mtp_layers`), picks the device and loads +
tokenizes the data (a bad source fails here, before any process group, model or file exists), then:

1. :meth:`Trainer.setup`: process groups (:class:`relax_gdn.parallel.ParallelContext`: TP x CP
   groups from ``parallel_state.initialize_model_parallel``, DP = world / (tp·cp), dynamic-CP
   sub-groups), the model (``build_qwen3_5_model``), gradient sync + optimizer + warm-up/cosine
   schedule, checkpoint/resume and the run directory (:class:`RunLifecycle`), loggers, the
   micro-batch planner, the evaluator and the metrics;
2. :meth:`Trainer.train_step`: ONE optimizer step: the step's global batch (a pure function of seed
   and step) planned into this rank's micro-batches (:class:`MicroBatchPlanner`: packed for this
   DP rank, sharded for this CP rank; dynamic CP: each micro-batch at its own CP size d, split over
   the CP group's sub-groups of size d), gradient accumulation with the loss
   ``Σ (per-token loss × loss_mask) / (loss tokens of the whole global batch)``, the optimizer
   step, the step's ONE all-reduce (loss + the :class:`StepFlag` s of every rank), the metrics
   record and the step's :class:`StepOutcome` (decided in one place, alike on every rank). With a
   multi-token-prediction layer the objective adds ``model.mtp.loss_weight × mtp_loss``
   (:mod:`relax_gdn.train.loss`) and the record ``mtp_loss``; ``loss`` stays the LM's;
3. :meth:`Trainer.run`: the steps, each followed by its evaluation when due, logging, the profiler
   window, the checkpoint when due, and the stop a rank asked for (SIGTERM/SIGUSR1, Ctrl-C:
   :mod:`relax_gdn.train.stop`) or a non-finite loss or grad norm decided (``train.on_nonfinite``),
   under the step watchdog (:mod:`relax_gdn.train.watchdog`); then the background save is
   awaited and the Hugging Face export written;
4. :meth:`Trainer.close`: signal handlers, the watchdog, loggers and process groups released (also
   after an error).

What every rank must decide alike is decided once (:mod:`relax_gdn.train.agreement`): the data
and checkpoint problems found on any rank stop every rank at the same place, the checkpoint to
resume is rank 0's choice, and a step's outcome comes from the step's all-reduce alone.

Non-finite steps: the grad norm is on the host before the update (the optimizer reads it to
clip), and an update whose grad norm is not finite is not applied (a non-finite loss comes with
non-finite gradients). The loss is all-reduced as a sum, so a NaN or inf on any rank is one on
every rank, read with the step's existing host read: no flag or sync is added for it.

Loss normalisation: every loss token of the global batch counts once across CP and DP. The
count is known on every rank without a collective: the global batch and its split are computed
identically on all ranks (``relax_gdn.data``), so it is ``Σ sample.num_loss_tokens`` over the
global batch. Gradients are then SUMMED over DP × CP (Megatron's ``calculate_per_token_loss``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum, auto
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from torch.profiler import ProfilerActivity, profile

from relax_gdn.config import ParallelDims, RunConfig, validate
from relax_gdn.config.hydra_io import save_run_config
from relax_gdn.data import (
    SFTDataset,
    global_batch_at_step,
    load_sft_dataset,
    load_tokenizer,
    padded_length,
    synthetic_math_dataset,
)
from relax_gdn.errors import (
    DIVERGED_EXIT_CODE,
    INTERRUPTED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    ConfigError,
    DataError,
    MemoryFitError,
)
from relax_gdn.model import Qwen3_5Options, build_qwen3_5_model, qwen3_5_config, qwen3_5_preset
from relax_gdn.model.fusion import Fusion
from relax_gdn.model.hf_checkpoint import HFCheckpoint, load_hf_checkpoint, run_vocab_size
from relax_gdn.model.lora import seed_base_weights
from relax_gdn.model.mtp import MTPOptions
from relax_gdn.model.recompute import apply_mixed_recompute, mtp_recompute, recompute_config_fields, recomputes
from relax_gdn.parallel import ParallelContext
from relax_gdn.runtime import require_runtime
from relax_gdn.train.agreement import agree_on_errors
from relax_gdn.train.evaluate import EvalSet, Evaluator, split_eval_set
from relax_gdn.train.flops import ModelShape
from relax_gdn.train.gradient_check import parameters_without_gradient, warn_parameters_without_gradient
from relax_gdn.train.lifecycle import DataKey, Layout, RunLifecycle, checkpoint_root
from relax_gdn.train.loggers import RunLoggers, default_run_name, run_tags
from relax_gdn.train.loss import summed_token_losses, training_objective
from relax_gdn.train.memory import GIB, estimate_memory, fewest_full_layers, settings_that_fit
from relax_gdn.train.metrics import HostSyncCounter, MetricsProcessor, OptimizerTimer, StepTimer
from relax_gdn.train.optimizer import CPUGradSyncOptimizer, build_megatron_ddp_and_optimizer, build_scheduler
from relax_gdn.train.planner import MicroBatchPlanner, StepPlan
from relax_gdn.train.stop import StopRequest
from relax_gdn.train.watchdog import StepWatchdog

logger = logging.getLogger("relax_gdn.train")


@dataclass(frozen=True)
class RunStop:
    """Why a run ended before ``train.steps``, alike on every rank."""

    step: int  # the last step run
    why: str  # what a person reads: "SIGTERM", "Ctrl-C", "a non-finite loss or grad norm", ...
    exit_code: int  # relax_gdn.errors: 75 preempted, 130 interrupted, 3 diverged
    checkpoint: Path | None  # rank 0: where the run continues from (saved at the stop, or the last good one)


@dataclass
class TrainResult:
    records: list[dict[str, Any]]  # one per step run here, identical on every rank
    run_dir: Path | None
    checkpoints: list[Path] = field(default_factory=list)
    start_step: int = 0  # steps already done when this run started (resume)
    wandb_dir: str | None = None  # rank 0: the W&B run's files directory, when W&B ran
    preempted_at: int | None = None  # the step after which a stop signal (SIGTERM/SIGUSR1/SIGINT) stopped the run
    stop: RunStop | None = None  # set when the run ended early (a stop signal, a divergence)
    nonfinite_steps: int = 0  # steps whose loss or grad norm was not finite (their updates not applied)
    # trainable parameters the first step of this process left without gradient (train/gradient_check.py)
    params_without_gradient: list[str] = field(default_factory=list)
    # per checkpoint saved: (step, seconds the loop was blocked, seconds until it was complete)
    save_timings: list[tuple[int, float, float]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# setup helpers
# ---------------------------------------------------------------------------------------------


def select_device(cfg: RunConfig) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(["train.device=cuda but CUDA is not available here; use train.device=auto or cpu"])
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        # torchrun sets LOCAL_RANK; a caller that made the process group itself has already
        # chosen this process's GPU with torch.cuda.set_device
        local_rank = os.environ.get("LOCAL_RANK")
        return torch.device("cuda", int(local_rank) if local_rank is not None else torch.cuda.current_device())
    return torch.device("cpu")


def select_bf16(cfg: RunConfig, device: torch.device) -> bool:
    if cfg.train.precision == "bf16" and device.type != "cuda":
        raise ConfigError(["train.precision=bf16 needs CUDA (the CPU path trains in fp32); use "
                           "train.precision=auto or fp32 on CPU"])
    return cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")


@dataclass(frozen=True)
class RunData:
    """A run's data, loaded and checked before any process group or model exists."""

    tokenizer: Any  # relax_gdn.data.SFTTokenizer
    dataset: SFTDataset  # the training set
    eval_set: EvalSet | None  # None: no evaluation


def load_data(cfg: RunConfig) -> RunData:
    """The tokenizer, training set and eval set that ``cfg`` names: errors name the data.* / eval.*
    key to fix."""
    d = cfg.data
    tokenizer = load_tokenizer(None if d.tokenizer in ("embedded", "byte") else d.tokenizer)
    if d.source == "synthetic":
        dataset = synthetic_math_dataset(
            d.num_samples, tokenizer, seed=cfg.train.seed, max_sample_tokens=cfg.sample_token_limit,
            max_steps=d.synthetic_max_steps, min_steps=1,
        )
    else:
        if not d.path or not Path(d.path).exists():
            raise DataError(f"data.path={d.path!r} does not exist (data.source={d.source}); point it at the data "
                            "file or directory")
        dataset = load_sft_dataset(
            d.path, tokenizer, prompt_field=d.prompt_field, response_field=d.response_field,
            max_sample_tokens=cfg.sample_token_limit, max_samples=d.num_samples, format=d.source,
            split=d.split, record_format=d.format,
        )
        if dataset.counts.examples and int(os.environ.get("RANK", "0")) == 0:
            logger.warning("data.path=%s: %s\n  %s", d.path, dataset.counts.summary(),
                           "\n  ".join(dataset.counts.report_lines()))
    dataset, eval_set = split_eval_set(cfg, tokenizer, dataset)
    if len(dataset) < cfg.train.global_batch_size:
        raise DataError(f"the data has {len(dataset)} usable samples ({dataset.counts.summary()}), fewer than "
                         f"train.global_batch_size={cfg.train.global_batch_size}: use more data or a smaller batch")
    check_samples_fit(dataset.samples, cfg)
    if eval_set is not None:
        check_samples_fit(eval_set.samples, cfg)
    return RunData(tokenizer, dataset, eval_set)


def check_samples_fit(samples, cfg: RunConfig) -> None:
    """Every sample must fit one micro-batch at the largest CP size, checked before step 1 (not
    as an error or an OOM at whatever step first draws it). Skipping them instead is the data
    side's job: ``data.max_sample_tokens`` drops and counts them at load time."""
    cp = cfg.parallel.cp  # with dynamic CP, max_cp == cp
    capacity = cfg.train.max_tokens_per_gpu * cp
    too_long = [s for s in samples if padded_length(len(s), cp) > capacity]
    if too_long:
        worst = max(too_long, key=len)
        raise DataError(
            f"{len(too_long)} samples do not fit one micro-batch of train.max_tokens_per_gpu x parallel.cp = "
            f"{cfg.train.max_tokens_per_gpu} x {cp} = {capacity} tokens (e.g. sample {worst.sample_id}: {len(worst)} "
            f"tokens): set data.max_sample_tokens={capacity} to skip them (counted in the run log), or raise "
            "train.max_tokens_per_gpu / parallel.cp"
        )


class ProfileWindow:
    """``logging.profile_steps=[first, last]``: a torch profiler trace per rank over those steps,
    written to ``<trace_dir>/rank<r>_steps<first>-<last>.json`` (layout swaps show up as
    ``relax_gdn.swap`` ranges; host ops with their input shapes)."""

    def __init__(self, steps: list[int] | None, trace_dir: Path | None, rank: int, device: torch.device):
        self.first, self.last = (steps or (0, -1))
        self.trace_dir, self.rank, self.device = trace_dir, rank, device
        self._profiler = None

    def before_step(self, step: int) -> None:
        if step == self.first and self.trace_dir is not None:  # (CPU: the Runtime quieted kineto)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            # record_shapes: each host op's input dims / dtypes / strides in the trace, so a long
            # kernel can be traced to the op and shapes that launched it (bench.train_e2e's
            # top_kernels). Host-side metadata only, no device sync; it costs host time in the
            # profiled steps alone (the profiler is off in the others).
            self._profiler = profile(activities=activities, record_shapes=True)
            self._profiler.__enter__()

    def after_step(self, step: int) -> Path | None:
        if self._profiler is None or step != self.last:
            return None
        self._profiler.__exit__(None, None, None)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"rank{self.rank}_steps{self.first}-{self.last}.json"
        self._profiler.export_chrome_trace(str(path))
        self._profiler = None
        return path


def init_distributed(device: torch.device, timeout_s: float | None = None) -> bool:
    """Join torchrun's group (env://), or make a one-process group; True when created here.
    ``timeout_s``: the group's collective timeout (``train.collective_timeout_s``; None: torch's)."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://", **timeout)
    else:
        # An in-process store: one rank has nobody to meet, so no port to pick (and race for).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **timeout)
    return True


def env_world_size() -> int:
    """World size before any process group exists (what ``validate`` needs)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def device_memory_bytes(device: torch.device) -> int | None:
    """What the memory model checks against: the GPU's total memory (None off CUDA)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def memory_inputs(cfg: RunConfig, dims: ParallelDims, bf16: bool, vocab_size: int) -> tuple[ModelShape, dict]:
    """The model's shape and the run's settings as :func:`~relax_gdn.train.memory.estimate_memory` takes them."""
    shape = ModelShape.from_transformer_config(qwen3_5_config(cfg.model.preset), vocab_size,
                                               mtp_num_layers=cfg.model.mtp.num_layers or 0, lora=cfg.lora_options)
    settings = dict(
        tokens_per_gpu=cfg.train.max_tokens_per_gpu, tp=dims.tp, cp=dims.cp, dp=dims.dp,
        sequence_parallel=cfg.parallel.sp, bf16=bf16, recompute=cfg.recompute.granularity,
        full_layers=cfg.recompute.full_layers or 0, fused_norms=cfg.model.fused_norms,
        fused_cross_entropy=cfg.model.fused_cross_entropy, optimizer=cfg.optim.name,
    )
    return shape, settings


def resolve_full_layers(cfg: RunConfig, dims: ParallelDims, device: torch.device, bf16: bool,
                        vocab_size: int) -> RunConfig:
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


def check_memory_fits(cfg: RunConfig, dims: ParallelDims, device: torch.device, bf16: bool, vocab_size: int,
                      log: bool) -> None:
    """On a GPU: log the per-GPU memory model and refuse (before building the model) a run whose
    estimate exceeds the GPU's memory, naming the settings the model says would fit
    (:class:`~relax_gdn.errors.MemoryFitError`). (A CPU run has no GPU memory to estimate.)"""
    capacity = device_memory_bytes(device)
    if capacity is None:
        return
    shape, settings = memory_inputs(cfg, dims, bf16, vocab_size)
    estimate = estimate_memory(shape, **settings)
    recompute = cfg.recompute.granularity + (f" ({cfg.recompute.full_layers} layers whole)"
                                             if cfg.recompute.granularity == "mixed" else "")
    if log:
        logger.info("memory model (%s, recompute %s, %d tokens/GPU): %s", cfg.model.preset,
                    recompute, cfg.train.max_tokens_per_gpu, estimate.summary())
    if estimate.total > capacity:
        fits = [a.describe() for a in settings_that_fit(shape, capacity, **settings)]
        advice = ("The memory model says these fit: " + "; ".join(fits) if fits else
                  "Nothing the memory model tries fits (other recompute settings, a smaller "
                  "train.max_tokens_per_gpu, no optimizer state, more CP ranks)")
        raise MemoryFitError(
            f"{cfg.model.preset} will not fit this GPU: {estimate.summary()} with recompute {recompute}, above its "
            f"{capacity / GIB:.0f} GiB. {advice} (optim.name=none is for benchmarks: gradients without an update)",
            estimate_gib=estimate.as_gib(), capacity_gib=round(capacity / GIB, 2), fits=fits)


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
    if layers and int(os.environ.get("RANK", "0")) == 0:
        logger.info("model.mtp.num_layers=null: model.hf_checkpoint holds %d MTP layer(s), trained with weight "
                    "model.mtp.loss_weight=%g (model.mtp.num_layers=0 copies them into the export unchanged)",
                    layers, cfg.model.mtp.loss_weight)
    return cfg.with_overrides({"model.mtp.num_layers": layers})


def _broadcast_run_dir(run_dir: Path | None) -> Path | None:
    # Hydra names the run directory from the clock on every rank; rank 0's name wins.
    box = [str(run_dir) if run_dir is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] is not None else None


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------


def run_training(cfg: RunConfig, run_dir: str | Path | None, data=None, *,
                 on_continue: Callable[[Path], None] | None = None) -> TrainResult:
    """Train ``cfg`` (already validated or not: validated again here, before anything is built).

    ``run_dir``: where rank 0 writes ``config.yaml``, ``metrics.jsonl`` and (by default) the
    checkpoints; None writes nothing (no JSONL, no checkpoints unless ``checkpoint.dir``).
    Uses the initialized default process group, else makes a one-process one. It needs an installed
    :class:`relax_gdn.runtime.Runtime` (the entry points install one). ``data``: a prepared
    ``(tokenizer, SFTDataset)`` pair (benchmarks with a length distribution of their own) instead of
    what ``cfg.data`` names. ``on_continue``: called on rank 0 with the run directory a resumed run
    continues when it is not ``run_dir`` (``train.py`` moves Hydra's job log there).
    """
    dims = validate(cfg, env_world_size())
    resolved = resolve_mtp_layers(cfg)
    if resolved is not cfg:  # again: the MTP layer a checkpoint brings has rules of its own
        dims = validate(resolved, env_world_size())
    cfg = resolved
    device = select_device(cfg)
    bf16 = select_bf16(cfg, device)
    # the entry point's Runtime owns the process-wide changes (on CPU: Megatron-Core's shims)
    cpu = device.type == "cpu"
    require_runtime("training on CPU" if cpu else "training on CUDA", cpu_shims=cpu)

    trainer = Trainer(cfg, Path(run_dir) if run_dir is not None else None, dims=dims, device=device, bf16=bf16,
                      data=data, on_continue=on_continue)
    try:
        trainer.setup()
        return trainer.run()
    finally:
        trainer.close()


def load_run_data(cfg: RunConfig, data=None) -> RunData:
    """What ``cfg.data`` names (:func:`load_data`), or the prepared ``(tokenizer, SFTDataset)`` pair
    ``data`` after checking that its samples fit."""
    if data is None:
        return load_data(cfg)
    run_data = RunData(*data, eval_set=None)
    check_samples_fit(run_data.dataset.samples, cfg)
    return run_data


def _build_model(cfg: RunConfig, dims: ParallelDims, device: torch.device, bf16: bool, vocab_size: int):
    fuse_wgrad = False
    if cfg.model.fused_grad_accumulation and device.type == "cuda":
        from relax_gdn.compat.wgrad import enable_wgrad_accumulation_fusion

        fuse_wgrad, undo = enable_wgrad_accumulation_fusion()
        require_runtime("the fused wgrad GEMM").adopt(undo)  # Megatron-Core patched: the Runtime undoes it

    tconfig = qwen3_5_config(
        cfg.model.preset,
        tensor_model_parallel_size=dims.tp,
        sequence_parallel=cfg.parallel.sp,
        use_cpu_initialization=device.type == "cpu",
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        deterministic_mode=cfg.train.deterministic,
        calculate_per_token_loss=True,  # DDP sums gradients; the loss is already per global token
        bias_activation_fusion=cfg.model.fused_swiglu and device.type == "cuda",  # compiled SwiGLU kernels
        gradient_accumulation_fusion=fuse_wgrad,
        **recompute_config_fields(cfg.recompute.granularity, cfg.recompute.modules,
                                  skip_unused=cfg.recompute.skip_unused,
                                  num_layers=qwen3_5_preset(cfg.model.preset).config["num_layers"],
                                  full_layers=cfg.recompute.full_layers),
    )
    options = Qwen3_5Options.for_preset(
        cfg.model.preset, vocab_size=vocab_size, gdn=cfg.gdn_options,
        attention_backend=cfg.model.attention_backend, spec_provider=cfg.model.spec_provider,
        contiguous_between_layers=cfg.gdn.contiguous_between_layers,
        fusion=Fusion(norms=cfg.model.fused_norms, cross_entropy=cfg.model.fused_cross_entropy,
                      embedding_grad_into_main_grad=cfg.model.fused_grad_accumulation),
        recompute_mlp_activation=recomputes(cfg.recompute.granularity, cfg.recompute.modules, "mlp_act"),
        recompute_skips_unread_gemm=cfg.recompute.skip_unused,  # acts under full recompute only
        mtp=MTPOptions(cfg.model.mtp.num_layers or 0, **mtp_recompute(cfg.recompute.granularity, cfg.recompute.modules,
                                                                     skip_unused=cfg.recompute.skip_unused)),
        lora=cfg.lora_options,
    )
    model = build_qwen3_5_model(tconfig, options)
    if cfg.recompute.granularity == "mixed":
        apply_mixed_recompute(model, cfg.recompute.full_layers, cfg.recompute.modules)
    if device.type == "cuda":
        model.cuda(device)
    load_base_weights(model, cfg)
    return tconfig, model


def load_base_weights(model, cfg: RunConfig) -> None:
    """The weights ``model`` starts from besides its initialisation: ``model.hf_checkpoint``'s, or
    with ``model.lora`` and no checkpoint the seeded base (the same at every TP size: a LoRA
    checkpoint holds only the adapters, and the base is rebuilt from what its manifest names)."""
    if cfg.model.hf_checkpoint:
        loaded = load_hf_checkpoint(model, cfg.model.hf_checkpoint)
        mtp_layers = cfg.model.mtp.num_layers or 0
        if mtp_layers and not loaded.mtp_num_layers and dist.get_rank() == 0:
            logger.warning("model.mtp.num_layers=%d but model.hf_checkpoint has no MTP layer (mtp.*): the MTP layer "
                           "starts from random weights (its loss starts near log(vocabulary))", mtp_layers)
    elif cfg.lora_options is not None:
        seed_base_weights(model, cfg.train.seed)


def _vocab_size(cfg: RunConfig, tokenizer, tp: int) -> int:
    if cfg.model.hf_checkpoint:  # the checkpoint's (its other sizes checked against the preset)
        return run_vocab_size(cfg.model.hf_checkpoint, cfg.model.preset, tokenizer.vocab_size, tp)
    # Megatron pads to a multiple of 128 x TP; padding to 128 x 8 instead gives every TP <= 8 the
    # SAME padded vocabulary, so a checkpoint written at one TP loads at another (the embedding and
    # output layer keep their global shape). The initial values still differ between TP sizes:
    # Megatron-Core initialises each TP shard from its own RNG stream.
    multiple = 128 * max(8, tp)
    return -(-tokenizer.vocab_size // multiple) * multiple


class StepFlag(Enum):
    """A condition one rank raises for the step, carried by the step's one all-reduce: raised on
    any rank, it is raised on every rank in that same step, so all ranks decide alike. Each member
    is one slot of the reduced vector, after the loss, in the order defined here."""

    STOP_REQUESTED = auto()  # SIGTERM / SIGUSR1 reached this rank: save and stop after this step (exit 75)
    INTERRUPTED = auto()  # Ctrl-C (SIGINT) reached this rank: save and stop after this step (exit 130)


@dataclass(frozen=True)
class StepTotals:
    """What the step's one all-reduce gives every rank alike."""

    loss_sum: float  # Σ per-token loss × loss mask over the global batch
    flags: frozenset[StepFlag]  # raised on at least one rank
    mtp_loss_sum: float | None = None  # the MTP layer's Σ per-token loss × its loss mask; None without MTP


def all_reduce_step(loss_sums: torch.Tensor, raised: set[StepFlag], tp: int) -> StepTotals:
    """The step's one collective and one host read: the losses summed over DP × CP (``loss_sums``:
    the LM's, then the MTP layer's when it trains; TP ranks hold the same values, hence / tp) and
    every rank's :class:`StepFlag` s. The read waits for the device, so it ends the timed step."""
    losses = loss_sums.reshape(-1)
    flags = torch.tensor([float(flag in raised) for flag in StepFlag], device=losses.device)
    stats = torch.cat((losses / tp, flags))
    dist.all_reduce(stats)
    values = stats.tolist()
    loss_totals, flag_totals = values[:losses.numel()], values[losses.numel():]
    return StepTotals(loss_totals[0], frozenset(flag for flag, total in zip(StepFlag, flag_totals) if total),
                      mtp_loss_sum=loss_totals[1] if len(loss_totals) > 1 else None)


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did and what the run does after it, alike on every rank."""

    record: dict[str, Any]  # the step's metrics (run() adds the evaluation when due)
    updated: bool  # the optimizer applied the update (optim.name=none measures gradients only)
    stop_code: int | None = None  # a rank was asked to stop: save, end the run after this step with this code
    nonfinite: bool = False  # the loss or grad norm was not finite: the update was not applied
    diverged: bool = False  # train.on_nonfinite ends the run here, saving nothing

    @property
    def stop(self) -> bool:
        return self.stop_code is not None


def stop_exit_code(flags: frozenset[StepFlag]) -> int | None:
    """The exit code a stop request raised on any rank ends the run with: 75 for SIGTERM / SIGUSR1
    (a job script requeues it) over 130 for Ctrl-C; None without one."""
    if StepFlag.STOP_REQUESTED in flags:
        return PREEMPTED_EXIT_CODE
    return INTERRUPTED_EXIT_CODE if StepFlag.INTERRUPTED in flags else None


class Trainer:
    """One training run in this process: :meth:`setup`, :meth:`run` (which calls
    :meth:`train_step` once per optimizer step), :meth:`close`. See the module docstring."""

    # what setup() builds
    rank: int  # global rank
    is_rank0: bool  # the rank that logs and writes the run directory
    parallel: ParallelContext
    tconfig: Any  # Megatron-Core TransformerConfig
    model: torch.nn.Module  # what runs forward/backward (on CUDA: wrapped in DDP, bf16 wrapper)
    core_model: torch.nn.Module  # the model itself: what checkpoints and exports read
    optimizer: Any  # gradient sync + clipping + update (relax_gdn.train.optimizer)
    scheduler: Any
    vocab_size: int
    lifecycle: RunLifecycle
    start_step: int  # steps already done (a resumed run)
    planner: MicroBatchPlanner
    evaluator: Evaluator
    metrics: MetricsProcessor
    profile_window: ProfileWindow
    host_syncs: HostSyncCounter
    data: RunData  # the tokenizer, training set and eval set, loaded and checked (every rank agreeing)

    def __init__(self, cfg: RunConfig, run_dir: Path | None, *, dims: ParallelDims, device: torch.device, bf16: bool,
                 data=None, on_continue: Callable[[Path], None] | None = None):
        """Args:
            cfg: the validated run configuration.
            run_dir: rank 0's run directory (rank 0's name is broadcast in setup); None: none.
            dims: the parallel sizes ``validate`` derived (world, dp, cp, tp).
            device: where this rank trains (``select_device``).
            bf16: bf16 parameters and compute (``select_bf16``); else fp32.
            data: a prepared ``(tokenizer, SFTDataset)`` pair instead of what ``cfg.data`` names
                (:func:`load_run_data`, called in setup).
            on_continue: rank 0 calls it with the run directory a resumed run continues, when that
                is not ``run_dir``.
        """
        self.cfg, self.run_dir, self.dims, self.device, self.bf16 = cfg, run_dir, dims, device, bf16
        self._given_data = data
        self.on_continue = on_continue
        self.nonfinite_in_a_row = 0  # decided in _outcome, alike on every rank
        self.nonfinite_steps = 0
        self.params_without_gradient: list[str] = []  # after the first step (train_step)
        # what close() releases, set as setup() gets to it
        self.created_group = False
        self.loggers: RunLoggers | None = None
        self.stop: StopRequest | None = None
        self.watchdog: StepWatchdog | None = None

    # ----------------------------------------------------------------------------- setup

    def setup(self) -> None:
        """Everything before step 1, in this order (a collective): stop signals handled, process
        groups, the data (a problem on any rank stops every rank), model and optimizer, checkpoint
        and run directory, loggers, planner, evaluator, metrics, the step watchdog."""
        cfg, device = self.cfg, self.device
        self.stop = StopRequest(require_runtime("stop signals"), rank=int(os.environ.get("RANK", "0")),
                                checkpoints=checkpoint_root(cfg, self.run_dir), resume=cfg.checkpoint.resume)
        self._init_process_groups()
        self.data = agree_on_errors(lambda: load_run_data(cfg, self._given_data))
        self._build_model_and_optimizer()
        self._start_lifecycle()
        self._log_run()
        self._start_loggers()
        self.planner = MicroBatchPlanner(self.parallel, max_tokens_per_gpu=cfg.train.max_tokens_per_gpu, device=device,
                                         pad_id=self.data.tokenizer.pad_id, route_strategy=cfg.gdn.route,
                                         mtp=bool(cfg.model.mtp.num_layers))
        # the eval set packed exactly like a training global batch
        self.evaluator = Evaluator(self.data.eval_set, cfg.eval.every_steps, cfg.train.steps, tp=self.dims.tp,
                                   device=device, micro_batches=self.planner.micro_batches)
        shape = ModelShape.from_transformer_config(self.tconfig, self.vocab_size,
                                                   mtp_num_layers=cfg.model.mtp.num_layers or 0, lora=cfg.lora_options)
        self.metrics = MetricsProcessor(shape, self.dims.world_size, device)
        self.watchdog = StepWatchdog(cfg.train.hang_timeout_s, rank=self.rank, world_size=self.dims.world_size,
                                     dump_dir=self.run_dir / "hang" if self.run_dir is not None else None)
        trace_root = self.run_dir / "traces" if self.run_dir is not None else None  # no run directory: no traces
        self.profile_window = ProfileWindow(cfg.logging.profile_steps, trace_root, self.rank, device)
        # in forward + backward only (logging.count_host_syncs)
        self.host_syncs = HostSyncCounter(enabled=device.type == "cuda" and cfg.logging.count_host_syncs)

    def _init_process_groups(self) -> None:
        cfg, device = self.cfg, self.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.created_group = init_distributed(device, timeout_s=cfg.train.collective_timeout_s)
        self.rank = dist.get_rank()
        self.is_rank0 = self.rank == 0
        self.run_dir = _broadcast_run_dir(self.run_dir)
        if cfg.train.deterministic:  # process-wide: the Runtime puts torch's setting back when it closes
            require_runtime("train.deterministic").use_deterministic_algorithms(warn_only=True)
        seed_everything(cfg.train.seed)
        dynamic = cfg.parallel.dynamic_cp
        self.parallel = ParallelContext.initialize(tp=self.dims.tp, cp=self.dims.cp,
                                                   dynamic_max_cp=dynamic.max_cp if dynamic.enabled else None,
                                                   timeout=timedelta(seconds=cfg.train.collective_timeout_s))
        if device.type == "cuda":
            model_parallel_cuda_manual_seed(cfg.train.seed)

    def _build_model_and_optimizer(self) -> None:
        device, bf16 = self.device, self.bf16
        # a problem on any rank (a checkpoint file one node lacks) stops every rank here, before DDP
        self.tconfig, model = agree_on_errors(self._checked_model)
        cfg = self.cfg
        self.core_model = model
        if device.type == "cuda":
            if bf16:  # as Megatron's get_model: bf16 params, fp32 outputs (the per-token loss)
                model = Float16Module(self.tconfig, model)
            model, self.optimizer = build_megatron_ddp_and_optimizer(model, self.tconfig, cfg, bf16=bf16)
            model.broadcast_params()  # every DP replica starts from rank 0's weights
        else:
            self.optimizer = CPUGradSyncOptimizer(model, cfg, dp_cp_group=self.parallel.dp_cp_group,
                                                  tp_group=self.parallel.tp_group, sequence_parallel=cfg.parallel.sp)
        self.model = model
        self.scheduler = build_scheduler(self.optimizer, cfg, log=self.is_rank0)

    def _checked_model(self):
        """The vocabulary size, the resolved recompute layers, the memory check, then the model
        (Megatron-Core's TransformerConfig and module): nothing here is a collective."""
        cfg, dims, device, bf16 = self.cfg, self.dims, self.device, self.bf16
        self.vocab_size = _vocab_size(cfg, self.data.tokenizer, dims.tp)
        # mixed recompute without a layer count: the memory model's choice, kept in the run's config
        self.cfg = cfg = resolve_full_layers(cfg, dims, device, bf16, self.vocab_size)
        check_memory_fits(cfg, dims, device, bf16, self.vocab_size, log=self.is_rank0)
        return _build_model(cfg, dims, device, bf16, self.vocab_size)

    def _start_lifecycle(self) -> None:
        """checkpoint.dir checked, checkpoint loaded (any layout), run directory of a resumed run."""
        cfg, dims = self.cfg, self.dims
        self.lifecycle = RunLifecycle.start(
            cfg, run_dir=self.run_dir, model=self.core_model, optimizer=self.optimizer, scheduler=self.scheduler,
            vocab_size=self.vocab_size,
            layout=Layout(dims.world_size, dims.tp, dims.cp, cfg.parallel.dynamic_cp.enabled, cfg.effective_max_cp),
            data_key=DataKey(cfg.train.seed, cfg.train.global_batch_size, len(self.data.dataset)),
            tokenizer_vocab_size=self.data.tokenizer.vocab_size, device=self.device,
            dp_cp_group=self.parallel.dp_cp_group)
        continued = self.lifecycle.run_dir
        if self.is_rank0 and self.on_continue is not None and continued not in (None, self.run_dir):
            self.on_continue(continued)
        self.start_step, self.run_dir = self.lifecycle.start_step, continued

    def _start_loggers(self) -> None:
        """config.yaml in the run directory; console, JSONL and W&B loggers (a resumed run appends).
        A finished run (resumed at train.steps) leaves its directory and W&B run as they are."""
        if self.lifecycle.complete:
            self.loggers = RunLoggers([])
            return
        cfg, dims, dataset = self.cfg, self.dims, self.data.dataset
        derived = {"world_size": dims.world_size, "dp": dims.dp, "device": str(self.device), "bf16": self.bf16,
                   "vocab_size": self.vocab_size, "run_name": default_run_name(cfg), "tags": run_tags(cfg),
                   "num_samples": len(dataset), "data_skips": dataset.counts.as_dict()}
        if self.is_rank0 and self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_run_config(cfg, self.run_dir)
        self.loggers = RunLoggers.create(cfg, self.run_dir, is_rank0=self.is_rank0,
                                         config_dict={**cfg.to_dict(), "derived": derived},
                                         start_step=self.start_step, append=self.lifecycle.resumed is not None,
                                         wandb_run_id=self.lifecycle.wandb_run_id)
        self.lifecycle.wandb_run_id = self.loggers.wandb_run_id()  # saved in checkpoints: a resume continues it

    def _log_run(self) -> None:
        if not self.is_rank0 or self.lifecycle.complete:
            return
        cfg, dims, dataset, eval_set = self.cfg, self.dims, self.data.dataset, self.data.eval_set
        n_params = sum(p.numel() for p in self.core_model.parameters())
        n_trained = sum(p.numel() for p in self.core_model.parameters() if p.requires_grad)
        params = f"{n_params:,} params/rank" + (f" ({n_trained:,} train: LoRA adapters)" if n_trained < n_params else "")
        logger.info("run %s: world %d = dp %d x cp %d x tp %d on %s (%s); %s; %d samples (%s)",
                    default_run_name(cfg), dims.world_size, dims.dp, dims.cp, dims.tp, self.device,
                    "bf16" if self.bf16 else "fp32", params, len(dataset), dataset.counts.summary())
        if eval_set is not None and cfg.eval.every_steps:
            logger.info("evaluation every %d steps on %d samples from %s", cfg.eval.every_steps,
                        len(eval_set.samples), eval_set.source)

    # ----------------------------------------------------------------------------- one step

    def train_step(self, step: int) -> StepOutcome:
        """Optimizer step ``step`` (1-based) over this rank's micro-batches of the step's global batch;
        a collective. Plan, build, forward + backward, optimizer step, the step's one all-reduce,
        the record, the outcome."""
        cfg = self.cfg
        timer = StepTimer()
        epoch, batch = global_batch_at_step(self.data.dataset.samples, cfg.train.global_batch_size, cfg.train.seed,
                                            step - 1)
        plan = self.planner.plan(batch)
        loss_tokens = sum(s.num_loss_tokens for s in batch)
        mtp_loss_tokens = sum(s.num_mtp_loss_tokens for s in batch) if self.planner.mtp else 0
        self.optimizer.zero_grad()
        self.scheduler.step(1)  # the rate of THIS step (see build_scheduler)
        lr = float(self.optimizer.param_groups[0]["lr"])
        loss_sums = self._forward_backward(plan, loss_tokens, mtp_loss_tokens)
        optimizer_timer = OptimizerTimer(self.device)
        updated, grad_norm = self.optimizer.step()
        optimizer_timer.stop()
        totals = all_reduce_step(loss_sums, self._raised_flags(), self.dims.tp)
        step_time = timer.elapsed()
        record = self.metrics.record(
            step=step, loss=totals.loss_sum / max(loss_tokens, 1), grad_norm=grad_norm, lr=lr,
            seq_lengths=[len(s) for s in batch], loss_tokens=loss_tokens, padded_tokens=plan.padded_tokens,
            num_micro_batches=len(plan.micro_batches), epoch=epoch, step_time_s=step_time,
            host_syncs=self.host_syncs.count if self.host_syncs.enabled else None,
        ).as_dict()
        record["optimizer_time_s"] = optimizer_timer.seconds()  # the step's host read has waited
        if totals.mtp_loss_sum is not None:  # the MTP layer's loss, apart from the LM's (train/loss.py)
            record["mtp_loss"] = totals.mtp_loss_sum / max(mtp_loss_tokens, 1)
        if plan.cp_size_counts is not None:
            record["cp_sizes"] = plan.cp_size_counts  # micro-batches per CP size, whole step
        self._log_host_syncs(step)
        if step == self.start_step + 1:  # once per process: what the first backward left without gradient
            self.params_without_gradient = parameters_without_gradient(self.core_model, self.device)
            if self.is_rank0:
                warn_parameters_without_gradient(self.params_without_gradient, step)
        return self._outcome(record, totals, updated=updated, grad_norm=grad_norm)

    def _forward_backward(self, plan: StepPlan, loss_tokens: int, mtp_loss_tokens: int) -> torch.Tensor:
        """Gradients of the global batch's objective (train/loss.py) accumulated over this rank's
        micro-batches; returns this rank's summed per-token losses, ``[LM]`` or ``[LM, MTP]`` (on
        the device, not yet reduced over ranks)."""
        loss_sums = torch.zeros(1 + bool(self.planner.mtp), dtype=torch.float32, device=self.device)
        weight = self.cfg.model.mtp.loss_weight
        self.host_syncs.reset()
        # every micro-batch built (and its upload queued) before the first forward: the host's
        # packing never stands between one micro-batch's backward and the next forward
        for mb in [self.planner.build(planned) for planned in plan.micro_batches]:
            with self.host_syncs:
                sums = summed_token_losses(self.model, mb)
                training_objective(sums, loss_tokens, mtp_loss_tokens, weight).backward()
            loss_sums += sums.detach()
        return loss_sums

    def _raised_flags(self) -> set[StepFlag]:
        """This rank's :class:`StepFlag` s for the step's all-reduce."""
        flags = {StepFlag.STOP_REQUESTED} if self.stop.preempted_by is not None else set()
        return flags | ({StepFlag.INTERRUPTED} if self.stop.interrupted else set())

    def _outcome(self, record: dict[str, Any], totals: StepTotals, *, updated: bool,
                 grad_norm: float | None) -> StepOutcome:
        """The one place a step's outcome is decided. From all-reduced values only (the loss sum,
        the flags, the grad norm the optimizer reduced), so every rank takes the same decision in
        the same step: a stop request, and a loss or grad norm that is not finite (its update was
        not applied; ``train.on_nonfinite`` says whether the run ends here)."""
        nonfinite = not math.isfinite(totals.loss_sum) or (grad_norm is not None and not math.isfinite(grad_norm))
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if nonfinite else 0
        self.nonfinite_steps += nonfinite
        record["nonfinite"], record["nonfinite_steps"] = nonfinite, self.nonfinite_steps
        train = self.cfg.train
        diverged = nonfinite and (train.on_nonfinite == "stop" or self.nonfinite_in_a_row >= train.max_nonfinite_steps)
        return StepOutcome(record=record, updated=updated and not nonfinite, stop_code=stop_exit_code(totals.flags),
                           nonfinite=nonfinite, diverged=diverged)

    def _log_host_syncs(self, step: int) -> None:
        if self.host_syncs.count and self.is_rank0 and step <= self.start_step + 2:  # where (first steps only)
            logger.info("step %d: %d host syncs in forward+backward, at %s", step, self.host_syncs.count,
                        dict(self.host_syncs.locations.most_common(8)))

    # ----------------------------------------------------------------------------- the loop

    def run(self) -> TrainResult:
        """Steps ``start_step + 1 .. train.steps``, each followed by its evaluation when due, its log
        record, the profiler window and its checkpoint when due (none after a non-finite step);
        ends early after a step in which a rank was asked to stop (saved), or one that
        ``train.on_nonfinite`` ends the run at (nothing saved). Then waits for a background save and
        exports when the run completed."""
        cfg = self.cfg
        result = TrainResult(records=[], run_dir=self.run_dir, checkpoints=self.lifecycle.saved,
                             start_step=self.start_step,
                             save_timings=self.lifecycle.saver.timings if self.lifecycle.saver else [])
        self.model.train()
        self.watchdog.start()
        ended: tuple[int, StepOutcome, Path | None] | None = None
        for step in range(self.start_step + 1, cfg.train.steps + 1):
            self.stop.step = step
            outcome, saved = self._step_and_save(step, result)
            if outcome.diverged or (outcome.stop and step != cfg.train.steps):
                ended = (step, outcome, saved)
                break
        self.watchdog.close()
        result.nonfinite_steps = self.nonfinite_steps
        result.params_without_gradient = self.params_without_gradient
        self.lifecycle.finish(completed=ended is None, model=self.core_model)
        if ended is not None:
            result.stop = self._report_end(*ended)
            result.preempted_at = None if ended[1].diverged else ended[0]
        wandb = self.loggers.wandb()
        result.wandb_dir = wandb.run_dir if wandb is not None else None
        return result

    def _step_and_save(self, step: int, result: TrainResult) -> tuple[StepOutcome, Path | None]:
        """One step, its record logged, the profiler window, the checkpoint when due; a stop asked
        for while the checkpoint was written stops the run after it (the returned outcome says so)."""
        self.profile_window.before_step(step)
        outcome = self.train_step(step)
        self.watchdog.progress(step, outcome.record["step_time_s"])
        record = self._logged_record(step, outcome)
        result.records.append(record)
        self.loggers.log(record)
        trace = self.profile_window.after_step(step)
        if trace is not None and self.is_rank0:
            logger.info("profiler traces of steps %s written to %s", self.cfg.logging.profile_steps, trace.parent)
        if outcome.diverged:
            return outcome, None
        saved = self.lifecycle.after_step(step, stop_requested=outcome.stop, nonfinite=outcome.nonfinite,
                                          model=self.core_model, optimizer=self.optimizer, scheduler=self.scheduler)
        self.watchdog.progress()
        if saved is not None and not outcome.stop:  # a signal that came during the save: agreed, stop now
            flags = all_reduce_step(torch.zeros((), device=self.device), self._raised_flags(), self.dims.tp).flags
            outcome = dataclasses.replace(outcome, stop_code=stop_exit_code(flags))
        return outcome, saved

    def _logged_record(self, step: int, outcome: StepOutcome) -> dict[str, Any]:
        """The step's record as logged: the evaluation when due (after the step's timing: evaluation
        is not in tok/s) and whether the update was skipped."""
        record = dict(outcome.record)
        if self.evaluator.due(step) and not outcome.nonfinite:
            record.update(self.evaluator.run(self.model))
        if not outcome.updated:
            record["skipped_update"] = True
        return record

    def _report_end(self, step: int, outcome: StepOutcome, saved: Path | None) -> RunStop:
        """The one line rank 0 says about a run that ended before ``train.steps``, and what it ended
        with (after the background save, so the checkpoint named is complete)."""
        if outcome.diverged:
            return self._report_divergence(step, outcome.record)
        code = outcome.stop_code
        why = ("Ctrl-C" if code == INTERRUPTED_EXIT_CODE else
               self.stop.preempted_by or "SIGTERM/SIGUSR1 on another rank")
        checkpoint = saved if saved is not None else self.lifecycle.last_checkpoint()
        if self.is_rank0:
            what = "preempted" if code == PREEMPTED_EXIT_CODE else "stopped"
            if saved is not None:
                where = f"checkpoint {saved}"
            elif outcome.nonfinite:
                where = (f"not saved: the step was not finite; the last good checkpoint is {checkpoint}"
                         if checkpoint else "not saved: the step was not finite, and there is no earlier checkpoint")
            else:
                where = "without a checkpoint (no run directory or checkpoint.dir)"
            logger.warning("%s after step %d (%s), %s; %s; exiting with %d", what, step, why, where,
                           self._how_to_continue(checkpoint), code)
        return RunStop(step=step, why=why, exit_code=code, checkpoint=checkpoint)

    def _how_to_continue(self, checkpoint: Path | None) -> str:
        if checkpoint is None:
            return "nothing to continue from"
        if self.cfg.checkpoint.resume == "auto":
            return "the same command continues from it"
        return f"continue with checkpoint.resume={checkpoint}"

    def _report_divergence(self, step: int, record: dict[str, Any]) -> RunStop:
        """``train.on_nonfinite`` ended the run at ``step``: nothing saved from this state."""
        train, checkpoint = self.cfg.train, self.lifecycle.last_checkpoint()
        if self.is_rank0:
            rule = ("train.on_nonfinite=stop" if train.on_nonfinite == "stop" else
                    f"{self.nonfinite_in_a_row} in a row, train.max_nonfinite_steps={train.max_nonfinite_steps}")
            last = (f"the last good checkpoint is {checkpoint}" if checkpoint is not None
                    else "no checkpoint was saved before it")
            logger.error("step %d: loss %s, grad norm %s: not finite (%s); its update was not applied and nothing "
                         "was saved; %s; %s (lower optim.lr, or train.on_nonfinite=skip to step over such "
                         "batches); exiting with %d", step, record["loss"], record["grad_norm"], rule, last,
                         self._how_to_continue(checkpoint), DIVERGED_EXIT_CODE)
        return RunStop(step=step, why="a non-finite loss or grad norm", exit_code=DIVERGED_EXIT_CODE,
                       checkpoint=checkpoint)

    def close(self) -> None:
        """Release what setup() made, also after a setup or a step that failed part way: signal
        handlers, the watchdog, loggers, the model-parallel groups, and the default group when
        made here."""
        if self.watchdog is not None:
            self.watchdog.close()
        if self.stop is not None:
            self.stop.restore()
        if self.loggers is not None:
            self.loggers.close()
        ParallelContext.destroy()
        if self.created_group and dist.is_initialized():
            dist.destroy_process_group()
