"""One optimizer step: :class:`TrainStep` (``forward_backward``, ``optimizer_step``, ``train_step``).

A step is a collective: every rank plans the same global batch (a pure function of seed and
step, :func:`step_batch`), runs forward + backward over its micro-batches, the optimizer step, then
the step's ONE all-reduce (:func:`all_reduce_step`: the loss and a small vector of per-rank
:class:`StepFlag` s) and its record; :meth:`TrainStep.outcome` is the one place that decides what
the step means for the run, from all-reduced values only, so every rank decides alike.

Loss normalisation: every loss token of the global batch counts once across CP and DP. The
count is known on every rank without a collective: the global batch and its split are computed
identically on all ranks (``relax_gdn.data``), so it is ``Σ sample.num_loss_tokens`` over the
global batch. Gradients are then SUMMED over DP × CP (Megatron's ``calculate_per_token_loss``).
With a multi-token-prediction layer the objective adds ``model.mtp.loss_weight × mtp_loss``
(:mod:`relax_gdn.train.loss`) and the record ``mtp_loss``; ``loss`` stays the LM's.

Non-finite steps: the grad norm is on the host before the update (the optimizer reads it to
clip), and an update whose grad norm is not finite is not applied (a non-finite loss comes with
non-finite gradients). The loss is all-reduced as a sum, so a NaN or inf on any rank is one on
every rank, read with the step's existing host read: no flag or sync is added for it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist

from relax_gdn.config import RunConfig
from relax_gdn.data import Sample, global_batch_at_step
from relax_gdn.errors import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from relax_gdn.parallel import ParallelContext
from relax_gdn.train.flops import ModelShape
from relax_gdn.train.gradient_check import parameters_without_gradient, warn_parameters_without_gradient
from relax_gdn.train.loss import summed_token_losses, training_objective
from relax_gdn.train.metrics import HostSyncCounter, MetricsProcessor, OptimizerTimer, StepTimer
from relax_gdn.train.planner import MicroBatchPlanner, StepPlan
from relax_gdn.train.run_data import RunData
from relax_gdn.train.state import TrainState
from relax_gdn.train.stop import StopRequest

logger = logging.getLogger("relax_gdn.train")


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


def raised_flags(stop: StopRequest) -> set[StepFlag]:
    """This rank's :class:`StepFlag` s for the step's all-reduce."""
    flags = {StepFlag.STOP_REQUESTED} if stop.preempted_by is not None else set()
    return flags | ({StepFlag.INTERRUPTED} if stop.interrupted else set())


def all_reduce_step(loss_sums: torch.Tensor, raised: set[StepFlag], tp: int) -> StepTotals:
    """The step's one collective and one host read: the losses summed over DP × CP (``loss_sums``:
    the LM's, then the MTP layer's when it trains; TP ranks hold the same values, hence / tp) and
    every rank's :class:`StepFlag` s. The read waits for the device, so it ends the timed step."""
    losses = loss_sums.reshape(-1)
    flags = torch.tensor([float(flag in raised) for flag in StepFlag], device=losses.device)
    stats = torch.cat((losses / tp, flags))
    dist.all_reduce(stats)
    values = stats.tolist()
    loss_totals, flag_totals = values[: losses.numel()], values[losses.numel() :]
    return StepTotals(
        loss_totals[0],
        frozenset(flag for flag, total in zip(StepFlag, flag_totals) if total),
        mtp_loss_sum=loss_totals[1] if len(loss_totals) > 1 else None,
    )


def stop_exit_code(flags: frozenset[StepFlag]) -> int | None:
    """The exit code a stop request raised on any rank ends the run with: 75 for SIGTERM / SIGUSR1
    (a job script requeues it) over 130 for Ctrl-C; None without one."""
    if StepFlag.STOP_REQUESTED in flags:
        return PREEMPTED_EXIT_CODE
    return INTERRUPTED_EXIT_CODE if StepFlag.INTERRUPTED in flags else None


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did and what the run does after it, alike on every rank."""

    record: dict[str, Any]  # the step's metrics (the loop adds the evaluation when due)
    updated: bool  # the optimizer applied the update (optim.name=none measures gradients only)
    stop_code: int | None = None  # a rank was asked to stop: save, end the run after this step with this code
    nonfinite: bool = False  # the loss or grad norm was not finite: the update was not applied
    diverged: bool = False  # train.on_nonfinite ends the run here, saving nothing

    @property
    def stop(self) -> bool:
        return self.stop_code is not None


@dataclass(frozen=True)
class StepBatch:
    """The global batch of one step, as this rank runs it."""

    step: int  # 1-based
    epoch: int
    samples: list[Sample]  # the whole global batch (identical on every rank)
    plan: StepPlan  # this rank's micro-batches of it
    loss_tokens: int  # Σ loss tokens of the global batch: what the objective divides by
    mtp_loss_tokens: int  # the same for the MTP layer's targets (0 without one)


def step_batch(samples: list[Sample], cfg: RunConfig, planner: MicroBatchPlanner, step: int) -> StepBatch:
    """Step ``step``'s global batch (a pure function of seed and step, identical on every rank)
    planned into this rank's micro-batches."""
    epoch, batch = global_batch_at_step(samples, cfg.train.global_batch_size, cfg.train.seed, step - 1)
    return StepBatch(
        step=step,
        epoch=epoch,
        samples=batch,
        plan=planner.plan(batch),
        loss_tokens=sum(s.num_loss_tokens for s in batch),
        mtp_loss_tokens=sum(s.num_mtp_loss_tokens for s in batch) if planner.mtp else 0,
    )


@dataclass
class NonfiniteCount:
    """Steps whose loss or grad norm was not finite (their updates not applied), decided alike on
    every rank (:meth:`TrainStep.outcome`)."""

    total: int = 0
    in_a_row: int = 0


class TrainStep:
    """One optimizer step over this rank's micro-batches of the step's global batch (a collective):
    :meth:`train_step` = :func:`step_batch` -> :meth:`start_update` (the step's learning rate) ->
    :meth:`forward_backward` -> :meth:`optimizer_step` -> :func:`all_reduce_step` -> the record ->
    the gradient check -> :meth:`outcome`.

    Args:
        cfg: the run's configuration (as built).
        state: the model itself (what the gradient check reads), its optimizer (gradient sync +
            update, ``relax_gdn.train.optimizer``) and LR schedule.
        model: what runs forward/backward (on CUDA: ``state.model`` wrapped in DDP and the bf16 wrapper).
        parallel, device: the run's process groups and this rank's device (this rank's micro-batches
            of a global batch are planned over them: ``self.planner``).
        data: the run's tokenizer (its padding id) and training set (the global batches are drawn
            from its samples).
        tconfig, vocab_size: the model's TransformerConfig and vocabulary (its FLOPs for the metrics).
        stop: this process's stop requests (raised in the step's all-reduce).
        first_step: the first step this process runs (1, or the step after a resumed checkpoint).
        is_rank0: the rank that logs.
    """

    def __init__(
        self,
        *,
        cfg: RunConfig,
        state: TrainState,
        model,
        parallel: ParallelContext,
        device: torch.device,
        data: RunData,
        tconfig,
        vocab_size: int,
        stop: StopRequest,
        first_step: int,
        is_rank0: bool,
    ):
        self.cfg, self.model, self.core_model = cfg, model, state.model
        self.optimizer, self.scheduler = state.optimizer, state.scheduler
        self.stop, self.samples, self.first_step, self.is_rank0 = (
            stop,
            data.dataset.samples,
            first_step,
            is_rank0,
        )
        self.device, self.tp = device, parallel.tp
        self.planner = MicroBatchPlanner(
            parallel,
            max_tokens_per_gpu=cfg.train.max_tokens_per_gpu,
            device=device,
            pad_id=data.tokenizer.pad_id,
            route_strategy=cfg.gdn.route,
            mtp=bool(cfg.model.mtp.num_layers),
        )
        shape = ModelShape.from_transformer_config(
            tconfig, vocab_size, mtp_num_layers=cfg.model.mtp.num_layers or 0, lora=cfg.lora_options
        )
        self.metrics = MetricsProcessor(shape, parallel.tp * parallel.cp * parallel.dp, device)
        # in forward + backward only (logging.count_host_syncs)
        self.host_syncs = HostSyncCounter(enabled=self.device.type == "cuda" and cfg.logging.count_host_syncs)
        self.nonfinite = NonfiniteCount()
        self.params_without_gradient: list[str] = []  # after the first step of this process

    def train_step(self, step: int) -> StepOutcome:
        """Optimizer step ``step`` (1-based); a collective."""
        timer = StepTimer()
        batch = step_batch(self.samples, self.cfg, self.planner, step)
        lr = self.start_update()
        loss_sums = self.forward_backward(batch)
        optimizer_timer = OptimizerTimer(self.device)
        updated, grad_norm = self.optimizer_step()
        optimizer_timer.stop()
        totals = all_reduce_step(loss_sums, raised_flags(self.stop), self.tp)
        record = self.step_record(batch, totals, lr=lr, grad_norm=grad_norm, step_time_s=timer.elapsed())
        record["optimizer_time_s"] = optimizer_timer.seconds()  # the step's host read has waited
        self._log_host_syncs(step)
        self._check_gradients(step)
        return self.outcome(record, totals, updated=updated, grad_norm=grad_norm)

    def start_update(self) -> float:
        """Gradients zeroed and the schedule advanced to this step; the step's learning rate."""
        self.optimizer.zero_grad()
        self.scheduler.step(1)  # the rate of THIS step (see build_scheduler)
        return float(self.optimizer.param_groups[0]["lr"])

    def forward_backward(self, batch: StepBatch) -> torch.Tensor:
        """Gradients of the global batch's objective (train/loss.py) accumulated over this rank's
        micro-batches; returns this rank's summed per-token losses, ``[LM]`` or ``[LM, MTP]`` (on
        the device, not yet reduced over ranks)."""
        loss_sums = torch.zeros(1 + bool(self.planner.mtp), dtype=torch.float32, device=self.device)
        weight = self.cfg.model.mtp.loss_weight
        self.host_syncs.reset()
        # every micro-batch built (and its upload queued) before the first forward: the host's
        # packing never stands between one micro-batch's backward and the next forward
        for mb in [self.planner.build(planned) for planned in batch.plan.micro_batches]:
            with self.host_syncs:
                sums = summed_token_losses(self.model, mb)
                training_objective(sums, batch.loss_tokens, batch.mtp_loss_tokens, weight).backward()
            loss_sums += sums.detach()
        return loss_sums

    def optimizer_step(self) -> tuple[bool, float | None]:
        """Gradient reduction, clipping and the update: (whether it was applied, the grad norm)."""
        return self.optimizer.step()

    def step_record(
        self, batch: StepBatch, totals: StepTotals, *, lr: float, grad_norm: float | None, step_time_s: float
    ) -> dict[str, Any]:
        """The step's metrics record (metrics.jsonl's schema)."""
        plan = batch.plan
        record = self.metrics.record(
            step=batch.step,
            loss=totals.loss_sum / max(batch.loss_tokens, 1),
            grad_norm=grad_norm,
            lr=lr,
            seq_lengths=[len(s) for s in batch.samples],
            loss_tokens=batch.loss_tokens,
            padded_tokens=plan.padded_tokens,
            num_micro_batches=len(plan.micro_batches),
            epoch=batch.epoch,
            step_time_s=step_time_s,
            host_syncs=self.host_syncs.count if self.host_syncs.enabled else None,
        ).as_dict()
        if totals.mtp_loss_sum is not None:  # the MTP layer's loss, apart from the LM's (train/loss.py)
            record["mtp_loss"] = totals.mtp_loss_sum / max(batch.mtp_loss_tokens, 1)
        if plan.cp_size_counts is not None:
            record["cp_sizes"] = plan.cp_size_counts  # micro-batches per CP size, whole step
        return record

    def outcome(
        self, record: dict[str, Any], totals: StepTotals, *, updated: bool, grad_norm: float | None
    ) -> StepOutcome:
        """The one place a step's outcome is decided. From all-reduced values only (the loss sum,
        the flags, the grad norm the optimizer reduced), so every rank takes the same decision in
        the same step: a stop request, and a loss or grad norm that is not finite (its update was
        not applied; ``train.on_nonfinite`` says whether the run ends here)."""
        nonfinite = not math.isfinite(totals.loss_sum) or (
            grad_norm is not None and not math.isfinite(grad_norm)
        )
        count = self.nonfinite
        count.in_a_row = count.in_a_row + 1 if nonfinite else 0
        count.total += nonfinite
        record["nonfinite"], record["nonfinite_steps"] = nonfinite, count.total
        train = self.cfg.train
        diverged = nonfinite and (train.on_nonfinite == "stop" or count.in_a_row >= train.max_nonfinite_steps)
        return StepOutcome(
            record=record,
            updated=updated and not nonfinite,
            stop_code=stop_exit_code(totals.flags),
            nonfinite=nonfinite,
            diverged=diverged,
        )

    def stop_asked_during_save(self, outcome: StepOutcome) -> StepOutcome:
        """``outcome`` with the stop a rank was asked for while the step's checkpoint was written
        (agreed with one more small all-reduce: every rank stops after the same step)."""
        flags = all_reduce_step(torch.zeros((), device=self.device), raised_flags(self.stop), self.tp).flags
        return dataclasses.replace(outcome, stop_code=stop_exit_code(flags))

    def _check_gradients(self, step: int) -> None:
        """Once per process, after its first step: the trainable parameters its backward left
        without gradient (train/gradient_check.py)."""
        if step != self.first_step:
            return
        self.params_without_gradient = parameters_without_gradient(self.core_model, self.device)
        if self.is_rank0:
            warn_parameters_without_gradient(self.params_without_gradient, step)

    def _log_host_syncs(self, step: int) -> None:
        syncs = self.host_syncs
        if syncs.count and self.is_rank0 and step <= self.first_step + 1:  # where (first steps only)
            logger.info(
                "step %d: %d host syncs in forward+backward, at %s",
                step,
                syncs.count,
                dict(syncs.locations.most_common(8)),
            )
