"""A run's checkpoints in one place: :class:`CheckpointManager`.

The stateful objects a checkpoint holds (:class:`TrainState`: the model, the optimizer, the LR
schedule; with them the CPU and CUDA RNGs and the step, which is the data position) are registered
once, when the manager is made; the W&B run id once the loggers know it. The Trainer then calls
four things:

* :meth:`~CheckpointManager.resume` before step 1: rank 0 chooses and checks the checkpoint
  ``checkpoint.resume`` names (:func:`relax_gdn.train.resume.plan_resume`), every rank loads it
  (:func:`relax_gdn.train.checkpoint_state.load_checkpoint`, any layout), then the saved schedule
  is applied and the run directory's metrics cut back to the checkpoint's step;
* :meth:`~CheckpointManager.save_if_due` after each step: every ``checkpoint.every_steps``, at the
  end, and when a stop was requested, never after a non-finite step (inline, or in the background
  with ``checkpoint.async_save``: :class:`~relax_gdn.train.checkpoint_writer.CheckpointWriter`,
  which also keeps the newest ``checkpoint.keep_last``);
* :meth:`~CheckpointManager.finish` at the end: the background save awaited, the Hugging Face
  export written (``checkpoint.export_hf_final``);
* :meth:`~CheckpointManager.last_checkpoint`: where a stopped run continues from.

A resumed run continues the run it resumes: the run directory recorded in the checkpoint (its
``metrics.jsonl`` is cut back to the checkpoint's step and appended to, ``config.yaml`` is
rewritten) and the W&B run id recorded there (``wandb.init(id=..., resume="allow")``). The
directory this invocation was given (Hydra's) is used only when the recorded one is gone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_gdn.errors import RecipeError
from relax_gdn.model.fp8.plan import frozen_weights_on_device
from relax_gdn.train.agreement import decided_by_rank0
from relax_gdn.train.checkpoint import read_latest
from relax_gdn.train.checkpoint_disk import (
    check_checkpoint_dir,
    checkpoints_held_at_once,
    estimated_checkpoint_bytes,
)
from relax_gdn.train.checkpoint_state import LoadedCheckpoint, load_checkpoint, state_to_save
from relax_gdn.train.checkpoint_writer import CheckpointWriter
from relax_gdn.train.hf_export import export_spec, write_run_export
from relax_gdn.train.resume import (
    DataKey,
    Layout,
    ResumePlan,
    apply_schedule,
    lora_manifest,
    plan_resume,
    trim_metrics,
)
from relax_gdn.train.state import TrainState

logger = logging.getLogger("relax_gdn.train")


def checkpoint_root(cfg, run_dir: Path | None) -> Path | None:
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir).absolute()
    return run_dir / "checkpoints" if run_dir is not None else None


@dataclass(frozen=True)
class RunFacts:
    """What a checkpoint records of the run that wrote it, to check a resume against."""

    layout: Layout  # the parallel layout
    data_key: DataKey  # what the step means as a data position
    vocab_size: int  # the model's (padded) vocabulary
    tokenizer_vocab_size: int  # the tokenizer's: the export trims the padded vocabulary to it

    @classmethod
    def of(cls, cfg, dims, *, num_samples: int, vocab_size: int, tokenizer_vocab_size: int) -> RunFacts:
        """The facts of a run of ``cfg`` at the parallel sizes ``dims`` on ``num_samples`` samples."""
        dynamic = cfg.parallel.dynamic_cp.enabled
        return cls(
            layout=Layout(dims.world_size, dims.tp, dims.cp, dynamic, cfg.effective_max_cp),
            data_key=DataKey(cfg.train.seed, cfg.train.global_batch_size, num_samples),
            vocab_size=vocab_size,
            tokenizer_vocab_size=tokenizer_vocab_size,
        )


def run_manifest(cfg, facts: RunFacts, model: torch.nn.Module) -> dict[str, Any]:
    """What every checkpoint of a run records about it (``relax_gdn.json``), besides the step."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    source = str(Path(cfg.model.hf_checkpoint).absolute()) if cfg.model.hf_checkpoint else None
    return {
        "layout": facts.layout.as_dict(),
        "data": facts.data_key.as_dict(),
        "config": cfg.to_dict(),
        "model": {
            "preset": cfg.model.preset,
            "vocab_size": facts.vocab_size,
            "dtype": dtype,
            "hf_checkpoint": source,  # the export keeps its layout
            "mtp_num_layers": cfg.model.mtp.num_layers or 0,
            "lora": lora_manifest(cfg),
        },
        "tokenizer": {"vocab_size": facts.tokenizer_vocab_size},
    }


class CheckpointManager:
    """The checkpoints of one run (see the module docstring); every rank makes one and calls it at
    the same places (saving and loading are collectives).

    Args:
        cfg: the run's configuration (as built).
        run_dir: the run directory this invocation was given (rank 0's); None: none.
        state: the model, optimizer and schedule, registered once.
        dims, num_samples, vocab_size, tokenizer_vocab_size: the parallel sizes, the training set's
            size and the vocabularies, which every checkpoint records (:class:`RunFacts`).
        device: this rank's device (async saves need CUDA).
        dp_cp_group: the group the shards of replicated tensors are spread over.
        runtime: the installed :class:`relax_gdn.runtime.Runtime` (the checkpoint writer's queue).
    """

    def __init__(
        self,
        cfg,
        *,
        run_dir: Path | None,
        state: TrainState,
        dims,
        num_samples: int,
        vocab_size: int,
        tokenizer_vocab_size: int,
        device: torch.device,
        dp_cp_group,
        runtime,
    ):
        facts = RunFacts.of(
            cfg,
            dims,
            num_samples=num_samples,
            vocab_size=vocab_size,
            tokenizer_vocab_size=tokenizer_vocab_size,
        )
        self.cfg, self.state, self.facts = cfg, state, facts
        self.run_dir = run_dir  # a resumed run's: the directory its checkpoint records (resume)
        self.root = checkpoint_root(cfg, run_dir)
        self.start_step = 0
        self.resumed: LoadedCheckpoint | None = None
        self.complete = False  # the checkpoint resumed is at train.steps: no step to run, nothing rewritten
        self.wandb_run_id: str | None = None  # the resumed run's, until register_wandb_run
        self.saved: list[Path] = []
        self.writer = self._writer(device, dp_cp_group, runtime)
        self.manifest_base = run_manifest(cfg, facts, state.model)

    def _writer(self, device: torch.device, dp_cp_group, runtime) -> CheckpointWriter | None:
        """The writer when the run saves; checkpoint.dir checked before step 1."""
        cfg, root = self.cfg, self.root
        wants_saves = bool(cfg.checkpoint.every_steps or cfg.checkpoint.save_final)
        if root is None and wants_saves:
            raise RecipeError(
                "checkpoints requested (checkpoint.every_steps / save_final) but there is neither a "
                "run directory nor checkpoint.dir"
            )
        if root is not None and wants_saves:
            check_checkpoint_dir(
                root,
                estimated_checkpoint_bytes(self.state.model, self.facts.layout.tp, device.type == "cuda"),
                checkpoints_held_at_once(cfg.checkpoint, cfg.train.steps),
            )
        async_save = cfg.checkpoint.async_save and device.type == "cuda"
        if cfg.checkpoint.async_save and not async_save and dist.get_rank() == 0:
            logger.warning(
                "checkpoint.async_save=true needs CUDA (Megatron-Core's async writer); this CPU run "
                "saves inline"
            )
        if root is None:
            return None
        return CheckpointWriter(
            root,
            keep_last=cfg.checkpoint.keep_last,
            dp_cp_group=dp_cp_group,
            async_save=async_save,
            runtime=runtime,
        )

    @property
    def export_dir(self) -> Path | None:
        """Where ``checkpoint.export_hf_final`` writes: ``<run dir>/hf``."""
        return self.run_dir / "hf" if self.run_dir is not None else None

    @property
    def timings(self) -> list[tuple[int, float, float]]:
        """Per checkpoint saved: (step, seconds the loop was blocked, seconds until it was complete)."""
        return list(self.writer.timings) if self.writer is not None else []

    def register_wandb_run(self, run_id: str | None) -> None:
        """The W&B run this run logs to, recorded in its checkpoints: a resume continues it."""
        self.wandb_run_id = run_id

    # -------------------------------------------------------------------------------- resume

    def resume(self) -> int:
        """Before step 1 (a collective): the checkpoint rank 0 chose for ``checkpoint.resume``
        loaded on every rank, its schedule applied and the run directory it records continued.
        Returns the steps already done (0 for a fresh start)."""
        facts = self.facts
        if self.cfg.checkpoint.resume:  # rank 0 chooses and checks the checkpoint; every rank loads that one
            plan = decided_by_rank0(
                lambda: plan_resume(
                    self.cfg,
                    self.root,
                    facts.layout,
                    facts.data_key,
                    facts.vocab_size,
                    self.state.optimizer.checkpoint_form,
                )
            )
            if plan is not None:
                self._load(plan)
        if dist.get_rank() == 0 and self.resumed is not None and self.run_dir is not None:
            trim_metrics(self.run_dir / "metrics.jsonl", self.start_step)
        return self.start_step

    def _load(self, plan: ResumePlan) -> None:
        directory, manifest = plan.directory, plan.manifest
        saved_run_dir = manifest.get("run_dir")
        if saved_run_dir and Path(saved_run_dir).is_dir():
            self.run_dir = Path(saved_run_dir)
        if self._finished(directory, int(manifest["step"])):
            return
        loaded = load_checkpoint(
            directory,
            manifest,
            model=self.state.model,
            optimizer=self.state.optimizer,
            same_layout=plan.same_layout,
        )
        self.start_step = loaded.step
        if self.complete:  # loaded for the export only: the schedule and the loggers stay as they are
            return
        note = apply_schedule(self.state.scheduler, loaded.scheduler_state, self.cfg, directory)
        self.resumed = loaded
        self.wandb_run_id = manifest.get("wandb_run_id")
        if dist.get_rank() == 0:
            logger.info(
                "resumed from step %d (%s)%s",
                loaded.step,
                directory,
                "" if plan.same_layout else f"; resharded from {manifest.get('layout')} to {plan.layout}",
            )
            if self.run_dir is not None:
                logger.info("continuing run directory %s", self.run_dir)
            if note:
                logger.warning("%s", note)

    def _finished(self, directory: Path, step: int) -> bool:
        """A checkpoint at ``train.steps`` is a finished run: nothing to train (re-submitted or
        requeued after its last save). True when nothing needs loading either; a missing Hugging
        Face export (``checkpoint.export_hf_final``) is written from the loaded checkpoint."""
        if step < self.cfg.train.steps:  # plan_resume refused a step past it
            return False
        self.complete, self.start_step = True, step
        # rank 0 looks: whether to load is a collective decision (the load is one)
        export_missing = (
            self.cfg.checkpoint.export_hf_final
            and self.export_dir is not None
            and decided_by_rank0(lambda: not self._export_written())
        )
        if dist.get_rank() == 0:
            logger.info(
                "complete at step %d (%s); %s",
                step,
                directory,
                f"nothing to train, writing its Hugging Face export to {self.export_dir}"
                if export_missing
                else "nothing to do",
            )
        return not export_missing

    def _export_written(self) -> bool:
        # written under another name and renamed when complete (finish): a directory here is whole
        return self.export_dir is not None and self.export_dir.is_dir()

    def last_checkpoint(self) -> Path | None:
        """The newest complete checkpoint of ``checkpoint.dir`` (what ``latest`` names), or None."""
        return read_latest(self.root) if self.root is not None else None

    # -------------------------------------------------------------------------------- per step

    def save_if_due(self, step: int, *, stop_requested: bool, nonfinite: bool) -> Path | None:
        """Save when due: every ``checkpoint.every_steps``, at the end whenever periodic saves are
        on (or ``save_final`` asks) and when a stop was requested; never after a step whose loss or
        grad norm was not finite (``nonfinite``: that state is not one to continue from). A
        collective; returns where the checkpoint is (or will be, saved in the background)."""
        if self.writer is None:
            return None
        self.writer.poll()
        if nonfinite:
            return None
        every, last = self.cfg.checkpoint.every_steps, step == self.cfg.train.steps
        if not (
            (every and step % every == 0)
            or stop_requested
            or (last and (every or self.cfg.checkpoint.save_final))
        ):
            return None
        state = self.state
        manifest = {
            "optimizer": state.optimizer.checkpoint_form,
            **self.manifest_base,
            "wandb_run_id": self.wandb_run_id,
            "run_dir": str(self.run_dir.absolute()) if self.run_dir is not None else None,
        }
        with frozen_weights_on_device(state.model):  # a background save has its copy once save() returns
            path = self.writer.save(
                step,
                manifest=manifest,
                state=lambda: state_to_save(
                    step, model=state.model, optimizer=state.optimizer, scheduler=state.scheduler
                ),
            )
        self.saved.append(path)
        return path

    def finish(self, *, completed: bool) -> Path | None:
        """Wait for a background save; after the last step, the HF export when asked (a finished
        run resumed again keeps the export it has). Returns the export's directory, when written."""
        if self.writer is not None:
            self.writer.finish()
        if not (completed and self.cfg.checkpoint.export_hf_final):
            return None
        out = self.export_dir
        if out is None:
            if dist.get_rank() == 0:
                logger.warning(
                    "checkpoint.export_hf_final=true but the run has no run directory: not exported"
                )
            return None
        if self.complete and self._export_written():
            return out
        with frozen_weights_on_device(self.state.model):
            write_run_export(
                self.state.model,
                out,
                export_spec(self.manifest_base),
                lora=self.cfg.lora_options,
                main_params=self.state.optimizer.main_params,
            )
        return out
