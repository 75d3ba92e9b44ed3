"""The training loop: read it top to bottom (nanoGPT style).

1. validate the config (nothing built yet), pick the device, load + tokenize the data (a bad
   source fails here, before any process group, model or file exists);
2. process groups: ``parallel_state.initialize_model_parallel(tp, cp)``, DP = world / (tp·cp);
3. model (``build_qwen3_5_model``), gradient sync + optimizer + warm-up/cosine schedule, resume;
4. per step: the step's global batch (a pure function of seed and step), packed into
   micro-batches for this DP rank, sharded for this CP rank (dynamic CP: each micro-batch at its
   own CP size d, split over the CP group's sub-groups of size d, ``relax_gdn.parallel.dynamic_cp``); gradient
   accumulation with the loss
   ``Σ (per-token loss × loss_mask) / (loss tokens of the whole global batch)``; optimizer step;
   metrics; logging; checkpoint.

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
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from torch.profiler import ProfilerActivity, profile

from relax_gdn.config import ParallelDims, RunConfig, validate
from relax_gdn.config.hydra_io import save_run_config
from relax_gdn.data import (
    global_batch_at_step,
    load_sft_dataset,
    load_tokenizer,
    make_micro_batch,
    padded_length,
    plan_micro_batches,
    synthetic_math_dataset,
)
from relax_gdn.errors import ConfigError, DataError, RecipeError
from relax_gdn.model import Qwen3_5Options, build_qwen3_5_model, qwen3_5_config, qwen3_5_preset
from relax_gdn.model.fusion import Fusion
from relax_gdn.model.hf_checkpoint import load_hf_checkpoint
from relax_gdn.model.recompute import recompute_config_fields, recomputes
from relax_gdn.parallel import DynamicCPGroups, dynamic_cp_micro_batches
from relax_gdn.runtime import require_runtime
from relax_gdn.train.evaluate import Evaluator, split_eval_set
from relax_gdn.train.flops import ModelShape
from relax_gdn.train.lifecycle import DataKey, Layout, RunLifecycle
from relax_gdn.train.loggers import RunLoggers, default_run_name, run_tags
from relax_gdn.train.loss import summed_token_loss
from relax_gdn.train.memory import GIB, estimate_memory
from relax_gdn.train.metrics import HostSyncCounter, MetricsProcessor, OptimizerTimer, StepTimer
from relax_gdn.train.optimizer import CPUGradSyncOptimizer, build_megatron_ddp_and_optimizer, build_scheduler

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


def load_data(cfg: RunConfig):
    """(tokenizer, training set, eval set or None): errors name the data.* / eval.* key to fix."""
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
    return tokenizer, dataset, eval_set


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
        if step == self.first and self.trace_dir is not None:
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


def check_memory_fits(cfg: RunConfig, dims: ParallelDims, device: torch.device, bf16: bool, vocab_size: int,
                      log: bool) -> None:
    """On CUDA: log the per-GPU memory model and refuse (before building the model) a run whose
    estimate exceeds the GPU's memory. (A CPU run has no GPU memory to estimate.)"""
    if device.type != "cuda":
        return
    shape = ModelShape.from_transformer_config(qwen3_5_config(cfg.model.preset), vocab_size)
    estimate = estimate_memory(
        shape, tokens_per_gpu=cfg.train.max_tokens_per_gpu, tp=dims.tp, cp=dims.cp, dp=dims.dp,
        sequence_parallel=cfg.parallel.sp, bf16=bf16, recompute=cfg.recompute.granularity,
        fused_norms=cfg.model.fused_norms, fused_cross_entropy=cfg.model.fused_cross_entropy,
        optimizer=cfg.optim.name,
    )
    if log:
        logger.info("memory model (%s, recompute %s, %d tokens/GPU): %s", cfg.model.preset,
                    cfg.recompute.granularity, cfg.train.max_tokens_per_gpu, estimate.summary())
    capacity = torch.cuda.get_device_properties(device).total_memory
    if estimate.total > capacity:
        raise RecipeError(
            f"{cfg.model.preset} will not fit this GPU: {estimate.summary()}, above its {capacity / GIB:.0f} GiB. "
            "Lower train.max_tokens_per_gpu, use recompute.granularity=selective or full, or spread the "
            "optimizer state over more GPUs (parallel.cp / data parallel); benchmarks of a model whose "
            "optimizer state cannot fit can set optim.name=none (gradients without an update)"
        )


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
        tokenizer, dataset, eval_set = load_data(cfg)
    else:
        (tokenizer, dataset), eval_set = data, None
        check_samples_fit(dataset.samples, cfg)
    # the entry point's Runtime owns the process-wide changes (on CPU: Megatron-Core's shims)
    cpu = device.type == "cpu"
    require_runtime("training on CPU" if cpu else "training on CUDA", cpu_shims=cpu)

    if device.type == "cuda":
        torch.cuda.set_device(device)
    created_group = init_distributed(device)
    try:
        run_dir = _broadcast_run_dir(Path(run_dir) if run_dir is not None else None)
        return _train(cfg, dims, device, bf16, tokenizer, dataset, eval_set, run_dir)
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


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
                                  num_layers=qwen3_5_preset(cfg.model.preset).config["num_layers"]),
    )
    options = Qwen3_5Options.for_preset(
        cfg.model.preset, vocab_size=vocab_size, gdn=cfg.gdn_options,
        attention_backend=cfg.model.attention_backend, spec_provider=cfg.model.spec_provider,
        contiguous_between_layers=cfg.gdn.contiguous_between_layers,
        fusion=Fusion(norms=cfg.model.fused_norms, cross_entropy=cfg.model.fused_cross_entropy,
                      embedding_grad_into_main_grad=cfg.model.fused_grad_accumulation),
        recompute_mlp_activation=recomputes(cfg.recompute.granularity, cfg.recompute.modules, "mlp_act"),
        recompute_skips_unread_gemm=cfg.recompute.skip_unused,  # acts under full recompute only
    )
    model = build_qwen3_5_model(tconfig, options)
    if device.type == "cuda":
        model.cuda(device)
    if cfg.model.hf_checkpoint:
        load_hf_checkpoint(model, cfg.model.hf_checkpoint)
    return tconfig, model


def _vocab_size(cfg: RunConfig, tokenizer, tp: int) -> int:
    if cfg.model.hf_checkpoint:  # the checkpoint's embedding decides
        vocab = qwen3_5_preset(cfg.model.preset).vocab_size
        if tokenizer.vocab_size > vocab:
            raise ValueError(f"data.tokenizer has {tokenizer.vocab_size} tokens, more than the checkpoint's {vocab}")
        return vocab
    # Megatron pads to a multiple of 128 x TP; padding to 128 x 8 instead gives every TP <= 8 the
    # SAME padded vocabulary, so a checkpoint written at one TP loads at another (the embedding and
    # output layer keep their global shape). The initial values still differ between TP sizes:
    # Megatron-Core initialises each TP shard from its own RNG stream.
    multiple = 128 * max(8, tp)
    return -(-tokenizer.vocab_size // multiple) * multiple


def _train(cfg, dims, device, bf16, tokenizer, dataset, eval_set, run_dir) -> TrainResult:
    rank = dist.get_rank()
    is_rank0 = rank == 0
    if cfg.train.deterministic:  # process-wide: the Runtime puts torch's setting back when it closes
        require_runtime("train.deterministic").use_deterministic_algorithms(warn_only=True)
    seed_everything(cfg.train.seed)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp, context_parallel_size=dims.cp, create_gloo_process_groups=False,
    )
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(cfg.train.seed)
    dp_rank = parallel_state.get_data_parallel_rank()
    cp_rank = parallel_state.get_context_parallel_rank()
    cp_group = parallel_state.get_context_parallel_group()
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dynamic_cp = cfg.parallel.dynamic_cp.enabled
    if dynamic_cp:
        dynamic_groups = DynamicCPGroups(cp_group, cfg.parallel.dynamic_cp.max_cp)

    vocab_size = _vocab_size(cfg, tokenizer, dims.tp)
    check_memory_fits(cfg, dims, device, bf16, vocab_size, log=is_rank0)
    tconfig, model = _build_model(cfg, dims, device, bf16, vocab_size)
    if device.type == "cuda":
        core_model = model
        if bf16:  # as Megatron's get_model: bf16 params, fp32 outputs (the per-token loss)
            model = Float16Module(tconfig, model)
        model, optimizer = build_megatron_ddp_and_optimizer(model, tconfig, cfg, bf16=bf16)
        model.broadcast_params()  # every DP replica starts from rank 0's weights
    else:
        optimizer = CPUGradSyncOptimizer(model, cfg, dp_cp_group=dp_cp_group, tp_group=tp_group,
                                         sequence_parallel=cfg.parallel.sp)
        core_model = model
    scheduler = build_scheduler(optimizer, cfg, log=is_rank0)
    # checkpoint.dir checked, checkpoint loaded (any layout), run directory of a resumed run
    lifecycle = RunLifecycle.start(
        cfg, run_dir=run_dir, model=core_model, optimizer=optimizer, scheduler=scheduler, vocab_size=vocab_size,
        layout=Layout(dims.world_size, dims.tp, dims.cp, dynamic_cp, cfg.effective_max_cp),
        data_key=DataKey(cfg.train.seed, cfg.train.global_batch_size, len(dataset)),
        tokenizer_vocab_size=tokenizer.vocab_size, device=device, dp_cp_group=dp_cp_group)
    start_step, run_dir = lifecycle.start_step, lifecycle.run_dir

    config_dict = {**cfg.to_dict(), "derived": {"world_size": dims.world_size, "dp": dims.dp, "device": str(device),
                                               "bf16": bf16, "vocab_size": vocab_size, "run_name": default_run_name(cfg),
                                               "tags": run_tags(cfg), "num_samples": len(dataset),
                                               "data_skips": dataset.counts.as_dict()}}
    if is_rank0 and run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_run_config(cfg, run_dir)
    loggers = RunLoggers.create(cfg, run_dir, is_rank0=is_rank0, config_dict=config_dict, start_step=start_step,
                                append=lifecycle.resumed is not None, wandb_run_id=lifecycle.wandb_run_id)
    lifecycle.wandb_run_id = loggers.wandb_run_id()  # saved in checkpoints: a resume continues this W&B run
    if is_rank0:
        n_params = sum(p.numel() for p in core_model.parameters())
        logger.info("run %s: world %d = dp %d x cp %d x tp %d on %s (%s); %s params/rank; %d samples (%s)",
                    default_run_name(cfg), dims.world_size, dims.dp, dims.cp, dims.tp, device,
                    "bf16" if bf16 else "fp32", f"{n_params:,}", len(dataset), dataset.counts.summary())
        if eval_set is not None and cfg.eval.every_steps:
            logger.info("evaluation every %d steps on %d samples from %s", cfg.eval.every_steps,
                        len(eval_set.samples), eval_set.source)

    def plan_this_rank(batch):
        """This rank's micro-batches of a global batch as (samples, CP size, rank in that CP group,
        the group), the batch's padded tokens, and micro-batches per CP size (dynamic CP) or None."""
        plan = plan_micro_batches(batch, max_tokens_per_gpu=cfg.train.max_tokens_per_gpu, cp_size=dims.cp,
                                  dp_size=dims.dp)
        if dynamic_cp:
            return dynamic_cp_micro_batches(plan, dp_rank, cp_rank, dynamic_groups, cfg.train.max_tokens_per_gpu)
        mine = [(samples, dims.cp, cp_rank, cp_group) for samples in plan[dp_rank]]
        return mine, sum(padded_length(len(s), dims.cp) for s in batch), None

    def build(samples, mb_cp_size, mb_cp_rank, mb_cp_group):
        return make_micro_batch(samples, cp_size=mb_cp_size, cp_rank=mb_cp_rank, device=device,
                                pad_id=tokenizer.pad_id, route_strategy=cfg.gdn.route, cp_group=mb_cp_group,
                                carries_cp_group=dynamic_cp)

    # the eval set packed exactly like a training global batch
    evaluator = Evaluator(eval_set, cfg.eval.every_steps, cfg.train.steps, tp=dims.tp, device=device,
                          micro_batches=lambda samples: (build(*planned) for planned in plan_this_rank(samples)[0]))
    metrics = MetricsProcessor(ModelShape.from_transformer_config(tconfig, vocab_size), dims.world_size, device)
    records: list[dict[str, Any]] = []
    result = TrainResult(records=records, run_dir=run_dir, checkpoints=lifecycle.saved, start_step=start_step,
                         save_timings=lifecycle.saver.timings if lifecycle.saver else [])
    preemption = PreemptionRequest()
    trace_root = run_dir / "traces" if run_dir is not None else None  # no run directory: no traces
    profile_window = ProfileWindow(cfg.logging.profile_steps, trace_root, rank, device)
    host_syncs = HostSyncCounter(enabled=device.type == "cuda")  # in forward + backward only
    try:
        model.train()
        for step in range(start_step + 1, cfg.train.steps + 1):
            profile_window.before_step(step)
            timer = StepTimer()
            epoch, batch = global_batch_at_step(dataset.samples, cfg.train.global_batch_size, cfg.train.seed, step - 1)
            mine, padded_tokens, cp_size_counts = plan_this_rank(batch)
            global_loss_tokens = sum(s.num_loss_tokens for s in batch)
            optimizer.zero_grad()
            scheduler.step(1)  # the rate of THIS step (see build_scheduler)
            lr = float(optimizer.param_groups[0]["lr"])
            loss_sum = torch.zeros((), dtype=torch.float32, device=device)
            host_syncs.reset()
            # every micro-batch built (and its upload queued) before the first forward: the host's
            # packing never stands between one micro-batch's backward and the next forward
            for mb in [build(*planned) for planned in mine]:
                with host_syncs:
                    mb_loss = summed_token_loss(model, mb)
                    (mb_loss / max(global_loss_tokens, 1)).backward()
                loss_sum += mb_loss.detach()
            optimizer_timer = OptimizerTimer(device)
            updated, grad_norm = optimizer.step()
            optimizer_timer.stop()
            # One collective and one host read per step carry the loss (summed over DP x CP; TP ranks
            # hold the same value, hence / tp) and whether any rank was asked to stop.
            stats = torch.stack((loss_sum / dims.tp, torch.tensor(float(preemption.requested), device=device)))
            dist.all_reduce(stats)
            loss_total, stop_requested = stats.tolist()  # waits for the GPU: ends the timed step
            loss = loss_total / max(global_loss_tokens, 1)
            step_time = timer.elapsed()
            record = metrics.record(
                step=step, loss=loss, grad_norm=grad_norm, lr=lr, seq_lengths=[len(s) for s in batch],
                loss_tokens=global_loss_tokens, padded_tokens=padded_tokens,
                num_micro_batches=len(mine), epoch=epoch, step_time_s=step_time,
                host_syncs=host_syncs.count if host_syncs.enabled else None,
            ).as_dict()
            if host_syncs.count and is_rank0 and step <= start_step + 2:  # where (first steps only)
                logger.info("step %d: %d host syncs in forward+backward, at %s", step, host_syncs.count,
                            dict(host_syncs.locations.most_common(8)))
            record["optimizer_time_s"] = optimizer_timer.seconds()  # the step's host read has waited
            if dynamic_cp:
                record["cp_sizes"] = cp_size_counts  # micro-batches per CP size, whole step
            if evaluator.due(step):  # after the step's timing: evaluation is not in tok/s
                record.update(evaluator.run(model))
            if not updated:
                record["skipped_update"] = True
            records.append(record)
            loggers.log(record)
            trace = profile_window.after_step(step)
            if trace is not None and is_rank0:
                logger.info("profiler traces of steps %s written to %s", cfg.logging.profile_steps, trace.parent)
            saved = lifecycle.after_step(step, stop_requested=bool(stop_requested), model=core_model,
                                         optimizer=optimizer, scheduler=scheduler)
            if stop_requested and step != cfg.train.steps:
                result.preempted_at = step
                if is_rank0:
                    logger.warning("stop requested (SIGTERM/SIGUSR1): stopped after step %d%s", step,
                                   f", checkpoint {saved}" if saved is not None else
                                   " without a checkpoint (no run directory or checkpoint.dir)")
                break
        lifecycle.finish(completed=result.preempted_at is None, model=core_model)
        wandb = loggers.wandb()
        result.wandb_dir = wandb.run_dir if wandb is not None else None
    finally:
        preemption.restore()
        loggers.close()
    return result
