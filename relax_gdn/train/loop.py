"""The :class:`Trainer`: one training run in this process (:func:`relax_gdn.train.run.run_training`
validates the config and runs one).

1. :meth:`Trainer.setup`: stop signals, the process groups (:class:`~relax_gdn.parallel.ParallelContext`),
   the data (:mod:`~relax_gdn.train.run_data`), the model (:mod:`~relax_gdn.train.build`), gradient
   sync + optimizer + schedule, checkpoints, resume and the run directory
   (:class:`~relax_gdn.train.checkpoint_manager.CheckpointManager`), LoRA's frozen FP8 weights
   moved to host memory (:mod:`~relax_gdn.model.fp8.plan`), loggers, the evaluator and the step
   (:class:`~relax_gdn.train.step.TrainStep`);
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

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_gdn.config import ParallelDims, RunConfig
from relax_gdn.model.fp8.plan import fp8_plan_of, keep_frozen_weights_on_host
from relax_gdn.parallel import ParallelContext, launcher_rank
from relax_gdn.runtime import Runtime
from relax_gdn.train.agreement import agree_on_errors
from relax_gdn.train.build import build
from relax_gdn.train.checkpoint_manager import CheckpointManager, checkpoint_root
from relax_gdn.train.console import log_run_start
from relax_gdn.train.evaluate import Evaluator
from relax_gdn.train.loggers import RunLoggers, default_run_name, start_run_loggers
from relax_gdn.train.optimizer import build_scheduler, build_training_model_and_optimizer
from relax_gdn.train.process_groups import broadcast_run_dir, start_process_groups
from relax_gdn.train.profiling import ProfileWindow
from relax_gdn.train.run_data import RunData, load_run_data
from relax_gdn.train.run_result import TrainResult, report_end
from relax_gdn.train.state import TrainState
from relax_gdn.train.step import StepOutcome, TrainStep
from relax_gdn.train.stop import StopRequest
from relax_gdn.train.watchdog import StepWatchdog

logger = logging.getLogger("relax_gdn.train")


class Trainer:
    """One training run in this process: :meth:`setup`, :meth:`run` (which calls
    :meth:`train_step` once per optimizer step), :meth:`close`. See the module docstring."""

    # what setup() builds (besides the loggers, the stop request and the watchdog, made first)
    parallel: ParallelContext  # the run's process groups
    data: RunData  # the tokenizer, training set and eval set, loaded and checked (every rank agreeing)
    model: torch.nn.Module  # what runs forward/backward (on CUDA: the model wrapped in DDP and bf16)
    state: TrainState  # the model itself (what checkpoints and exports read), optimizer, schedule
    checkpoints: CheckpointManager
    stepper: TrainStep  # one optimizer step: forward_backward, optimizer_step, train_step

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path | None,
        *,
        dims: ParallelDims,
        device: torch.device,
        bf16: bool,
        runtime: Runtime,
        data=None,
        on_continue: Callable[[Path], None] | None = None,
    ):
        """``cfg``: the validated configuration; ``run_dir``: rank 0's run directory (broadcast in
        setup; None: none); ``dims``: the parallel sizes ``validate`` derived; ``device`` and ``bf16``:
        ``select_device`` / ``select_bf16``; ``runtime``: the installed Runtime; ``data``: a prepared
        ``(tokenizer, SFTDataset)`` pair instead of what ``cfg.data`` names; ``on_continue``: rank 0
        calls it with the run directory a resumed run continues, when that is not ``run_dir``."""
        self.cfg, self.run_dir, self.dims, self.device, self.bf16 = cfg, run_dir, dims, device, bf16
        self.runtime, self._given_data, self.on_continue = runtime, data, on_continue
        # what close() releases, set as setup() gets to it
        self.created_group = False
        self.loggers: RunLoggers | None = None
        self.stop: StopRequest | None = None
        self.watchdog: StepWatchdog | None = None

    # ----------------------------------------------------------------------------- setup

    def setup(self) -> None:
        """Everything before step 1, in this order (a collective): stop signals handled, process groups,
        the data (a problem on any rank stops every rank), model and optimizer, checkpoints, resume and
        the run directory, frozen FP8 weights to host memory, loggers, step, evaluator, watchdog."""
        cfg = self.cfg
        root = checkpoint_root(cfg, self.run_dir)  # what a stop saves into, for its messages
        self.stop = StopRequest(
            self.runtime, rank=launcher_rank(), checkpoints=root, resume=cfg.checkpoint.resume
        )
        self.parallel, self.created_group = start_process_groups(cfg, self.dims, self.device, self.runtime)
        self.rank = dist.get_rank()
        self.is_rank0 = self.rank == 0
        self.run_dir = broadcast_run_dir(self.run_dir)
        self.data = agree_on_errors(lambda: load_run_data(cfg, self._given_data, log=self.is_rank0))
        self._build_model_and_optimizer()
        self._start_checkpoints()
        # once the weights have their starting values; a node short of host memory stops every rank
        agree_on_errors(lambda: keep_frozen_weights_on_host(self.core_model))
        self._start_loggers()
        self._start_step()
        hang_dir = self.run_dir / "hang" if self.run_dir is not None else None
        self.watchdog = StepWatchdog(
            cfg.train.hang_timeout_s, rank=self.rank, world_size=self.dims.world_size, dump_dir=hang_dir
        )

    def _start_step(self) -> None:
        """The step (with this rank's micro-batch planner and the metrics) and the evaluator, which
        packs the eval set exactly like a training global batch."""
        cfg, data = self.cfg, self.data
        self.stepper = TrainStep(
            cfg=cfg,
            state=self.state,
            model=self.model,
            parallel=self.parallel,
            device=self.device,
            data=data,
            tconfig=self.tconfig,
            vocab_size=self.vocab_size,
            stop=self.stop,
            first_step=self.start_step + 1,
            is_rank0=self.is_rank0,
        )
        self.evaluator = Evaluator(
            data.eval_set,
            cfg.eval.every_steps,
            cfg.train.steps,
            tp=self.dims.tp,
            device=self.device,
            micro_batches=self.stepper.planner.micro_batches,
        )

    def _build_model_and_optimizer(self) -> None:
        """The model (a problem on any rank, such as a checkpoint file one node lacks, stops every
        rank here, before DDP), then gradient sync + optimizer + schedule."""
        cfg, parallel, runtime, rank0 = self.cfg, self.parallel, self.runtime, self.is_rank0
        vocab, device, bf16 = self.data.tokenizer.vocab_size, self.device, self.bf16
        options = dict(tokenizer_vocab_size=vocab, device=device, bf16=bf16, runtime=runtime, log=rank0)
        built = agree_on_errors(lambda: build(cfg, parallel, **options))
        self.cfg = built.cfg  # as built: mixed recompute's layer count is the memory model's choice
        self.tconfig, self.vocab_size, self.core_model = built.tconfig, built.vocab_size, built.model
        self.model, optimizer = build_training_model_and_optimizer(
            built.model, self.tconfig, self.cfg, parallel, device=device, bf16=bf16
        )
        self.state = TrainState(built.model, optimizer, build_scheduler(optimizer, self.cfg, log=rank0))

    def _start_checkpoints(self) -> None:
        """checkpoint.dir checked, the checkpoint resumed (any layout) and the run directory of a
        resumed run: the one place the run's directory is decided."""
        tokenizer, samples = self.data.tokenizer, len(self.data.dataset)
        self.checkpoints = CheckpointManager(
            self.cfg,
            run_dir=self.run_dir,
            state=self.state,
            dims=self.dims,
            num_samples=samples,
            vocab_size=self.vocab_size,
            tokenizer_vocab_size=tokenizer.vocab_size,
            device=self.device,
            dp_cp_group=self.parallel.dp_cp_group,
            runtime=self.runtime,
        )
        self.start_step = self.checkpoints.resume()
        continued = self.checkpoints.run_dir
        if self.is_rank0 and self.on_continue is not None and continued not in (None, self.run_dir):
            self.on_continue(continued)
        self.run_dir = continued

    def _start_loggers(self) -> None:
        """The run's first log lines; config.yaml in the run directory; console, JSONL and W&B loggers
        (a resumed run appends). A finished run (resumed at train.steps) leaves its directory and
        W&B run as they are."""
        if self.checkpoints.complete:
            self.loggers = RunLoggers([])
            return
        cfg, dims, device, bf16, data = self.cfg, self.dims, self.device, self.bf16, self.data
        if self.is_rank0:
            log_run_start(
                default_run_name(cfg), cfg, dims, device=device, bf16=bf16, model=self.core_model, data=data
            )
        self.loggers = start_run_loggers(
            cfg,
            self.run_dir,
            dims=dims,
            device=device,
            bf16=bf16,
            vocab_size=self.vocab_size,
            dataset=data.dataset,
            is_rank0=self.is_rank0,
            start_step=self.start_step,
            append=self.checkpoints.resumed is not None,
            wandb_run_id=self.checkpoints.wandb_run_id,
        )
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
        traces = self.run_dir / "traces" if self.run_dir is not None else None  # no run directory: no traces
        with ProfileWindow(self.cfg.logging.profile_steps, traces, self.rank, self.device) as profiler:
            for step in range(self.start_step + 1, self.cfg.train.steps + 1):
                self.stop.step = step
                outcome, saved = self._step_and_save(step, profiler, records)
                if outcome.diverged or (outcome.stop and step != self.cfg.train.steps):
                    ended = (step, outcome, saved)
                    break
        self.watchdog.close()
        self.checkpoints.finish(completed=ended is None)
        stepper, wandb, stop = self.stepper, self.loggers.wandb(), None
        if ended is not None:
            stop = report_end(
                self.cfg,
                *ended,
                preempted_by=self.stop.preempted_by,
                in_a_row=stepper.nonfinite.in_a_row,
                last_checkpoint=self.checkpoints.last_checkpoint,
                is_rank0=self.is_rank0,
            )
        return TrainResult(
            records=records,
            run_dir=self.run_dir,
            checkpoints=list(self.checkpoints.saved),
            start_step=self.start_step,
            wandb_dir=wandb.run_dir if wandb is not None else None,
            stop=stop,
            nonfinite_steps=stepper.nonfinite.total,
            params_without_gradient=stepper.params_without_gradient,
            save_timings=self.checkpoints.timings,
            fp8=fp8_plan.ran_line() if (fp8_plan := fp8_plan_of(self.core_model)) is not None else None,
        )

    def _step_and_save(
        self, step: int, profiler: ProfileWindow, records: list[dict[str, Any]]
    ) -> tuple[StepOutcome, Path | None]:
        """One step, its record logged, the profiler window, the checkpoint when due; a stop asked
        for while the checkpoint was written stops the run after it (the returned outcome says so)."""
        profiler.before_step(step)
        outcome = self.train_step(step)
        self.watchdog.progress(step, outcome.record["step_time_s"])
        record = dict(outcome.record)
        if self.evaluator.due(step) and not outcome.nonfinite:  # after the step's timing: not in tok/s
            record.update(self.evaluator.run(self.model))
        if not outcome.updated:
            record["skipped_update"] = True
        records.append(record)
        self.loggers.log(record)
        trace = profiler.after_step(step)
        if trace is not None and self.is_rank0:
            logger.info(
                "profiler traces of steps %s written to %s", self.cfg.logging.profile_steps, trace.parent
            )
        if outcome.diverged:
            return outcome, None
        saved = self.checkpoints.save_if_due(step, stop_requested=outcome.stop, nonfinite=outcome.nonfinite)
        self.watchdog.progress()
        if saved is not None and not outcome.stop:  # a signal that came during the save: agreed, stop now
            outcome = self.stepper.stop_asked_during_save(outcome)
        return outcome, saved

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
