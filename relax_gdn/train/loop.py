"""The training loop: :func:`run_training` (the entry point) runs a :class:`Trainer`.

:func:`run_training` validates the config (nothing built yet), picks the device and loads +
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
   record and the step's :class:`StepOutcome` (decided in one place, alike on every rank);
3. :meth:`Trainer.run`: the steps, each followed by its evaluation when due, logging, the profiler
   window, the checkpoint when due, and the stop a rank asked for (SIGTERM/SIGUSR1); then the
   background save is awaited and the Hugging Face export written;
4. :meth:`Trainer.close`: signal handlers, loggers and process groups released (also after an
   error).

Loss normalisation: every loss token of the global batch counts once across CP and DP. The
count is known on every rank without a collective: the global batch and its split are computed
identically on all ranks (``relax_gdn.data``), so it is ``Σ sample.num_loss_tokens`` over the
global batch. Gradients are then SUMMED over DP × CP (Megatron's ``calculate_per_token_loss``).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from dataclasses import dataclass, field
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
from relax_gdn.errors import ConfigError, DataError, MemoryFitError
from relax_gdn.model import Qwen3_5Options, build_qwen3_5_model, qwen3_5_config, qwen3_5_preset
from relax_gdn.model.fusion import Fusion
from relax_gdn.model.hf_checkpoint import load_hf_checkpoint, run_vocab_size
from relax_gdn.model.lora import seed_base_weights
from relax_gdn.model.recompute import apply_mixed_recompute, recompute_config_fields, recomputes
from relax_gdn.parallel import ParallelContext
from relax_gdn.runtime import require_runtime
from relax_gdn.train.evaluate import EvalSet, Evaluator, split_eval_set
from relax_gdn.train.flops import ModelShape
from relax_gdn.train.lifecycle import DataKey, Layout, RunLifecycle
from relax_gdn.train.loggers import RunLoggers, default_run_name, run_tags
from relax_gdn.train.loss import summed_token_loss
from relax_gdn.train.memory import GIB, estimate_memory, fewest_full_layers, settings_that_fit
from relax_gdn.train.metrics import HostSyncCounter, MetricsProcessor, OptimizerTimer, StepTimer
from relax_gdn.train.optimizer import CPUGradSyncOptimizer, build_megatron_ddp_and_optimizer, build_scheduler
from relax_gdn.train.planner import MicroBatchPlanner, StepPlan

logger = logging.getLogger("relax_gdn.train")


@dataclass
class TrainResult:
    records: list[dict[str, Any]]  # one per step run here, identical on every rank
    run_dir: Path | None
    checkpoints: list[Path] = field(default_factory=list)
    start_step: int = 0  # steps already done when this run started (resume)
    wandb_dir: str | None = None  # rank 0: the W&B run's files directory, when W&B ran
    preempted_at: int | None = None  # the step after which SIGTERM/SIGUSR1 stopped the run
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


class PreemptionRequest:
    """SIGTERM / SIGUSR1 (SLURM preemption, ``scancel --signal``) ask for a checkpoint and a clean
    exit after the current step; the handlers only set a flag, the loop acts on it."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class ProfileWindow:
    """``logging.profile_steps=[first, last]``: a torch profiler trace per rank over those steps,
    written to ``<trace_dir>/rank<r>_steps<first>-<last>.json`` (layout swaps show up as
    ``relax_gdn.swap`` ranges)."""

    def __init__(self, steps: list[int] | None, trace_dir: Path | None, rank: int, device: torch.device):
        self.first, self.last = (steps or (0, -1))
        self.trace_dir, self.rank, self.device = trace_dir, rank, device
        self._profiler = None

    def before_step(self, step: int) -> None:
        if step == self.first and self.trace_dir is not None:  # (CPU: the Runtime quieted kineto)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._profiler = profile(activities=activities)
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


def init_distributed(device: torch.device) -> bool:
    """Join torchrun's group (env://), or make a one-process group; True when created here."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://")
    else:
        # An in-process store: one rank has nobody to meet, so no port to pick (and race for).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
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
    shape = ModelShape.from_transformer_config(qwen3_5_config(cfg.model.preset), vocab_size, cfg.lora_options)
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


def _broadcast_run_dir(run_dir: Path | None) -> Path | None:
    # Hydra names the run directory from the clock on every rank; rank 0's name wins.
    box = [str(run_dir) if run_dir is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] is not None else None


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------


def run_training(cfg: RunConfig, run_dir: str | Path | None, data=None) -> TrainResult:
    """Train ``cfg`` (already validated or not: validated again here, before anything is built).

    ``run_dir``: where rank 0 writes ``config.yaml``, ``metrics.jsonl`` and (by default) the
    checkpoints; None writes nothing (no JSONL, no checkpoints unless ``checkpoint.dir``).
    Uses the initialized default process group, else makes a one-process one. It needs an installed
    :class:`relax_gdn.runtime.Runtime` (the entry points install one). ``data``: a prepared
    ``(tokenizer, SFTDataset)`` pair (benchmarks with a length distribution of their own) instead of
    what ``cfg.data`` names.
    """
    dims = validate(cfg, env_world_size())
    device = select_device(cfg)
    bf16 = select_bf16(cfg, device)
    if data is None:
        run_data = load_data(cfg)
    else:
        run_data = RunData(*data, eval_set=None)
        check_samples_fit(run_data.dataset.samples, cfg)
    # the entry point's Runtime owns the process-wide changes (on CPU: Megatron-Core's shims)
    cpu = device.type == "cpu"
    require_runtime("training on CPU" if cpu else "training on CUDA", cpu_shims=cpu)

    trainer = Trainer(cfg, Path(run_dir) if run_dir is not None else None, dims=dims, device=device, bf16=bf16,
                      data=run_data)
    try:
        trainer.setup()
        return trainer.run()
    finally:
        trainer.close()


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
        load_hf_checkpoint(model, cfg.model.hf_checkpoint)
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

    STOP_REQUESTED = auto()  # SIGTERM / SIGUSR1 reached this rank: save and stop after this step


@dataclass(frozen=True)
class StepTotals:
    """What the step's one all-reduce gives every rank alike."""

    loss_sum: float  # Σ per-token loss × loss mask over the global batch
    flags: frozenset[StepFlag]  # raised on at least one rank


def all_reduce_step(loss_sum: torch.Tensor, raised: set[StepFlag], tp: int) -> StepTotals:
    """The step's one collective and one host read: the loss summed over DP × CP (TP ranks hold the
    same value, hence / tp) and every rank's :class:`StepFlag` s. The read waits for the device, so
    it ends the timed step."""
    flags = torch.tensor([float(flag in raised) for flag in StepFlag], device=loss_sum.device)
    stats = torch.cat(((loss_sum / tp).reshape(1), flags))
    dist.all_reduce(stats)
    loss_total, *flag_totals = stats.tolist()
    return StepTotals(loss_total, frozenset(flag for flag, total in zip(StepFlag, flag_totals) if total))


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did and what the run does after it, alike on every rank."""

    record: dict[str, Any]  # the step's metrics (run() adds the evaluation when due)
    updated: bool  # the optimizer applied the update (optim.name=none measures gradients only)
    stop: bool  # a rank was asked to stop: save and end the run after this step


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

    def __init__(self, cfg: RunConfig, run_dir: Path | None, *, dims: ParallelDims, device: torch.device, bf16: bool,
                 data: RunData):
        """Args:
            cfg: the validated run configuration.
            run_dir: rank 0's run directory (rank 0's name is broadcast in setup); None: none.
            dims: the parallel sizes ``validate`` derived (world, dp, cp, tp).
            device: where this rank trains (``select_device``).
            bf16: bf16 parameters and compute (``select_bf16``); else fp32.
            data: the tokenizer, training set and eval set, loaded and checked.
        """
        self.cfg, self.run_dir, self.dims, self.device, self.bf16, self.data = cfg, run_dir, dims, device, bf16, data
        # what close() releases, set as setup() gets to it
        self.created_group = False
        self.loggers: RunLoggers | None = None
        self.preemption: PreemptionRequest | None = None

    # ----------------------------------------------------------------------------- setup

    def setup(self) -> None:
        """Everything before step 1, in this order (a collective)."""
        self._init_process_groups()
        self._build_model_and_optimizer()
        self._start_lifecycle()
        self._start_loggers()
        self._log_run()
        cfg, device = self.cfg, self.device
        self.planner = MicroBatchPlanner(self.parallel, max_tokens_per_gpu=cfg.train.max_tokens_per_gpu, device=device,
                                         pad_id=self.data.tokenizer.pad_id, route_strategy=cfg.gdn.route)
        # the eval set packed exactly like a training global batch
        self.evaluator = Evaluator(self.data.eval_set, cfg.eval.every_steps, cfg.train.steps, tp=self.dims.tp,
                                   device=device, micro_batches=self.planner.micro_batches)
        self.metrics = MetricsProcessor(ModelShape.from_transformer_config(self.tconfig, self.vocab_size,
                                                                           cfg.lora_options),
                                        self.dims.world_size, device)
        self.preemption = PreemptionRequest()
        trace_root = self.run_dir / "traces" if self.run_dir is not None else None  # no run directory: no traces
        self.profile_window = ProfileWindow(cfg.logging.profile_steps, trace_root, self.rank, device)
        # in forward + backward only (logging.count_host_syncs)
        self.host_syncs = HostSyncCounter(enabled=device.type == "cuda" and cfg.logging.count_host_syncs)

    def _init_process_groups(self) -> None:
        cfg, device = self.cfg, self.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.created_group = init_distributed(device)
        self.rank = dist.get_rank()
        self.is_rank0 = self.rank == 0
        self.run_dir = _broadcast_run_dir(self.run_dir)
        if cfg.train.deterministic:  # process-wide: the Runtime puts torch's setting back when it closes
            require_runtime("train.deterministic").use_deterministic_algorithms(warn_only=True)
        seed_everything(cfg.train.seed)
        dynamic = cfg.parallel.dynamic_cp
        self.parallel = ParallelContext.initialize(tp=self.dims.tp, cp=self.dims.cp,
                                                   dynamic_max_cp=dynamic.max_cp if dynamic.enabled else None)
        if device.type == "cuda":
            model_parallel_cuda_manual_seed(cfg.train.seed)

    def _build_model_and_optimizer(self) -> None:
        cfg, dims, device, bf16 = self.cfg, self.dims, self.device, self.bf16
        self.vocab_size = _vocab_size(cfg, self.data.tokenizer, dims.tp)
        # mixed recompute without a layer count: the memory model's choice, kept in the run's config
        self.cfg = cfg = resolve_full_layers(cfg, dims, device, bf16, self.vocab_size)
        check_memory_fits(cfg, dims, device, bf16, self.vocab_size, log=self.is_rank0)
        self.tconfig, model = _build_model(cfg, dims, device, bf16, self.vocab_size)
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
        self.start_step, self.run_dir = self.lifecycle.start_step, self.lifecycle.run_dir

    def _start_loggers(self) -> None:
        """config.yaml in the run directory; console, JSONL and W&B loggers (a resumed run appends)."""
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
        if not self.is_rank0:
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
        self.optimizer.zero_grad()
        self.scheduler.step(1)  # the rate of THIS step (see build_scheduler)
        lr = float(self.optimizer.param_groups[0]["lr"])
        loss_sum = self._forward_backward(plan, loss_tokens)
        optimizer_timer = OptimizerTimer(self.device)
        updated, grad_norm = self.optimizer.step()
        optimizer_timer.stop()
        totals = all_reduce_step(loss_sum, self._raised_flags(), self.dims.tp)
        step_time = timer.elapsed()
        record = self.metrics.record(
            step=step, loss=totals.loss_sum / max(loss_tokens, 1), grad_norm=grad_norm, lr=lr,
            seq_lengths=[len(s) for s in batch], loss_tokens=loss_tokens, padded_tokens=plan.padded_tokens,
            num_micro_batches=len(plan.micro_batches), epoch=epoch, step_time_s=step_time,
            host_syncs=self.host_syncs.count if self.host_syncs.enabled else None,
        ).as_dict()
        record["optimizer_time_s"] = optimizer_timer.seconds()  # the step's host read has waited
        if plan.cp_size_counts is not None:
            record["cp_sizes"] = plan.cp_size_counts  # micro-batches per CP size, whole step
        self._log_host_syncs(step)
        return self._outcome(record, totals, updated=updated)

    def _forward_backward(self, plan: StepPlan, loss_tokens: int) -> torch.Tensor:
        """Gradients of the global batch's loss accumulated over this rank's micro-batches; returns
        this rank's summed per-token loss (a device scalar, not yet reduced over ranks)."""
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.host_syncs.reset()
        # every micro-batch built (and its upload queued) before the first forward: the host's
        # packing never stands between one micro-batch's backward and the next forward
        for mb in [self.planner.build(planned) for planned in plan.micro_batches]:
            with self.host_syncs:
                mb_loss = summed_token_loss(self.model, mb)
                (mb_loss / max(loss_tokens, 1)).backward()
            loss_sum += mb_loss.detach()
        return loss_sum

    def _raised_flags(self) -> set[StepFlag]:
        """This rank's :class:`StepFlag` s for the step's all-reduce."""
        return {StepFlag.STOP_REQUESTED} if self.preemption.requested else set()

    def _outcome(self, record: dict[str, Any], totals: StepTotals, *, updated: bool) -> StepOutcome:
        """The one place a step's outcome is decided. From all-reduced values only, so every rank
        takes the same decision in the same step."""
        return StepOutcome(record=record, updated=updated, stop=StepFlag.STOP_REQUESTED in totals.flags)

    def _log_host_syncs(self, step: int) -> None:
        if self.host_syncs.count and self.is_rank0 and step <= self.start_step + 2:  # where (first steps only)
            logger.info("step %d: %d host syncs in forward+backward, at %s", step, self.host_syncs.count,
                        dict(self.host_syncs.locations.most_common(8)))

    # ----------------------------------------------------------------------------- the loop

    def run(self) -> TrainResult:
        """Steps ``start_step + 1 .. train.steps``, each followed by its evaluation when due, its log
        record, the profiler window and its checkpoint when due; ends early (saved) after a step in
        which a rank was asked to stop. Then waits for a background save and exports when asked."""
        cfg = self.cfg
        result = TrainResult(records=[], run_dir=self.run_dir, checkpoints=self.lifecycle.saved,
                             start_step=self.start_step,
                             save_timings=self.lifecycle.saver.timings if self.lifecycle.saver else [])
        self.model.train()
        for step in range(self.start_step + 1, cfg.train.steps + 1):
            self.profile_window.before_step(step)
            outcome = self.train_step(step)
            record = self._logged_record(step, outcome)
            result.records.append(record)
            self.loggers.log(record)
            trace = self.profile_window.after_step(step)
            if trace is not None and self.is_rank0:
                logger.info("profiler traces of steps %s written to %s", cfg.logging.profile_steps, trace.parent)
            saved = self.lifecycle.after_step(step, stop_requested=outcome.stop, model=self.core_model,
                                              optimizer=self.optimizer, scheduler=self.scheduler)
            if outcome.stop and step != cfg.train.steps:
                result.preempted_at = step
                self._report_stop(step, saved)
                break
        self.lifecycle.finish(completed=result.preempted_at is None, model=self.core_model)
        wandb = self.loggers.wandb()
        result.wandb_dir = wandb.run_dir if wandb is not None else None
        return result

    def _logged_record(self, step: int, outcome: StepOutcome) -> dict[str, Any]:
        """The step's record as logged: the evaluation when due (after the step's timing: evaluation
        is not in tok/s) and whether the update was skipped."""
        record = dict(outcome.record)
        if self.evaluator.due(step):
            record.update(self.evaluator.run(self.model))
        if not outcome.updated:
            record["skipped_update"] = True
        return record

    def _report_stop(self, step: int, saved: Path | None) -> None:
        if self.is_rank0:
            logger.warning("stop requested (SIGTERM/SIGUSR1): stopped after step %d%s", step,
                           f", checkpoint {saved}" if saved is not None else
                           " without a checkpoint (no run directory or checkpoint.dir)")

    def close(self) -> None:
        """Release what setup() made, also after a setup or a step that failed part way: signal
        handlers, loggers, the model-parallel groups, and the default group when made here."""
        if self.preemption is not None:
            self.preemption.restore()
        if self.loggers is not None:
            self.loggers.close()
        ParallelContext.destroy()
        if self.created_group and dist.is_initialized():
            dist.destroy_process_group()
