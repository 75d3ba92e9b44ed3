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
* ``parallel.dynamic_cp``: the largest CP size is ``parallel.cp`` (``max_cp``, if given, must equal
  it), a power of two. GDN head splits (headwise) must divide ``tp × cp``.

The GDN rules are :func:`relax_gdn.gdn.options.gdn_cp_problems`'s, the same the layer checks
when it is built; each group's rules are one function below.
"""

from __future__ import annotations

import os

from relax_gdn.choices import (
    DATA_SOURCES,
    DEVICES,
    LR_SCHEDULES,
    MODEL_ATTENTION_BACKENDS,
    MODEL_PRESETS,
    NONFINITE_POLICIES,
    OPTIMIZER_CHECKPOINT_SHARDINGS,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_MODULES,
    RECORD_FORMATS,
    SPEC_PROVIDERS,
    WANDB_MODES,
    choice_problem,
)
from relax_gdn.config.mesh import ParallelDims
from relax_gdn.config.schema import LoRAConfig, RunConfig
from relax_gdn.errors import ConfigError
from relax_gdn.gdn.options import gdn_option_problems, gdn_shape_problems
from relax_gdn.model.fp8.options import fp8_problems
from relax_gdn.model.lora_options import lora_problems
from relax_gdn.model.presets import PRESETS


def _is_power_of_two(n: int) -> bool:
    return _is_int(n) and n >= 1 and n & (n - 1) == 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_eval(cfg: RunConfig, add) -> None:
    """``eval.*`` and ``data.eval_path``: an evaluation needs samples from one of the two."""
    ev, eval_path = cfg.eval, cfg.data.eval_path
    if not _is_int(ev.every_steps) or ev.every_steps < 0:
        add(f"eval.every_steps={ev.every_steps!r} must be an integer >= 0 (0: no evaluation)")
    if ev.num_samples is not None and (not _is_int(ev.num_samples) or ev.num_samples < 1):
        add(f"eval.num_samples={ev.num_samples!r} must be an integer >= 1 or null (all)")
    fraction_ok = (
        isinstance(ev.holdout_fraction, (int, float))
        and not isinstance(ev.holdout_fraction, bool)
        and 0 <= ev.holdout_fraction < 1
    )
    if not fraction_ok:
        add(f"eval.holdout_fraction={ev.holdout_fraction!r} must be a number in [0, 1)")
    if eval_path is not None and not os.path.exists(eval_path):
        add(
            f"data.eval_path={eval_path!r} does not exist; point it at evaluation records (jsonl/parquet/"
            "hf_disk) or drop it to hold out eval.holdout_fraction of the training set"
        )
    if eval_path is not None and fraction_ok and ev.holdout_fraction > 0:
        add(
            "data.eval_path and eval.holdout_fraction are both set: evaluate on the file OR on a held-out "
            "fraction (set eval.holdout_fraction=0 or data.eval_path=null)"
        )
    if (
        _is_int(ev.every_steps)
        and ev.every_steps > 0
        and eval_path is None
        and fraction_ok
        and ev.holdout_fraction == 0
    ):
        add(
            f"eval.every_steps={ev.every_steps} needs evaluation samples: set data.eval_path=<file> or "
            "eval.holdout_fraction (e.g. 0.05)"
        )


def validate(cfg: RunConfig, world_size: int) -> ParallelDims:
    """Raise :class:`ConfigError` naming every broken rule; return the parallel dims otherwise."""
    dims, problems = _mesh(cfg, world_size)
    problems += _choices(cfg)
    if dims is not None:
        problems += _model_and_gdn(cfg, dims)
    problems += _parallel(cfg, dims)
    problems += _batch(cfg, dims)
    problems += _safety(cfg)
    problems += _data(cfg)
    problems += _optim(cfg)
    problems += _logging_and_checkpoint(cfg)
    _check_eval(cfg, problems.append)
    if problems:
        raise ConfigError(problems)
    assert dims is not None
    return dims


def _choices(cfg: RunConfig) -> list[str]:
    """Every ``Literal`` field of the schema holds one of its options (the ``gdn.*`` ones: the GDN rules)."""
    m = cfg.model
    fields = [
        ("model.preset", m.preset, MODEL_PRESETS),
        ("model.spec_provider", m.spec_provider, SPEC_PROVIDERS),
        ("model.attention_backend", m.attention_backend, MODEL_ATTENTION_BACKENDS),
        ("recompute.granularity", cfg.recompute.granularity, RECOMPUTE_GRANULARITIES),
        ("data.source", cfg.data.source, DATA_SOURCES),
        ("data.format", cfg.data.format, RECORD_FORMATS),
        ("train.precision", cfg.train.precision, PRECISIONS),
        ("train.device", cfg.train.device, DEVICES),
        ("train.on_nonfinite", cfg.train.on_nonfinite, NONFINITE_POLICIES),
        ("optim.name", cfg.optim.name, OPTIMIZERS),
        ("optim.schedule", cfg.optim.schedule, LR_SCHEDULES),
        ("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES),
        ("checkpoint.optimizer_sharding", cfg.checkpoint.optimizer_sharding, OPTIMIZER_CHECKPOINT_SHARDINGS),
    ]
    problems = [p for key, value, allowed in fields if (p := choice_problem(key, value, allowed))]
    unknown_modules = sorted(set(cfg.recompute.modules or ()) - set(RECOMPUTE_MODULES))
    if unknown_modules:
        problems.append(f"recompute.modules has {unknown_modules}, not among {list(RECOMPUTE_MODULES)}")
    problems += _full_layers(cfg)
    problems += _mtp(cfg)
    problems += _fp8(cfg)
    lora, lora_defaults = cfg.model.lora, LoRAConfig()
    problems += lora_problems(
        lora.rank,
        lora.alpha,
        lora.dropout,
        lora.targets,
        spec_provider=m.spec_provider,
        fused_cross_entropy=m.fused_cross_entropy,
        set_without_rank=[
            k for k in ("targets", "alpha", "dropout") if getattr(lora, k) != getattr(lora_defaults, k)
        ],
    )
    if not isinstance(cfg.gdn.contiguous_between_layers, bool):
        problems.append(
            f"gdn.contiguous_between_layers={cfg.gdn.contiguous_between_layers!r} must be true or false"
        )
    return problems + gdn_option_problems(cfg.gdn_options)


def _mtp(cfg: RunConfig) -> list[str]:
    """``model.mtp.*``: 0, 1 (Qwen3.5's one MTP layer) or null (as ``model.hf_checkpoint`` has, resolved
    before the model is built: ``relax_gdn.train.build.resolve_mtp_layers``, which validates again),
    a positive loss weight, and the local specs."""
    mtp, problems = cfg.model.mtp, []
    layers = mtp.num_layers
    if layers is not None and (not _is_int(layers) or layers not in (0, 1)):
        problems.append(
            f"model.mtp.num_layers={layers!r} must be 0 (off), 1 (Qwen3.5's one MTP layer: mtp.fc, "
            "mtp.layers.0, mtp.norm) or null (as model.hf_checkpoint has)"
        )
    weight = mtp.loss_weight
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 < weight < float("inf"):
        problems.append(
            f"model.mtp.loss_weight={weight!r} must be a number > 0 (the MTP loss's weight in the "
            "objective, e.g. 0.1); model.mtp.num_layers=0 turns the MTP layer off"
        )
    if layers == 1 and cfg.model.spec_provider == "te":
        problems.append(
            "model.mtp.num_layers=1 (or null with a model.hf_checkpoint that holds an MTP layer) builds "
            "the MTP layer from the local specs, not Transformer Engine's: "
            "use model.spec_provider=auto (or local), or model.mtp.num_layers=0"
        )
    if layers == 1 and cfg.model.lora.rank:
        # LoRA trains adapters on a frozen base; an MTP layer trained whole beside them is another recipe
        problems.append(
            f"model.mtp.num_layers=1 with model.lora.rank={cfg.model.lora.rank}: a LoRA run trains "
            "adapters only and does not train an MTP layer; use model.mtp.num_layers=0 (a checkpoint's "
            "MTP layer is copied into the export unchanged) or model.lora.rank=0"
        )
    return problems


def _fp8(cfg: RunConfig) -> list[str]:
    """``model.fp8.*`` (relax_gdn.model.fp8.options); the GPU's FP8 tensor cores are a machine rule
    (relax_gdn.config.machine)."""
    fp8 = cfg.model.fp8
    if fp8.recipe is None:
        return []
    if not isinstance(fp8.bf16_modules, (list, tuple)) or not all(
        isinstance(p, str) for p in fp8.bf16_modules
    ):
        return [
            f"model.fp8.bf16_modules={fp8.bf16_modules!r} must be a list of module-name patterns "
            "(e.g. [output_layer, 'decoder.layers.0.*'])"
        ]
    return fp8_problems(
        fp8.recipe,
        fp8.bf16_modules,
        spec_provider=cfg.model.spec_provider,
        fused_cross_entropy=cfg.model.fused_cross_entropy,
    )


def _full_layers(cfg: RunConfig) -> list[str]:
    """``recompute.full_layers``: null or 0..num_layers, and only with ``recompute.granularity=mixed``."""
    n, granularity = cfg.recompute.full_layers, cfg.recompute.granularity
    if n is None:
        return []
    if granularity != "mixed":
        return [
            f"recompute.full_layers={n!r} applies to recompute.granularity=mixed only (got {granularity!r}); "
            "set recompute.granularity=mixed or recompute.full_layers=null"
        ]
    preset = PRESETS.get(cfg.model.preset)
    layers = preset.config["num_layers"] if preset is not None else None
    if not _is_int(n) or n < 0 or (layers is not None and n > layers):
        return [
            f"recompute.full_layers={n!r} must be null (the memory model chooses) or an integer from 0 to the "
            f"model's {layers} layers"
        ]
    return []


def _mesh(cfg: RunConfig, world_size: int) -> tuple[ParallelDims | None, list[str]]:
    """world = dp x cp x tp with whole numbers."""
    par, problems = cfg.parallel, []
    for key, value in (("parallel.tp", par.tp), ("parallel.cp", par.cp)):
        if not _is_int(value) or value < 1:
            problems.append(f"{key}={value!r} must be an integer >= 1")
    if not _is_int(world_size) or world_size < 1:
        problems.append(
            f"world size {world_size!r} must be an integer >= 1 (torchrun --nproc-per-node / WORLD_SIZE)"
        )
    if problems:
        return None, problems
    model_parallel = par.tp * par.cp
    if world_size % model_parallel:
        processes = -(-world_size // model_parallel) * model_parallel  # the next whole number of DP ranks
        return None, [
            f"world size {world_size} is not divisible by parallel.tp x parallel.cp = {par.tp} x {par.cp} = "
            f"{model_parallel}: data parallel = world / (tp*cp) must be a whole number; change parallel.tp, "
            f"parallel.cp or the number of processes (on one node: python -m relax_gdn.launch "
            f"--nproc-per-node {processes} train.py ...)"
        ]
    return ParallelDims(world_size, par.tp, par.cp), []


def _model_and_gdn(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    """Head counts of the preset against TP (attention) and the GDN rules (relax_gdn.gdn.options)."""
    preset = PRESETS.get(cfg.model.preset)
    max_cp = cfg.effective_max_cp
    if preset is None or not _is_int(max_cp) or max_cp < 1:
        return []  # reported by _choices / _parallel
    shapes = preset.config
    problems = [
        f"{name}={shapes[name]} is not divisible by parallel.tp={dims.tp} (model.preset={preset.name})"
        for name in ("num_attention_heads", "num_query_groups")
        if shapes[name] % dims.tp
    ]
    return problems + gdn_shape_problems(
        cfg.gdn_options,
        key_heads=shapes["linear_num_key_heads"],
        value_heads=shapes["linear_num_value_heads"],
        tp_size=dims.tp,
        max_cp_size=max_cp,
        deterministic=cfg.train.deterministic,
        recompute_granularity=cfg.recompute.granularity,
    )


def _parallel(cfg: RunConfig, dims: ParallelDims | None) -> list[str]:
    """Sequence parallelism and dynamic CP."""
    par, problems = cfg.parallel, []
    if par.sp and dims is not None and par.tp == 1:
        problems.append(
            "parallel.sp=true needs parallel.tp > 1 (sequence parallelism splits activations over TP "
            "ranks); set parallel.sp=false or parallel.tp >= 2"
        )
    dyn = par.dynamic_cp
    if dyn.enabled and dims is not None:
        # max_cp left out is parallel.cp: the CP size the static group has
        key, max_cp = (
            ("parallel.cp", par.cp) if dyn.max_cp is None else ("parallel.dynamic_cp.max_cp", dyn.max_cp)
        )
        if not _is_power_of_two(max_cp):
            problems.append(
                f"{key}={max_cp!r} must be a power of two with parallel.dynamic_cp.enabled=true (CP groups "
                "of 1, 2, 4, ...)"
            )
        elif dyn.max_cp is not None and dyn.max_cp != par.cp:
            problems.append(
                f"parallel.dynamic_cp.max_cp={dyn.max_cp} must equal parallel.cp={par.cp}: each micro-batch runs at "
                "a CP size d <= max_cp on the sub-groups of size d of the static CP group; set both to the same value"
            )
    return problems


def _batch(cfg: RunConfig, dims: ParallelDims | None) -> list[str]:
    """Steps, global batch against DP, the per-GPU token budget against the longest sample."""
    train, data, problems = cfg.train, cfg.data, []
    if not _is_int(train.steps) or train.steps < 1:
        problems.append(f"train.steps={train.steps!r} must be an integer >= 1")
    if not _is_int(train.global_batch_size) or train.global_batch_size < 1:
        problems.append(f"train.global_batch_size={train.global_batch_size!r} must be an integer >= 1")
    elif dims is not None and train.global_batch_size % dims.dp:
        problems.append(
            f"train.global_batch_size={train.global_batch_size} is not divisible by the data-parallel size "
            f"{dims.dp} (= world {dims.world_size} / (tp {dims.tp} x cp {dims.cp})): every DP rank takes the same "
            "number of samples; use a multiple of the DP size"
        )
    mtpg, max_cp = train.max_tokens_per_gpu, cfg.effective_max_cp
    if not _is_int(mtpg) or mtpg < 2 or mtpg % 2:
        problems.append(
            f"train.max_tokens_per_gpu={mtpg!r} must be an even integer >= 2 (documents are padded to "
            "multiples of 2*cp; the per-GPU budget must hold a whole number of those units)"
        )
    elif (
        dims is not None
        and _is_int(data.max_sample_tokens)
        and _is_int(max_cp)
        and data.max_sample_tokens > mtpg * max_cp
    ):
        cp_key = "parallel.dynamic_cp.max_cp" if cfg.parallel.dynamic_cp.enabled else "parallel.cp"
        problems.append(
            f"data.max_sample_tokens={data.max_sample_tokens} exceeds what one micro-batch holds, "
            f"train.max_tokens_per_gpu x {cp_key} = {mtpg} x {max_cp} = {mtpg * max_cp}: lower "
            "data.max_sample_tokens (or set it to null: skip what does not fit) or raise train.max_tokens_per_gpu"
        )
    if data.max_sample_tokens is not None and (
        not _is_int(data.max_sample_tokens) or data.max_sample_tokens < 2
    ):
        problems.append(f"data.max_sample_tokens={data.max_sample_tokens!r} must be an integer >= 2 or null")
    return problems


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _safety(cfg: RunConfig) -> list[str]:
    """What ends a run that goes wrong: non-finite steps, collective and step timeouts."""
    train, problems = cfg.train, []
    if not _is_int(train.max_nonfinite_steps) or train.max_nonfinite_steps < 1:
        problems.append(
            f"train.max_nonfinite_steps={train.max_nonfinite_steps!r} must be an integer >= 1 (the "
            "non-finite steps in a row that end a run with train.on_nonfinite=skip)"
        )
    if not _is_number(train.collective_timeout_s) or train.collective_timeout_s <= 0:
        problems.append(
            f"train.collective_timeout_s={train.collective_timeout_s!r} must be a number of seconds > 0"
        )
    hang = train.hang_timeout_s
    if hang is not None and hang != "auto" and (not _is_number(hang) or hang <= 0):
        problems.append(
            f"train.hang_timeout_s={hang!r} must be a number of seconds > 0, auto (from the run's "
            "median step time) or null (no watchdog)"
        )
    return problems


def _data(cfg: RunConfig) -> list[str]:
    """The source's files and sizes, the tokenizer, the checkpoint to start from."""
    data, train, problems = cfg.data, cfg.train, []
    if data.source == "synthetic":
        if not _is_int(data.num_samples) or data.num_samples < 1:
            problems.append(
                f"data.num_samples={data.num_samples!r} must be an integer >= 1 for data.source=synthetic"
            )
        elif _is_int(train.global_batch_size) and data.num_samples < train.global_batch_size:
            problems.append(
                f"data.num_samples={data.num_samples} is below train.global_batch_size="
                f"{train.global_batch_size}"
            )
    elif data.source in DATA_SOURCES:
        if not data.path:
            problems.append(
                f"data.path is required for data.source={data.source} (a file or directory to read)"
            )
        elif not os.path.exists(data.path):
            problems.append(missing_data_path(data.path, data.source))
    if data.tokenizer is None:
        problems.append(
            f"data.tokenizer is required for data.source={data.source}: a local Hugging Face tokenizer "
            "directory (e.g. the checkpoint's), or 'embedded'"
        )
    elif data.tokenizer not in ("embedded", "byte") and not os.path.isdir(str(data.tokenizer)):
        problems.append(
            f"data.tokenizer={data.tokenizer!r} is neither 'embedded' nor an existing local Hugging Face "
            "tokenizer directory"
        )
    if cfg.model.hf_checkpoint is not None and not os.path.isdir(cfg.model.hf_checkpoint):
        problems.append(
            f"model.hf_checkpoint={cfg.model.hf_checkpoint!r} is not a directory (a local HF checkpoint)"
        )
    return problems


def missing_data_path(path: str, source: str) -> str:
    """The one wording for a ``data.path`` that is not there; a relative one names the directory it
    was looked for from (``train.py`` reads paths from where it was started)."""
    where = "" if os.path.isabs(path) else f", looked for from {os.getcwd()}"
    return (
        f"data.path={path!r} does not exist (data.source={source}{where}); point it at the data file or "
        "directory"
    )


def _optim(cfg: RunConfig) -> list[str]:
    optim, problems = cfg.optim, []
    if cfg.model.preset in PRESETS:  # an unknown preset is reported with the model keys
        lr, min_lr = cfg.learning_rates
        if not lr > 0:
            problems.append(f"optim.lr={lr!r} must be > 0")
        if not 0 <= min_lr <= lr:
            problems.append(f"optim.min_lr={min_lr!r} must be within [0, optim.lr={lr}]")
    warmup = optim.warmup_steps
    if (
        not isinstance(warmup, (int, float))
        or isinstance(warmup, bool)
        or warmup < 0
        or (warmup >= 1 and warmup != int(warmup))
    ):
        problems.append(
            f"optim.warmup_steps={warmup!r} must be a fraction of train.steps in [0, 1) (e.g. 0.1) or "
            "a whole number of steps"
        )
    if optim.decay_steps is not None and (not _is_int(optim.decay_steps) or optim.decay_steps < 1):
        problems.append(f"optim.decay_steps={optim.decay_steps!r} must be an integer >= 1 or null")
    for key, beta in (("optim.beta1", optim.beta1), ("optim.beta2", optim.beta2)):
        if not 0 <= beta < 1:
            problems.append(f"{key}={beta!r} must be in [0, 1)")
    if optim.weight_decay < 0:
        problems.append(f"optim.weight_decay={optim.weight_decay!r} must be >= 0")
    if optim.clip_grad < 0:
        problems.append(f"optim.clip_grad={optim.clip_grad!r} must be >= 0 (0 disables clipping)")
    return problems


def _logging_and_checkpoint(cfg: RunConfig) -> list[str]:
    log, ckpt, problems = cfg.logging, cfg.checkpoint, []
    window = log.profile_steps
    if window is not None and not (
        isinstance(window, (list, tuple))
        and len(window) == 2
        and all(_is_int(v) for v in window)
        and 1 <= window[0] <= window[1]
    ):
        problems.append(
            f"logging.profile_steps={window!r} must be null or [first, last] with 1 <= first <= last "
            "(steps to trace with the torch profiler), e.g. logging.profile_steps=[10,12]"
        )
    if not _is_int(log.log_every) or log.log_every < 1:
        problems.append(f"logging.log_every={log.log_every!r} must be an integer >= 1")
    if not _is_int(ckpt.every_steps) or ckpt.every_steps < 0:
        problems.append(
            f"checkpoint.every_steps={ckpt.every_steps!r} must be an integer >= 0 (0: no periodic saves)"
        )
    if ckpt.resume not in (None, "auto") and not os.path.isdir(ckpt.resume):
        problems.append(
            f"checkpoint.resume={ckpt.resume!r} is not a directory (a step_NNNNNN checkpoint, its "
            "parent or a run directory) nor auto"
        )
    if ckpt.dir and os.path.exists(ckpt.dir) and not os.path.isdir(ckpt.dir):
        problems.append(
            f"checkpoint.dir={ckpt.dir!r} is a file, not a directory: point checkpoint.dir at a directory "
            "(made if it does not exist)"
        )
    if ckpt.resume == "auto" and not ckpt.dir:
        problems.append(
            "checkpoint.resume=auto needs checkpoint.dir (the directory its checkpoints are saved in and "
            "read from): without it each run saves into its own run directory's checkpoints/, which a "
            "new run does not look in. Fix: give every attempt the same checkpoint.dir (e.g. "
            "checkpoint.dir=ckpt/run1), or resume one checkpoint with checkpoint.resume=<its directory>"
        )
    if not _is_int(ckpt.keep_last) or ckpt.keep_last < 0:
        problems.append(
            f"checkpoint.keep_last={ckpt.keep_last!r} must be an integer >= 0 (0: keep every checkpoint)"
        )
    return problems
