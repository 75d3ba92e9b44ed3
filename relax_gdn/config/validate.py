"""Every cross-field rule of a run configuration, checked BEFORE any process group or model exists.

``validate(cfg, world_size)`` collects all violations and raises one :class:`ConfigError` listing
them; each message names the key(s) to change and how. Unknown keys are Hydra's job (and
:func:`relax_gdn.config.schema.run_config_from_dict`'s for hand-written dicts).

Decisions recorded here:

* ``parallel.sp=true`` with ``parallel.tp=1`` is an ERROR, not a silent no-op: sequence
  parallelism splits activations over the TP group, and a user who asked for it on one TP rank
  most likely mistyped ``parallel.tp`` (the model builder refuses the same combination).
* ``train.max_tokens_per_gpu`` must be even (the data module's rule, ``check_max_tokens_per_gpu``):
  documents are padded to multiples of ``2·cp`` and a micro-batch holds ``max_tokens_per_gpu·cp``
  tokens, so an even budget is always a whole number of ``2·cp`` units.
* ``parallel.dynamic_cp`` : ``max_cp`` must be a power of two ``== parallel.cp``. GDN head splits
  (headwise) must divide ``tp × max_cp`` where dynamic CP is on, else ``tp × cp``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from relax_gdn.choices import (
    CP_MODES,
    DATA_SOURCES,
    DEVICES,
    KERNEL_BACKENDS,
    LR_SCHEDULES,
    MODEL_ATTENTION_BACKENDS,
    MODEL_PRESETS,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_MODULES,
    RECORD_FORMATS,
    ROUTE_STRATEGIES,
    SPEC_PROVIDERS,
    SWAP_TRANSPORTS,
    WANDB_MODES,
)
from relax_gdn.config.schema import RunConfig
from relax_gdn.errors import ConfigError
from relax_gdn.model.presets import PRESETS


@dataclass(frozen=True)
class ParallelDims:
    """The mesh arithmetic in one place: world = dp × cp × tp (pipeline parallelism is not used)."""

    world_size: int
    tp: int
    cp: int

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp)


def _is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_eval(cfg: RunConfig, add) -> None:
    """``eval.*`` and ``data.eval_path``: an evaluation needs samples from one of the two."""
    ev, eval_path = cfg.eval, cfg.data.eval_path
    if not _is_int(ev.every_steps) or ev.every_steps < 0:
        add(f"eval.every_steps={ev.every_steps!r} must be an integer >= 0 (0: no evaluation)")
    if ev.num_samples is not None and (not _is_int(ev.num_samples) or ev.num_samples < 1):
        add(f"eval.num_samples={ev.num_samples!r} must be an integer >= 1 or null (all)")
    fraction_ok = isinstance(ev.holdout_fraction, (int, float)) and not isinstance(ev.holdout_fraction, bool) \
        and 0 <= ev.holdout_fraction < 1
    if not fraction_ok:
        add(f"eval.holdout_fraction={ev.holdout_fraction!r} must be a number in [0, 1)")
    if eval_path is not None and not os.path.exists(eval_path):
        add(f"data.eval_path={eval_path!r} does not exist; point it at evaluation records (jsonl/parquet/"
            "hf_disk) or drop it to hold out eval.holdout_fraction of the training set")
    if eval_path is not None and fraction_ok and ev.holdout_fraction > 0:
        add("data.eval_path and eval.holdout_fraction are both set: evaluate on the file OR on a held-out "
            "fraction (set eval.holdout_fraction=0 or data.eval_path=null)")
    if _is_int(ev.every_steps) and ev.every_steps > 0 and eval_path is None and fraction_ok \
            and ev.holdout_fraction == 0:
        add(f"eval.every_steps={ev.every_steps} needs evaluation samples: set data.eval_path=<file> or "
            "eval.holdout_fraction (e.g. 0.05)")


def validate(cfg: RunConfig, world_size: int) -> ParallelDims:
    """Raise :class:`ConfigError` naming every broken rule; return the parallel dims otherwise."""
    problems: list[str] = []
    add = problems.append
    par, gdn, train, optim, data = cfg.parallel, cfg.gdn, cfg.train, cfg.optim, cfg.data

    # --- choices ---------------------------------------------------------------------------
    choices = [
        ("model.preset", cfg.model.preset, MODEL_PRESETS),
        ("model.spec_provider", cfg.model.spec_provider, SPEC_PROVIDERS),
        ("model.attention_backend", cfg.model.attention_backend, MODEL_ATTENTION_BACKENDS),
        ("gdn.cp_mode", gdn.cp_mode, CP_MODES),
        ("gdn.route", gdn.route, ROUTE_STRATEGIES),
        ("gdn.kernel_backend", gdn.kernel_backend, KERNEL_BACKENDS),
        ("gdn.swap_transport", gdn.swap_transport, SWAP_TRANSPORTS),
        ("recompute.granularity", cfg.recompute.granularity, RECOMPUTE_GRANULARITIES),
        ("data.source", data.source, DATA_SOURCES),
        ("data.format", data.format, RECORD_FORMATS),
        ("train.precision", train.precision, PRECISIONS),
        ("train.device", train.device, DEVICES),
        ("optim.name", optim.name, OPTIMIZERS),
        ("optim.schedule", optim.schedule, LR_SCHEDULES),
        ("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES),
    ]
    for key, value, allowed in choices:
        if value not in allowed:
            add(f"{key}={value!r} is not one of {list(allowed)}")
    unknown_modules = sorted(set(cfg.recompute.modules or ()) - set(RECOMPUTE_MODULES))
    if unknown_modules:
        add(f"recompute.modules has {unknown_modules}, not among {list(RECOMPUTE_MODULES)}")

    # --- mesh: world = dp x cp x tp --------------------------------------------------------
    sizes_ok = True
    for key, value in (("parallel.tp", par.tp), ("parallel.cp", par.cp)):
        if not _is_int(value) or value < 1:
            add(f"{key}={value!r} must be an integer >= 1")
            sizes_ok = False
    if not _is_int(world_size) or world_size < 1:
        add(f"world size {world_size!r} must be an integer >= 1 (torchrun --nproc-per-node / WORLD_SIZE)")
        sizes_ok = False
    if sizes_ok and world_size % (par.tp * par.cp):
        add(
            f"world size {world_size} is not divisible by parallel.tp x parallel.cp = {par.tp} x {par.cp} = "
            f"{par.tp * par.cp}: data parallel = world / (tp*cp) must be a whole number; change parallel.tp, "
            "parallel.cp or the number of processes"
        )
        sizes_ok = False
    dims = ParallelDims(world_size, par.tp, par.cp) if sizes_ok else None

    if not _is_int(gdn.max_recomputed_prefix) or gdn.max_recomputed_prefix < 0:
        add(f"gdn.max_recomputed_prefix={gdn.max_recomputed_prefix!r} must be an integer >= 0 tokens "
            "(0: chunkwise always passes the recurrent state between ranks)")
    if not isinstance(gdn.contiguous_between_layers, bool):
        add(f"gdn.contiguous_between_layers={gdn.contiguous_between_layers!r} must be true or false")

    # --- sequence parallelism --------------------------------------------------------------
    if par.sp and sizes_ok and par.tp == 1:
        add("parallel.sp=true needs parallel.tp > 1 (sequence parallelism splits activations over TP ranks); "
            "set parallel.sp=false or parallel.tp >= 2")

    # --- profiling window ------------------------------------------------------------------
    window = cfg.logging.profile_steps
    if window is not None:
        ok = (isinstance(window, (list, tuple)) and len(window) == 2 and all(_is_int(v) for v in window)
              and 1 <= window[0] <= window[1])
        if not ok:
            add(f"logging.profile_steps={window!r} must be null or [first, last] with 1 <= first <= last "
                "(steps to trace with the torch profiler), e.g. logging.profile_steps=[10,12]")

    # --- dynamic CP -------------------------------------------------------------------------
    dyn = par.dynamic_cp
    if dyn.enabled and sizes_ok:
        if not _is_power_of_two(dyn.max_cp):
            add(f"parallel.dynamic_cp.max_cp={dyn.max_cp!r} must be a power of two (CP groups of 1, 2, 4, ...)")
        elif dyn.max_cp != par.cp:
            add(f"parallel.dynamic_cp.max_cp={dyn.max_cp} must equal parallel.cp={par.cp}: each micro-batch runs at "
                "a CP size d <= max_cp on the sub-groups of size d of the static CP group; set both to the same value")

    # --- heads vs TP / CP --------------------------------------------------------------------
    preset = PRESETS.get(cfg.model.preset)
    if preset is not None and sizes_ok:
        shapes = preset.config
        for name in ("num_attention_heads", "num_query_groups", "linear_num_key_heads", "linear_num_value_heads"):
            if shapes[name] % par.tp:
                add(f"model.preset={preset.name} has {name}={shapes[name]}, not divisible by parallel.tp={par.tp}")
        max_cp = cfg.effective_max_cp if _is_int(cfg.effective_max_cp) and cfg.effective_max_cp >= 1 else par.cp
        if gdn.cp_mode == "headwise" and max_cp > 1:
            for name in ("linear_num_key_heads", "linear_num_value_heads"):
                if shapes[name] % (par.tp * max_cp):
                    add(
                        f"gdn.cp_mode=headwise splits GDN heads over TP x CP but model.preset={preset.name} has "
                        f"{name}={shapes[name]}, not divisible by parallel.tp x cp = {par.tp} x {max_cp}; use "
                        "gdn.cp_mode=chunkwise or a smaller parallel.cp"
                    )

    # --- GDN mode vs recompute / determinism ---------------------------------------------------
    cp_in_use = sizes_ok and (par.cp > 1)
    if gdn.cp_mode == "all_gather" and cp_in_use and cfg.recompute.granularity != "full":
        add(
            "gdn.cp_mode=all_gather recomputes the whole sequence on every CP rank (activations grow with the "
            f"global length): it needs recompute.granularity=full (got {cfg.recompute.granularity!r})"
        )
    if gdn.cp_mode == "chunkwise" and cp_in_use and train.deterministic:
        add("gdn.cp_mode=chunkwise uses FLA's non-deterministic CP kernels: set train.deterministic=false or "
            "use gdn.cp_mode=headwise")

    # --- batch / tokens ---------------------------------------------------------------------
    if not _is_int(train.steps) or train.steps < 1:
        add(f"train.steps={train.steps!r} must be an integer >= 1")
    if not _is_int(train.global_batch_size) or train.global_batch_size < 1:
        add(f"train.global_batch_size={train.global_batch_size!r} must be an integer >= 1")
    elif dims is not None and train.global_batch_size % dims.dp:
        add(
            f"train.global_batch_size={train.global_batch_size} is not divisible by the data-parallel size "
            f"{dims.dp} (= world {world_size} / (tp {par.tp} x cp {par.cp})): every DP rank takes the same "
            "number of samples; use a multiple of the DP size"
        )
    mtpg = train.max_tokens_per_gpu
    if not _is_int(mtpg) or mtpg < 2 or mtpg % 2:
        add(f"train.max_tokens_per_gpu={mtpg!r} must be an even integer >= 2 (documents are padded to multiples "
            "of 2*cp; the per-GPU budget must hold a whole number of those units)")
    elif sizes_ok and _is_int(data.max_sample_tokens) and _is_int(cfg.effective_max_cp) and \
            data.max_sample_tokens > mtpg * cfg.effective_max_cp:
        cp_key = "parallel.dynamic_cp.max_cp" if dyn.enabled else "parallel.cp"
        add(
            f"data.max_sample_tokens={data.max_sample_tokens} exceeds what one micro-batch holds, "
            f"train.max_tokens_per_gpu x {cp_key} = {mtpg} x {cfg.effective_max_cp} = "
            f"{mtpg * cfg.effective_max_cp}: lower data.max_sample_tokens or raise train.max_tokens_per_gpu"
        )
    if data.max_sample_tokens is not None and (not _is_int(data.max_sample_tokens) or data.max_sample_tokens < 2):
        add(f"data.max_sample_tokens={data.max_sample_tokens!r} must be an integer >= 2 or null")

    # --- data source ----------------------------------------------------------------------------
    if data.source == "synthetic":
        if not _is_int(data.num_samples) or data.num_samples < 1:
            add(f"data.num_samples={data.num_samples!r} must be an integer >= 1 for data.source=synthetic")
        elif _is_int(train.global_batch_size) and data.num_samples < train.global_batch_size:
            add(f"data.num_samples={data.num_samples} is below train.global_batch_size={train.global_batch_size}")
    elif data.source in DATA_SOURCES:
        if not data.path:
            add(f"data.path is required for data.source={data.source} (a file or directory to read)")
        elif not os.path.exists(data.path):
            add(f"data.path={data.path!r} does not exist (data.source={data.source}); point it at the data file "
                "or directory")
    _check_eval(cfg, add)
    if data.tokenizer is None:
        add(f"data.tokenizer is required for data.source={data.source}: a local Hugging Face tokenizer directory "
            "(e.g. the checkpoint's), or 'embedded'")
    elif data.tokenizer not in ("embedded", "byte") and not os.path.isdir(str(data.tokenizer)):
        add(f"data.tokenizer={data.tokenizer!r} is neither 'embedded' nor an existing local Hugging Face "
            "tokenizer directory")
    if cfg.model.hf_checkpoint is not None and not os.path.isdir(cfg.model.hf_checkpoint):
        add(f"model.hf_checkpoint={cfg.model.hf_checkpoint!r} is not a directory (a local HF checkpoint)")

    # --- optimizer ------------------------------------------------------------------------------
    if not optim.lr > 0:
        add(f"optim.lr={optim.lr!r} must be > 0")
    if not 0 <= optim.min_lr <= optim.lr:
        add(f"optim.min_lr={optim.min_lr!r} must be within [0, optim.lr={optim.lr}]")
    warmup = optim.warmup_steps
    if not isinstance(warmup, (int, float)) or isinstance(warmup, bool) or warmup < 0 or \
            (warmup >= 1 and warmup != int(warmup)):
        add(f"optim.warmup_steps={warmup!r} must be a fraction of train.steps in [0, 1) (e.g. 0.1) or a "
            "whole number of steps")
    if optim.decay_steps is not None and (not _is_int(optim.decay_steps) or optim.decay_steps < 1):
        add(f"optim.decay_steps={optim.decay_steps!r} must be an integer >= 1 or null")
    for key, beta in (("optim.beta1", optim.beta1), ("optim.beta2", optim.beta2)):
        if not 0 <= beta < 1:
            add(f"{key}={beta!r} must be in [0, 1)")
    if optim.weight_decay < 0:
        add(f"optim.weight_decay={optim.weight_decay!r} must be >= 0")
    if optim.clip_grad < 0:
        add(f"optim.clip_grad={optim.clip_grad!r} must be >= 0 (0 disables clipping)")

    # --- logging / checkpoint ---------------------------------------------------------------------
    if not _is_int(cfg.logging.log_every) or cfg.logging.log_every < 1:
        add(f"logging.log_every={cfg.logging.log_every!r} must be an integer >= 1")
    if not _is_int(cfg.checkpoint.every_steps) or cfg.checkpoint.every_steps < 0:
        add(f"checkpoint.every_steps={cfg.checkpoint.every_steps!r} must be an integer >= 0 (0: no periodic saves)")
    if cfg.checkpoint.resume not in (None, "auto") and not os.path.isdir(cfg.checkpoint.resume):
        add(f"checkpoint.resume={cfg.checkpoint.resume!r} is not a directory (a step_NNNNNN checkpoint or its parent) "
            "nor auto")
    if cfg.checkpoint.resume == "auto" and not cfg.checkpoint.dir:
        add("checkpoint.resume=auto needs checkpoint.dir (the directory its checkpoints are saved in and read from)")
    if not _is_int(cfg.checkpoint.keep_last) or cfg.checkpoint.keep_last < 0:
        add(f"checkpoint.keep_last={cfg.checkpoint.keep_last!r} must be an integer >= 0 (0: keep every checkpoint)")

    if problems:
        raise ConfigError(problems)
    assert dims is not None
    return dims
