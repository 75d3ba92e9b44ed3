"""The training run: :func:`run_training` (the entry point) validates the config (before anything
is built; ``model.mtp.num_layers=null`` resolved from the checkpoint's tensors) and runs a
:class:`Trainer`:

1. :meth:`Trainer.setup`: stop signals, the process groups (:class:`~relax_gdn.parallel.ParallelContext`),
   the data (:mod:`~relax_gdn.train.run_data`), the model (:mod:`~relax_gdn.train.build`), gradient
   sync + optimizer + schedule, checkpoints, resume and the run directory
   (:class:`~relax_gdn.train.checkpoint_manager.CheckpointManager`), loggers, the planner, the
   evaluator and the step (:class:`~relax_gdn.train.step.TrainStep`);
2. :meth:`Trainer.run`: one :meth:`Trainer.train_step` per optimizer step, each followed by its
   evaluation when due, logging, the profiler window, the checkpoint when due, and the stop a rank
   asked for (:mod:`~relax_gdn.train.stop`) or a divergence (``train.on_nonfinite``), under the step
   watchdog; then the background save is awaited and the Hugging Face export written;
3. :meth:`Trainer.close`: signal handlers, the watchdog, loggers and process groups released (also
   after an error).

What every rank must decide alike is decided once (:mod:`relax_gdn.train.agreement`): a data or
checkpoint problem found on any rank stops every rank at the same place, the checkpoint to resume
is rank 0's choice, and a step's outcome comes from the step's all-reduce alone.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from relax_gdn.config import ParallelDims, RunConfig, validate
from relax_gdn.config.hydra_io import save_run_config
from relax_gdn.parallel import ParallelContext, init_distributed, launcher_rank, launcher_world_size
from relax_gdn.runtime import Runtime
from relax_gdn.train.agreement import agree_on_errors
from relax_gdn.train.build import build, resolve_mtp_layers, select_bf16, select_device
from relax_gdn.train.console import log_run_start
from relax_gdn.train.evaluate import Evaluator
from relax_gdn.train.flops import ModelShape
from relax_gdn.train.checkpoint_manager import CheckpointManager, RunFacts, TrainState
from relax_gdn.train.loggers import RunLoggers, default_run_name, run_tags
from relax_gdn.train.metrics import MetricsProcessor
from relax_gdn.train.optimizer import build_scheduler, build_training_model_and_optimizer
from relax_gdn.train.planner import MicroBatchPlanner
from relax_gdn.train.profiling import ProfileWindow
from relax_gdn.train.resume import DataKey, Layout
from relax_gdn.train.run_data import RunData, load_run_data
from relax_gdn.train.run_result import RunStop, TrainResult, report_divergence, report_stop
from relax_gdn.train.step import StepOutcome, TrainStep, all_reduce_step, raised_flags, stop_exit_code
from relax_gdn.train.stop import StopRequest
from relax_gdn.train.watchdog import StepWatchdog

logger = logging.getLogger("relax_gdn.train")


def run_training(cfg: RunConfig, run_dir: str | Path | None, *, runtime: Runtime, data=None,
                 on_continue: Callable[[Path], None] | None = None) -> TrainResult:
    """Train ``cfg`` (already validated or not: validated again here, before anything is built).

    ``run_dir``: where rank 0 writes ``config.yaml``, ``metrics.jsonl`` and (by default) the
    checkpoints; None writes nothing (no JSONL, no checkpoints unless ``checkpoint.dir``).
    Uses the initialized default process group, else makes a one-process one. ``runtime``: the
    installed :class:`relax_gdn.runtime.Runtime` (the entry points install one), which makes the
    process-wide changes the run needs (signal handlers, the checkpoint writer's queue). ``data``: a prepared
    ``(tokenizer, SFTDataset)`` pair (benchmarks with a length distribution of their own) instead of
    what ``cfg.data`` names. ``on_continue``: called on rank 0 with the run directory a resumed run
    continues when it is not ``run_dir`` (``train.py`` moves Hydra's job log there).
    """
    dims = validate(cfg, launcher_world_size())
    resolved = resolve_mtp_layers(cfg)
    if resolved is not cfg:  # again: the MTP layer a checkpoint brings has rules of its own
        dims = validate(resolved, launcher_world_size())
    cfg = resolved
    device = select_device(cfg)
    bf16 = select_bf16(cfg, device)
    # the entry point's Runtime owns the process-wide changes (on CPU: Megatron-Core's shims)
    cpu = device.type == "cpu"
    runtime.require("training on CPU" if cpu else "training on CUDA", cpu_shims=cpu)

    trainer = Trainer(cfg, Path(run_dir) if run_dir is not None else None, dims=dims, device=device, bf16=bf16,
                      runtime=runtime, data=data, on_continue=on_continue)
    try:
        trainer.setup()
        return trainer.run()
    finally:
        trainer.close()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def broadcast_run_dir(run_dir: Path | None) -> Path | None:
    """Rank 0's run directory on every rank (Hydra names it from the clock on every rank)."""
    box = [str(run_dir) if run_dir is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] is not None else None


class Trainer:
    """One training run in this process: :meth:`setup`, :meth:`run` (which calls
    :meth:`train_step` once per optimizer step), :meth:`close`. See the module docstring."""

    # what setup() builds
    rank: int  # global rank
    is_rank0: bool  # the rank that logs and writes the run directory
    parallel: ParallelContext
    data: RunData  # the tokenizer, training set and eval set, loaded and checked (every rank agreeing)
    tconfig: Any  # Megatron-Core TransformerConfig
    model: torch.nn.Module  # what runs forward/backward (on CUDA: wrapped in DDP, bf16 wrapper)
    core_model: torch.nn.Module  # the model itself: what checkpoints and exports read
    optimizer: Any  # gradient sync + clipping + update (relax_gdn.train.optimizer)
    scheduler: Any
    vocab_size: int
    checkpoints: CheckpointManager
    start_step: int  # steps already done (a resumed run)
    evaluator: Evaluator
    stepper: TrainStep  # one optimizer step: forward_backward, optimizer_step, train_step

    def __init__(self, cfg: RunConfig, run_dir: Path | None, *, dims: ParallelDims, device: torch.device, bf16: bool,
                 runtime: Runtime, data=None, on_continue: Callable[[Path], None] | None = None):
        """``cfg``: the validated configuration; ``run_dir``: rank 0's run directory (broadcast in
        setup; None: none); ``dims``: the parallel sizes ``validate`` derived; ``device`` and ``bf16``:
        ``select_device`` / ``select_bf16``; ``runtime``: the installed Runtime; ``data``: a prepared
        ``(tokenizer, SFTDataset)`` pair instead of what ``cfg.data`` names; ``on_continue``: rank 0
        calls it with the run directory a resumed run continues, when that is not ``run_dir``."""
        self.cfg, self.run_dir, self.dims, self.device, self.bf16 = cfg, run_dir, dims, device, bf16
        self.runtime = runtime
        self._given_data = data
        self.on_continue = on_continue
        # what close() releases, set as setup() gets to it
        self.created_group = False
        self.loggers: RunLoggers | None = None
        self.stop: StopRequest | None = None
        self.watchdog: StepWatchdog | None = None

    # ----------------------------------------------------------------------------- setup

    def setup(self) -> None:
        """Everything before step 1, in this order (a collective): stop signals handled, process
        groups, the data (a problem on any rank stops every rank), model and optimizer, checkpoints,
        resume and the run directory, loggers, the step (planner, metrics), evaluator, watchdog."""
        cfg = self.cfg
        saves = bool(cfg.checkpoint.every_steps or cfg.checkpoint.save_final)
        self.stop = StopRequest(self.runtime, rank=launcher_rank(), saves=saves)
        self._init_process_groups()
        self.data = agree_on_errors(lambda: load_run_data(cfg, self._given_data, log=self.is_rank0))
        self._build_model_and_optimizer()
        self._start_checkpoints()
        if self.is_rank0 and not self.checkpoints.complete:
            log_run_start(default_run_name(self.cfg), self.cfg, self.dims, device=self.device, bf16=self.bf16,
                          model=self.core_model, data=self.data)
        self._start_loggers()
        self._start_step()
        self.watchdog = StepWatchdog(cfg.train.hang_timeout_s, rank=self.rank, world_size=self.dims.world_size,
                                     dump_dir=self.run_dir / "hang" if self.run_dir is not None else None)

    def _start_step(self) -> None:
        """The planner, the metrics and the step; the evaluator, which packs the eval set exactly
        like a training global batch."""
        cfg, device = self.cfg, self.device
        planner = MicroBatchPlanner(self.parallel, max_tokens_per_gpu=cfg.train.max_tokens_per_gpu, device=device,
                                    pad_id=self.data.tokenizer.pad_id, route_strategy=cfg.gdn.route,
                                    mtp=bool(cfg.model.mtp.num_layers))
        self.evaluator = Evaluator(self.data.eval_set, cfg.eval.every_steps, cfg.train.steps, tp=self.dims.tp,
                                   device=device, micro_batches=planner.micro_batches)
        shape = ModelShape.from_transformer_config(self.tconfig, self.vocab_size,
                                                   mtp_num_layers=cfg.model.mtp.num_layers or 0, lora=cfg.lora_options)
        self.stepper = TrainStep(cfg=cfg, model=self.model, core_model=self.core_model, optimizer=self.optimizer,
                                 scheduler=self.scheduler, planner=planner,
                                 metrics=MetricsProcessor(shape, self.dims.world_size, device), stop=self.stop,
                                 samples=self.data.dataset.samples, first_step=self.start_step + 1,
                                 is_rank0=self.is_rank0)

    def _init_process_groups(self) -> None:
        cfg, device = self.cfg, self.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.created_group = init_distributed(device, timeout_s=cfg.train.collective_timeout_s)
        self.rank = dist.get_rank()
        self.is_rank0 = self.rank == 0
        self.run_dir = broadcast_run_dir(self.run_dir)
        if cfg.train.deterministic:  # process-wide: the Runtime puts torch's setting back when it closes
            self.runtime.use_deterministic_algorithms(warn_only=True)
        seed_everything(cfg.train.seed)
        dynamic = cfg.parallel.dynamic_cp
        self.parallel = ParallelContext.initialize(tp=self.dims.tp, cp=self.dims.cp,
                                                   dynamic_max_cp=dynamic.max_cp if dynamic.enabled else None,
                                                   timeout=timedelta(seconds=cfg.train.collective_timeout_s))
        if device.type == "cuda":
            model_parallel_cuda_manual_seed(cfg.train.seed)

    def _build_model_and_optimizer(self) -> None:
        """The model (a problem on any rank, such as a checkpoint file one node lacks, stops every
        rank here, before DDP), then gradient sync + optimizer + schedule."""
        device, bf16 = self.device, self.bf16
        built = agree_on_errors(lambda: build(self.cfg, self.parallel, tokenizer_vocab_size=self.data.tokenizer.vocab_size,
                                              device=device, bf16=bf16, runtime=self.runtime,
                                              log=self.is_rank0))
        # the config as built: mixed recompute's layer count is the memory model's choice, kept in the run's config
        self.cfg, self.tconfig, self.core_model, self.vocab_size = built.cfg, built.tconfig, built.model, built.vocab_size
        self.model, self.optimizer = build_training_model_and_optimizer(built.model, self.tconfig, self.cfg,
                                                                        self.parallel, device=device, bf16=bf16)
        self.scheduler = build_scheduler(self.optimizer, self.cfg, log=self.is_rank0)

    def _start_checkpoints(self) -> None:
        """checkpoint.dir checked, the checkpoint resumed (any layout) and the run directory of a
        resumed run: the one place the run's directory is decided."""
        cfg, dims, data = self.cfg, self.dims, self.data
        facts = RunFacts(
            layout=Layout(dims.world_size, dims.tp, dims.cp, cfg.parallel.dynamic_cp.enabled, cfg.effective_max_cp),
            data_key=DataKey(cfg.train.seed, cfg.train.global_batch_size, len(data.dataset)),
            vocab_size=self.vocab_size, tokenizer_vocab_size=data.tokenizer.vocab_size)
        self.checkpoints = CheckpointManager(cfg, run_dir=self.run_dir, state=TrainState(self.core_model, self.optimizer,
                                                                                         self.scheduler),
                                             facts=facts, device=self.device, dp_cp_group=self.parallel.dp_cp_group,
                                             runtime=self.runtime)
        self.start_step = self.checkpoints.resume()
        continued = self.checkpoints.run_dir
        if self.is_rank0 and self.on_continue is not None and continued not in (None, self.run_dir):
            self.on_continue(continued)
        self.run_dir = continued

    def _start_loggers(self) -> None:
        """config.yaml in the run directory; console, JSONL and W&B loggers (a resumed run appends).
        A finished run (resumed at train.steps) leaves its directory and W&B run as they are."""
        if self.checkpoints.complete:
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
                                         start_step=self.start_step, append=self.checkpoints.resumed is not None,
                                         wandb_run_id=self.checkpoints.wandb_run_id)
        self.checkpoints.register_wandb_run(self.loggers.wandb_run_id())

    # ----------------------------------------------------------------------------- the loop

    def train_step(self, step: int) -> StepOutcome:
        """Optimizer step ``step`` (1-based; :meth:`relax_gdn.train.step.TrainStep.train_step`)."""
        return self.stepper.train_step(step)

    def run(self) -> TrainResult:
        """Steps ``start_step + 1 .. train.steps``, each followed by its evaluation when due, its log
        record, the profiler window and its checkpoint when due (none after a non-finite step);
        ends early after a step in which a rank was asked to stop (saved), or one that
        ``train.on_nonfinite`` ends the run at (nothing saved). Then waits for a background save and
        exports when the run completed."""
        records: list[dict[str, Any]] = []
        ended: tuple[int, StepOutcome, Path | None] | None = None
        self.model.train()
        self.watchdog.start()
        trace_dir = self.run_dir / "traces" if self.run_dir is not None else None  # no run directory: no traces
        with ProfileWindow(self.cfg.logging.profile_steps, trace_dir, self.rank, self.device) as profiler:
            for step in range(self.start_step + 1, self.cfg.train.steps + 1):
                self.stop.step = step
                outcome, saved = self._step_and_save(step, profiler, records)
                if outcome.diverged or (outcome.stop and step != self.cfg.train.steps):
                    ended = (step, outcome, saved)
                    break
        self.watchdog.close()
        self.checkpoints.finish(completed=ended is None)
        wandb = self.loggers.wandb()
        return TrainResult(records=records, run_dir=self.run_dir, checkpoints=list(self.checkpoints.saved),
                           start_step=self.start_step, wandb_dir=wandb.run_dir if wandb is not None else None,
                           stop=self._report_end(*ended) if ended is not None else None,
                           nonfinite_steps=self.stepper.nonfinite.total,
                           params_without_gradient=self.stepper.params_without_gradient,
                           save_timings=self.checkpoints.timings)

    def _step_and_save(self, step: int, profiler: ProfileWindow,
                       records: list[dict[str, Any]]) -> tuple[StepOutcome, Path | None]:
        """One step, its record logged, the profiler window, the checkpoint when due; a stop asked
        for while the checkpoint was written stops the run after it (the returned outcome says so)."""
        profiler.before_step(step)
        outcome = self.train_step(step)
        self.watchdog.progress(step, outcome.record["step_time_s"])
        record = self._logged_record(step, outcome)
        records.append(record)
        self.loggers.log(record)
        trace = profiler.after_step(step)
        if trace is not None and self.is_rank0:
            logger.info("profiler traces of steps %s written to %s", self.cfg.logging.profile_steps, trace.parent)
        if outcome.diverged:
            return outcome, None
        saved = self.checkpoints.save_if_due(step, stop_requested=outcome.stop, nonfinite=outcome.nonfinite)
        self.watchdog.progress()
        if saved is not None and not outcome.stop:  # a signal that came during the save: agreed, stop now
            flags = all_reduce_step(torch.zeros((), device=self.device), raised_flags(self.stop), self.dims.tp).flags
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
        """What a run that ended before ``train.steps`` ended with, said once by rank 0 (after the
        background save, so the checkpoint named is complete)."""
        if outcome.diverged:
            return report_divergence(self.cfg, step, outcome.record, in_a_row=self.stepper.nonfinite.in_a_row,
                                     checkpoint=self.checkpoints.last_checkpoint(), is_rank0=self.is_rank0)
        return report_stop(self.cfg, step, code=outcome.stop_code, preempted_by=self.stop.preempted_by, saved=saved,
                           nonfinite=outcome.nonfinite,
                           checkpoint=saved if saved is not None else self.checkpoints.last_checkpoint(),
                           is_rank0=self.is_rank0)

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
