"""The life of a run around its steps: where checkpoints go, resuming (``checkpoint.resume``,
``auto`` included), periodic / final / preemption saves, and the Hugging Face export at the end.

The loop calls three things: :meth:`RunLifecycle.start` (before step 1: checks ``checkpoint.dir``,
loads the checkpoint rank 0 chose, decides the run directory), :meth:`~RunLifecycle.after_step`
(saves when due, never after a non-finite step) and :meth:`~RunLifecycle.finish` (waits for a
background save, exports).

A resumed run continues the run it resumes: the run directory recorded in the checkpoint (its
``metrics.jsonl`` is cut back to the checkpoint's step and appended to, ``config.yaml`` is
rewritten) and the W&B run id recorded there (``wandb.init(id=..., resume="allow")``). The
directory this invocation was given (Hydra's) is used only when the recorded one is gone.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_gdn.errors import RecipeError
from relax_gdn.train.agreement import agree_on_errors, decided_by_rank0
from relax_gdn.train.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    Saver,
    disk_size,
    load_checkpoint,
    optimizer_reshard_problem,
    read_latest,
    read_manifest,
    resolve_resume,
    write_text_atomically,
)
from relax_gdn.train.hf_export import (
    export_spec,
    write_adapter_export,
    write_hf_export,
    write_merged_lora_export,
)

logger = logging.getLogger("relax_gdn.train")

# the scheduler fields that decide the learning rate and weight decay of every step
_SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd")


@dataclass(frozen=True)
class DataKey:
    """What the data position (the step) means: it must match between saving and resuming."""

    seed: int
    global_batch_size: int
    num_samples: int  # dataset size after skips

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    cp: int
    dynamic_cp: bool
    max_cp: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def checkpoint_root(cfg, run_dir: Path | None) -> Path | None:
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir).absolute()
    return run_dir / "checkpoints" if run_dir is not None else None


def estimated_checkpoint_bytes(model: torch.nn.Module, tp: int, on_gpu: bool) -> int:
    """An upper bound of one checkpoint's size: the parameters that train (this rank's TP shard x
    TP: the whole model, or LoRA's adapters) plus their optimizer state (fp32 Adam moments; on GPU
    also the fp32 main params)."""
    per_element = 12 if on_gpu else 8
    return sum(p.numel() * (p.element_size() + per_element) for p in model.parameters() if p.requires_grad) * tp


def lora_manifest(cfg) -> dict[str, Any] | None:
    """What a LoRA checkpoint says about its adapters and the base they belong to (None without
    LoRA): the Hugging Face directory the run started from, or the preset and the seed of its
    seeded base (``relax_gdn.model.lora.seed_base_weights``)."""
    lora = cfg.lora_options
    if lora is None:
        return None
    base = ({"hf_checkpoint": str(Path(cfg.model.hf_checkpoint).absolute())} if cfg.model.hf_checkpoint
            else {"preset": cfg.model.preset, "seed": cfg.train.seed, "init": "relax_gdn.model.lora.seed_base_weights"})
    return {"adapters": lora.as_dict(), "base": base}


def lora_resume_problem(directory: Path, saved: dict[str, Any] | None, current: dict[str, Any] | None) -> str | None:
    """Why a checkpoint's model (``saved``: its manifest's ``model.lora``) cannot continue in this
    run (``current``: :func:`lora_manifest` of it), or None: a LoRA checkpoint holds only adapters,
    which belong to their base and their shapes."""
    if saved == current:
        return None
    if current is None:
        return (f"cannot resume from {directory}: it holds only LoRA adapters ({saved['adapters']}) on the base "
                f"{saved['base']}, this run trains the whole model: resume with the checkpoint's model.lora.* "
                "(see its config in relax_gdn.json), or start from its merged export (python -m relax_gdn.export_hf)")
    if saved is None:
        return (f"cannot resume from {directory}: it is a full fine-tuning checkpoint, this run trains LoRA adapters "
                "(model.lora.rank > 0): resume with model.lora.rank=0, or start LoRA from its export "
                "(python -m relax_gdn.export_hf, then model.hf_checkpoint=<that directory>)")
    what = "base" if saved["base"] != current["base"] else "adapters"
    return (f"cannot resume from {directory}: its LoRA {what} {saved[what]} differ from this run's {current[what]}; "
            "resume with the model.lora.*, model.hf_checkpoint and train.seed the checkpoint was written with")


def checkpoints_held_at_once(checkpoint_cfg, steps: int) -> int:
    """How many checkpoints ``checkpoint.dir`` holds at the fullest: ``keep_last`` complete ones
    plus the one being written (the oldest goes only after the new one is complete), at most all
    the saves the run makes."""
    saves = steps // checkpoint_cfg.every_steps + 1 if checkpoint_cfg.every_steps else 1
    return saves if checkpoint_cfg.keep_last == 0 else min(checkpoint_cfg.keep_last + 1, saves)


def check_checkpoint_dir(root: Path, needed_bytes: int, held: int) -> None:
    """Before step 1, on every rank (all of them write shards): ``root`` can be created and written
    and has room for a checkpoint (else every rank raises the problem the first rank met: a
    collective); room for fewer than the ``held`` checkpoints the run keeps at once is a warning
    (older runs' files may yet be pruned)."""
    agree_on_errors(lambda: _check_checkpoint_dir_here(root, needed_bytes, held))


def _check_checkpoint_dir_here(root: Path, needed_bytes: int, held: int) -> None:
    problem = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write_test.rank{dist.get_rank()}"
        probe.write_bytes(b"relax-gdn")
        probe.unlink()
        free = shutil.disk_usage(root).free
        if free < needed_bytes:
            problem = (f"checkpoint.dir={str(root)!r} has {disk_size(free)} free, a checkpoint needs about "
                       f"{disk_size(needed_bytes)}: free space there or point checkpoint.dir elsewhere")
        elif free < needed_bytes * held and dist.get_rank() == 0:
            logger.warning("checkpoint.dir=%r has %s free; this run holds up to %d checkpoints of about %s there at "
                           "once (checkpoint.keep_last + the one being written): a save may fail for space; lower "
                           "checkpoint.keep_last or free space", str(root), disk_size(free), held,
                           disk_size(needed_bytes))
    except OSError as e:
        problem = (f"checkpoint.dir={str(root)!r} cannot be written on rank {dist.get_rank()} "
                   f"({type(e).__name__}: {e.strerror or e}): fix its permissions or point checkpoint.dir elsewhere")
    if problem is not None:
        raise CheckpointError(problem)


def trim_metrics(path: Path, last_step: int) -> None:
    """Keep the records of steps <= ``last_step`` (the checkpoint's): steps logged after it by the
    interrupted run are run again, and a line cut by a kill is dropped."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", last_step + 1) <= last_step:
            kept.append(line)
    write_text_atomically(path, "".join(f"{line}\n" for line in kept))


def apply_schedule(scheduler, saved: dict[str, Any], cfg, directory: Path) -> str | None:
    """Continue the saved LR schedule; a different one in this run's config is refused unless
    ``optim.reset_schedule_on_resume`` applies it from the saved step. Returns a note for the log."""
    current = scheduler.state_dict()
    changed = {k: (saved.get(k), current[k]) for k in _SCHEDULE_KEYS if saved.get(k) != current[k]}
    if not changed:
        scheduler.load_state_dict(saved)
        return None
    detail = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
    if not cfg.optim.reset_schedule_on_resume:
        raise RecipeError(
            f"the learning-rate schedule differs from the one checkpoint {directory} was trained with ({detail}; "
            "lr_decay_steps follows optim.decay_steps, else train.steps): set optim.reset_schedule_on_resume=true "
            f"to continue on this run's schedule from step {saved['num_steps']}, or resume with the saved values"
        )
    scheduler.step(increment=saved["num_steps"])
    return f"schedule changed at resume ({detail}): continuing on the new schedule from step {saved['num_steps']}"


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint rank 0 chose and checked, as every rank loads it."""

    directory: Path
    manifest: dict[str, Any]
    same_layout: bool  # written at this run's world size / TP / CP: per-rank CUDA RNG states apply
    layout: dict[str, Any]  # this run's


def plan_resume(cfg, root: Path | None, layout: Layout, data_key: DataKey, vocab_size: int,
                optimizer_form: dict[str, Any]) -> ResumePlan | None:
    """Rank 0's choice for ``checkpoint.resume`` (None: a fresh start), its notes logged, after
    checking that the checkpoint fits this run (data position, model, optimizer form)."""
    directory, notes = resolve_resume(cfg.checkpoint.resume, root)
    for note in notes:
        logger.warning("%s", note)
    if directory is None:
        return None
    manifest = read_manifest(directory)
    step, steps = int(manifest["step"]), cfg.train.steps
    if step > steps:
        raise RecipeError(f"checkpoint {directory} is at step {step}, past train.steps={steps}: raise "
                          "train.steps to train further, or resume an earlier checkpoint (checkpoint.resume=PATH)")
    saved_data = manifest.get("data", {})
    mismatched = {k: (saved_data.get(k), v) for k, v in data_key.as_dict().items() if saved_data.get(k) != v}
    if mismatched:
        detail = ", ".join(f"{k}: checkpoint {a} vs now {b}" for k, (a, b) in mismatched.items())
        raise RecipeError(f"cannot resume from {directory}: the data position would mean other batches ({detail}); "
                          "resume with the same train.seed, train.global_batch_size and data")
    saved_model = manifest.get("model", {})
    if (saved_model.get("preset"), saved_model.get("vocab_size")) != (cfg.model.preset, vocab_size):
        raise RecipeError(f"cannot resume from {directory}: it holds model.preset={saved_model.get('preset')!r} "
                          f"with vocabulary {saved_model.get('vocab_size')}, this run builds "
                          f"{cfg.model.preset!r} with {vocab_size}")
    saved_mtp, mtp = saved_model.get("mtp_num_layers", 0), cfg.model.mtp.num_layers or 0
    if saved_mtp != mtp:
        raise RecipeError(f"cannot resume from {directory}: it holds model.mtp.num_layers={saved_mtp}, this run "
                          f"builds {mtp}; resume with model.mtp.num_layers={saved_mtp}")
    problem = (lora_resume_problem(directory, saved_model.get("lora"), lora_manifest(cfg))
               or optimizer_reshard_problem(directory, manifest, optimizer_form, layout.as_dict()))
    if problem:
        raise RecipeError(problem)
    return ResumePlan(directory, manifest, manifest.get("layout") == layout.as_dict(), layout.as_dict())


@dataclass
class RunLifecycle:
    cfg: Any
    root: Path | None
    run_dir: Path | None
    saver: Saver | None
    manifest_base: dict[str, Any]
    start_step: int = 0
    resumed: LoadedCheckpoint | None = None
    wandb_run_id: str | None = None
    saved: list[Path] = field(default_factory=list)
    tokenizer_vocab_size: int | None = None  # the export trims the padded vocabulary to it
    optimizer: Any = None  # its fp32 main parameters go into the export's float32 tensors
    complete: bool = False  # the checkpoint resumed is at train.steps: no step to run, nothing rewritten

    @property
    def export_dir(self) -> Path | None:
        """Where ``checkpoint.export_hf_final`` writes: ``<run dir>/hf``."""
        return self.run_dir / "hf" if self.run_dir is not None else None

    def _export_written(self) -> bool:
        # written under another name and renamed when complete (finish): a directory here is whole
        return self.export_dir is not None and self.export_dir.is_dir()

    @classmethod
    def start(cls, cfg, *, run_dir: Path | None, layout: Layout, data_key: DataKey, model, optimizer, scheduler,
              vocab_size: int, tokenizer_vocab_size: int, device: torch.device, dp_cp_group) -> "RunLifecycle":
        """Everything before step 1 that concerns checkpoints and the run directory."""
        is_rank0 = dist.get_rank() == 0
        root = checkpoint_root(cfg, run_dir)
        wants_saves = bool(cfg.checkpoint.every_steps or cfg.checkpoint.save_final)
        if root is None and wants_saves:
            raise RecipeError("checkpoints requested (checkpoint.every_steps / save_final) but there is neither a "
                              "run directory nor checkpoint.dir")
        if root is not None and wants_saves:
            check_checkpoint_dir(root, estimated_checkpoint_bytes(model, layout.tp, device.type == "cuda"),
                                 checkpoints_held_at_once(cfg.checkpoint, cfg.train.steps))
        async_save = cfg.checkpoint.async_save and device.type == "cuda"
        if cfg.checkpoint.async_save and not async_save and is_rank0:
            logger.warning("checkpoint.async_save=true needs CUDA (Megatron-Core's async writer); this CPU run "
                           "saves inline")
        saver = Saver(root, cfg.checkpoint.keep_last, dp_cp_group, async_save=async_save) if root else None
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        source = str(Path(cfg.model.hf_checkpoint).absolute()) if cfg.model.hf_checkpoint else None
        manifest_base = {"layout": layout.as_dict(), "data": data_key.as_dict(), "config": cfg.to_dict(),
                         "model": {"preset": cfg.model.preset, "vocab_size": vocab_size, "dtype": dtype,
                                   "hf_checkpoint": source,  # the export keeps its layout
                                   "mtp_num_layers": cfg.model.mtp.num_layers or 0,
                                   "lora": lora_manifest(cfg)},
                         "tokenizer": {"vocab_size": tokenizer_vocab_size}}
        life = cls(cfg=cfg, root=root, run_dir=run_dir, saver=saver, manifest_base=manifest_base,
                   tokenizer_vocab_size=tokenizer_vocab_size, optimizer=optimizer)
        if cfg.checkpoint.resume:  # rank 0 chooses and checks the checkpoint; every rank loads that one
            plan = decided_by_rank0(lambda: plan_resume(cfg, root, layout, data_key, vocab_size,
                                                        optimizer.checkpoint_form))
            if plan is not None:
                life._resume(plan, model=model, optimizer=optimizer, scheduler=scheduler)
        if is_rank0 and life.resumed is not None and life.run_dir is not None:
            trim_metrics(life.run_dir / "metrics.jsonl", life.start_step)
        return life

    def _resume(self, plan: ResumePlan, *, model, optimizer, scheduler) -> None:
        directory, manifest = plan.directory, plan.manifest
        saved_run_dir = manifest.get("run_dir")
        if saved_run_dir and Path(saved_run_dir).is_dir():
            self.run_dir = Path(saved_run_dir)
        if self._finished(directory, int(manifest["step"])):
            return
        loaded = load_checkpoint(directory, manifest, model=model, optimizer=optimizer, same_layout=plan.same_layout)
        self.start_step = loaded.step
        if self.complete:  # loaded for the export only: the schedule and the loggers stay as they are
            return
        note = apply_schedule(scheduler, loaded.scheduler_state, self.cfg, directory)
        self.resumed = loaded
        self.wandb_run_id = manifest.get("wandb_run_id")
        if dist.get_rank() == 0:
            logger.info("resumed from step %d (%s)%s", loaded.step, directory,
                        "" if plan.same_layout else f"; resharded from {manifest.get('layout')} to {plan.layout}")
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
        export_missing = (self.cfg.checkpoint.export_hf_final and self.export_dir is not None
                          and decided_by_rank0(lambda: not self._export_written()))
        if dist.get_rank() == 0:
            logger.info("complete at step %d (%s); %s", step, directory,
                        f"nothing to train, writing its Hugging Face export to {self.export_dir}" if export_missing
                        else "nothing to do")
        return not export_missing

    def last_checkpoint(self) -> Path | None:
        """The newest complete checkpoint of ``checkpoint.dir`` (what ``latest`` names), or None."""
        return read_latest(self.root) if self.root is not None else None

    # -------------------------------------------------------------------------------- per step

    def after_step(self, step: int, *, stop_requested: bool, nonfinite: bool, model, optimizer,
                   scheduler) -> Path | None:
        """Save when due: every ``checkpoint.every_steps``, at the end whenever periodic saves are
        on (or ``save_final`` asks) and when a stop was requested; never after a step whose loss or
        grad norm was not finite (``nonfinite``: that state is not one to continue from). A
        collective."""
        if self.saver is None:
            return None
        self.saver.poll()
        if nonfinite:
            return None
        every, last = self.cfg.checkpoint.every_steps, step == self.cfg.train.steps
        if not ((every and step % every == 0) or stop_requested or (last and (every or self.cfg.checkpoint.save_final))):
            return None
        manifest = {**self.manifest_base, "wandb_run_id": self.wandb_run_id,
                    "run_dir": str(self.run_dir.absolute()) if self.run_dir is not None else None}
        path = self.saver.save(step, model=model, optimizer=optimizer, scheduler=scheduler, manifest=manifest)
        self.saved.append(path)
        return path

    def finish(self, *, completed: bool, model) -> Path | None:
        """Wait for a background save; after the last step, the HF export when asked (a finished
        run resumed again keeps the export it has)."""
        if self.saver is not None:
            self.saver.finish()
        if not (completed and self.cfg.checkpoint.export_hf_final):
            return None
        out = self.export_dir
        if out is None:
            if dist.get_rank() == 0:
                logger.warning("checkpoint.export_hf_final=true but the run has no run directory: not exported")
            return None
        if self.complete and self._export_written():
            return out
        spec, lora = export_spec(self.manifest_base), self.cfg.lora_options
        if lora is None:
            fp32_main = getattr(self.optimizer, "fp32_main_params", None)  # a bf16 run's optimizer has them
            self._log_export(_written_whole(out, lambda d: write_hf_export(model, d, spec, main_params=fp32_main)))
            return out
        if spec.like is not None:  # the adapters for the HF base, then (which takes them out) merged
            self._log_export(_written_whole(self.run_dir / "hf_adapter",
                                            lambda d: write_adapter_export(model, d, spec, dropout=lora.dropout)))
        self._log_export(_written_whole(out, lambda d: write_merged_lora_export(model, d, spec)))
        return out

    @staticmethod
    def _log_export(report) -> None:
        if report is not None:
            for line in ["Hugging Face export:", *report.lines()]:
                logger.info("%s", line)


def _written_whole(out: Path, write: Callable[[Path], Any]):
    """``write(directory)`` into a directory beside ``out``, renamed to ``out`` once whole: a
    directory named ``out`` is always a complete export. Its report (None on ranks that do not write)."""
    partial = out.with_name(f".{out.name}.partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    report = write(partial)
    if report is not None:  # the writing rank
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
        report.out = out
    return report
