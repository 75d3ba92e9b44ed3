"""Whether a checkpoint can continue this run, and what resuming it changes.

Rank 0 plans (:func:`plan_resume`: the checkpoint ``checkpoint.resume`` names, checked against this
run's data position, model, LoRA adapters and optimizer form before anything is loaded); every
rank loads what it decided (:mod:`relax_gdn.train.checkpoint_state`); then the saved LR schedule
is applied (:func:`apply_schedule`) and the run directory's ``metrics.jsonl`` is cut back to the
checkpoint's step (:func:`trim_metrics`). :class:`relax_gdn.train.checkpoint_manager.CheckpointManager`
runs the three.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_gdn.errors import RecipeError
from relax_gdn.train.checkpoint import read_manifest, resolve_resume, write_text_atomically

logger = logging.getLogger("relax_gdn.train")

# the scheduler fields that decide the learning rate and weight decay of every step
_SCHEDULE_KEYS = (
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "start_wd",
    "end_wd",
)


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


def lora_manifest(cfg) -> dict[str, Any] | None:
    """What a LoRA checkpoint says about its adapters and the base they belong to (None without
    LoRA): the Hugging Face directory the run started from, or the preset and the seed of its
    seeded base (``relax_gdn.model.lora.seed_base_weights``)."""
    lora = cfg.lora_options
    if lora is None:
        return None
    base = (
        {"hf_checkpoint": str(Path(cfg.model.hf_checkpoint).absolute())}
        if cfg.model.hf_checkpoint
        else {
            "preset": cfg.model.preset,
            "seed": cfg.train.seed,
            "init": "relax_gdn.model.lora.seed_base_weights",
        }
    )
    return {"adapters": lora.as_dict(), "base": base}


# lora_manifest's keys -> the overrides that set them
_LORA_OVERRIDE_KEYS = {
    "rank": "model.lora.rank",
    "alpha": "model.lora.alpha",
    "dropout": "model.lora.dropout",
    "modules": "model.lora.targets",
    "init_seed": "train.seed",
    "preset": "model.preset",
    "seed": "train.seed",
    "hf_checkpoint": "model.hf_checkpoint",
}


def _lora_settings(manifest: dict[str, Any]) -> dict[str, str]:
    """``override key -> its value as typed`` that build a :func:`lora_manifest`'s adapters and base."""
    settings = {}
    for key, value in [*manifest["adapters"].items(), *manifest["base"].items()]:
        if key in _LORA_OVERRIDE_KEYS:
            settings[_LORA_OVERRIDE_KEYS[key]] = (
                f"[{','.join(value)}]" if isinstance(value, (list, tuple)) else str(value)
            )
    return settings


def lora_overrides(manifest: dict[str, Any]) -> str:
    """The command-line overrides that build a :func:`lora_manifest`'s adapters and base."""
    return " ".join(f"{key}={value}" for key, value in _lora_settings(manifest).items())


def lora_resume_problem(
    directory: Path, saved: dict[str, Any] | None, current: dict[str, Any] | None
) -> str | None:
    """Why a checkpoint's model (``saved``: its manifest's ``model.lora``) cannot continue in this
    run (``current``: :func:`lora_manifest` of it), or None: a LoRA checkpoint holds only adapters,
    which belong to their base and their shapes."""
    if saved == current:
        return None
    if current is None:
        return (
            f"cannot resume from {directory}: it holds only LoRA adapters, and this run trains the whole "
            f"model. Resume with the settings it was written with ({lora_overrides(saved)}), or start from "
            "its merged export (python -m relax_gdn.export_hf, then model.hf_checkpoint=<that directory>)"
        )
    if saved is None:
        return (
            f"cannot resume from {directory}: it is a full fine-tuning checkpoint, this run trains LoRA adapters "
            "(model.lora.rank > 0): resume with model.lora.rank=0, or start LoRA from its export "
            "(python -m relax_gdn.export_hf, then model.hf_checkpoint=<that directory>)"
        )
    written, this_run = _lora_settings(saved), _lora_settings(current)
    differ = [
        f"{key}: {written.get(key, 'not set')} (this run: {this_run.get(key, 'not set')})"
        for key in dict.fromkeys([*written, *this_run])
        if written.get(key) != this_run.get(key)
    ]
    return (
        f"cannot resume from {directory}: its LoRA adapters were built on other settings ({'; '.join(differ)}). "
        f"Resume with the settings it was written with ({lora_overrides(saved)})"
    )


def optimizer_reshard_problem(
    directory: Path, manifest: dict[str, Any], optimizer_form: dict[str, Any], layout: dict[str, Any]
) -> str | None:
    """Why the optimizer state of the checkpoint in ``directory`` cannot load into this run's
    optimizer (``optimizer_form``) at this run's parallel ``layout``, or None. Checked before the
    load, so the message names the fix instead of a missing tensor key deep in the reader."""
    saved = manifest.get("optimizer")
    if not saved or optimizer_form["kind"] == "none":
        return None  # written before forms were recorded, or a run with no optimizer state to load
    if saved["kind"] != optimizer_form["kind"]:
        names = {
            "cpu_adamw": "the CPU AdamW state",
            "megatron": "Megatron-Core's distributed optimizer state",
            "none": "no optimizer state (optim.name=none)",
        }
        return (
            f"checkpoint {directory} holds {names.get(saved['kind'], saved['kind'])}, this run needs "
            f"{names.get(optimizer_form['kind'], optimizer_form['kind'])}: the two do not convert. Resume "
            "on the device type that wrote it, or start from its weights (python -m relax_gdn.export_hf, "
            "then model.hf_checkpoint=<that directory>)"
        )
    saved_tp = (manifest.get("layout") or {}).get("tp")
    if saved.get("sharding") == "dp_reshardable" and saved_tp != layout["tp"]:
        return (
            f"checkpoint {directory} was written at TP {saved_tp} with checkpoint.optimizer_sharding="
            f"dp_reshardable, whose optimizer state loads at any DP / CP but only at TP {saved_tp} (this run: "
            f"TP {layout['tp']}). Resume once at parallel.tp={saved_tp} with "
            "checkpoint.optimizer_sharding=fully_reshardable and save, then move to the new TP"
        )
    return None


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


def plan_resume(
    cfg, root: Path | None, layout: Layout, data_key: DataKey, vocab_size: int, optimizer_form: dict[str, Any]
) -> ResumePlan | None:
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
        raise RecipeError(
            f"checkpoint {directory} is at step {step}, past train.steps={steps}: raise "
            "train.steps to train further, or resume an earlier checkpoint (checkpoint.resume=PATH)"
        )
    saved_data = manifest.get("data", {})
    mismatched = {k: (saved_data.get(k), v) for k, v in data_key.as_dict().items() if saved_data.get(k) != v}
    if mismatched:
        detail = ", ".join(f"{k}: checkpoint {a} vs now {b}" for k, (a, b) in mismatched.items())
        raise RecipeError(
            f"cannot resume from {directory}: the data position would mean other batches ({detail}); "
            "resume with the same train.seed, train.global_batch_size and data"
        )
    saved_model = manifest.get("model", {})
    if (saved_model.get("preset"), saved_model.get("vocab_size")) != (cfg.model.preset, vocab_size):
        raise RecipeError(
            f"cannot resume from {directory}: it holds model.preset={saved_model.get('preset')!r} "
            f"with vocabulary {saved_model.get('vocab_size')}, this run builds "
            f"{cfg.model.preset!r} with {vocab_size}"
        )
    saved_mtp, mtp = saved_model.get("mtp_num_layers", 0), cfg.model.mtp.num_layers or 0
    if saved_mtp != mtp:
        raise RecipeError(
            f"cannot resume from {directory}: it holds model.mtp.num_layers={saved_mtp}, this run "
            f"builds {mtp}; resume with model.mtp.num_layers={saved_mtp}"
        )
    problem = lora_resume_problem(
        directory, saved_model.get("lora"), lora_manifest(cfg)
    ) or optimizer_reshard_problem(directory, manifest, optimizer_form, layout.as_dict())
    if problem:
        raise RecipeError(problem)
    return ResumePlan(directory, manifest, manifest.get("layout") == layout.as_dict(), layout.as_dict())
