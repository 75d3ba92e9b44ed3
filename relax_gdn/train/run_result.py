"""What a training run returns (:class:`TrainResult`); why it ended before ``train.steps``
(:class:`RunStop`) and the one line rank 0 says about that."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_gdn.config import RunConfig
from relax_gdn.errors import DIVERGED_EXIT_CODE, INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

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
    """What :func:`relax_gdn.train.run_training` returns."""

    records: list[dict[str, Any]]  # one per step run here, identical on every rank
    run_dir: Path | None
    checkpoints: list[Path] = field(default_factory=list)
    start_step: int = 0  # steps already done when this run started (resume)
    wandb_dir: str | None = None  # rank 0: the W&B run's files directory, when W&B ran
    stop: RunStop | None = None  # set when the run ended early (a stop signal, a divergence)
    nonfinite_steps: int = 0  # steps whose loss or grad norm was not finite (their updates not applied)
    # trainable parameters the first step of this process left without gradient (train/gradient_check.py)
    params_without_gradient: list[str] = field(default_factory=list)
    # per checkpoint saved: (step, seconds the loop was blocked, seconds until it was complete)
    save_timings: list[tuple[int, float, float]] = field(default_factory=list)
    fp8: str | None = (
        None  # which linear layers ran their GEMMs in FP8 (relax_gdn.model.fp8.plan), with model.fp8
    )


def how_to_continue(cfg: RunConfig, checkpoint: Path | None) -> str:
    if checkpoint is None:
        return "nothing to continue from"
    if cfg.checkpoint.resume == "auto":
        return "the same command continues from it"
    return f"continue with checkpoint.resume={checkpoint}"


def report_stop(
    cfg: RunConfig,
    step: int,
    *,
    code: int,
    preempted_by: str | None,
    saved: Path | None,
    nonfinite: bool,
    checkpoint: Path | None,
    is_rank0: bool,
) -> RunStop:
    """A rank was asked to stop after ``step`` (all-reduced ``code``: 75 or 130). ``saved``: the
    checkpoint written at the stop; ``checkpoint``: where the run continues from. Logged after the
    background save, so the checkpoint named is complete."""
    why = "Ctrl-C" if code == INTERRUPTED_EXIT_CODE else preempted_by or "SIGTERM/SIGUSR1 on another rank"
    if is_rank0:
        what = "preempted" if code == PREEMPTED_EXIT_CODE else "stopped"
        if saved is not None:
            where = f"checkpoint {saved}"
        elif nonfinite:
            where = (
                f"not saved: the step was not finite; the last good checkpoint is {checkpoint}"
                if checkpoint
                else "not saved: the step was not finite, and there is no earlier checkpoint"
            )
        else:
            where = "without a checkpoint (no run directory or checkpoint.dir)"
        logger.warning(
            "%s after step %d (%s), %s; %s; exiting with %d",
            what,
            step,
            why,
            where,
            how_to_continue(cfg, checkpoint),
            code,
        )
    return RunStop(step=step, why=why, exit_code=code, checkpoint=checkpoint)


def report_divergence(
    cfg: RunConfig, step: int, record: dict, *, in_a_row: int, checkpoint: Path | None, is_rank0: bool
) -> RunStop:
    """``train.on_nonfinite`` ended the run at ``step``: nothing saved from this state; ``checkpoint``
    is the last good one."""
    train = cfg.train
    if is_rank0:
        rule = (
            "train.on_nonfinite=stop"
            if train.on_nonfinite == "stop"
            else f"{in_a_row} in a row, train.max_nonfinite_steps={train.max_nonfinite_steps}"
        )
        last = (
            f"the last good checkpoint is {checkpoint}"
            if checkpoint is not None
            else "no checkpoint was saved before it"
        )
        logger.error(
            "step %d: loss %s, grad norm %s: not finite (%s); its update was not applied and nothing "
            "was saved; %s; %s (lower optim.lr, or train.on_nonfinite=skip to step over such "
            "batches); exiting with %d",
            step,
            record["loss"],
            record["grad_norm"],
            rule,
            last,
            how_to_continue(cfg, checkpoint),
            DIVERGED_EXIT_CODE,
        )
    return RunStop(
        step=step, why="a non-finite loss or grad norm", exit_code=DIVERGED_EXIT_CODE, checkpoint=checkpoint
    )


def report_end(
    cfg: RunConfig,
    step: int,
    outcome,
    saved: Path | None,
    *,
    preempted_by: str | None,
    in_a_row: int,
    last_checkpoint: Callable[[], Path | None],
    is_rank0: bool,
) -> RunStop:
    """What a run that ended after ``step`` (its :class:`~relax_gdn.train.step.StepOutcome`, the
    checkpoint ``saved`` then) ended with, said once by rank 0 (after the background save, so the
    checkpoint named is complete). ``last_checkpoint``: the newest complete one, asked when needed."""
    if outcome.diverged:
        return report_divergence(
            cfg, step, outcome.record, in_a_row=in_a_row, checkpoint=last_checkpoint(), is_rank0=is_rank0
        )
    return report_stop(
        cfg,
        step,
        code=outcome.stop_code,
        preempted_by=preempted_by,
        saved=saved,
        nonfinite=outcome.nonfinite,
        checkpoint=saved if saved is not None else last_checkpoint(),
        is_rank0=is_rank0,
    )
