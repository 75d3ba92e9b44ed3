"""The run configuration as plain typed dataclasses (torchtitan style): the ONLY place that
states a default.

One dataclass per Hydra config group; field names are the keys, so an error can always name the
key as ``group.field``. :mod:`relax_gdn.config.hydra_io` registers these classes in Hydra's
ConfigStore as the schema every composition starts from (unknown keys and values of the wrong
type are refused while composing), so ``conf/<group>/<option>.yaml`` holds only what an option
changes. Closed sets of options are ``Literal`` types from :mod:`relax_gdn.choices`. Nothing here
reads Hydra.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from relax_gdn.choices import (
    RECOMPUTE_MODULES,
    CPMode,
    DataSource,
    Device,
    FP8Recipe,
    KernelBackend,
    LRSchedule,
    ModelAttentionBackend,
    ModelPreset,
    NonfinitePolicy,
    OptimizerCheckpointSharding,
    OptimizerName,
    Precision,
    RecomputeGranularity,
    RecordFormat,
    RouteStrategy,
    SpecProvider,
    SwapTransport,
    WandbMode,
)
from relax_gdn.errors import ConfigError
from relax_gdn.gdn import DEFAULT_MAX_RECOMPUTED_PREFIX
from relax_gdn.gdn.options import GDNOptions
from relax_gdn.model.fp8.options import FP8Options
from relax_gdn.model.lora_options import LoRAOptions, resolve_targets
from relax_gdn.model.presets import qwen3_5_preset
from relax_gdn.model.recompute import recomputes


@dataclass
class MTPConfig:
    # multi-token-prediction layers trained beside the LM head (relax_gdn.model.mtp): 0 off; 1 Qwen3.5's
    # one layer (mtp.* in HF names); null: as model.hf_checkpoint has (1 when it holds mtp.* tensors,
    # so its export serves MTP speculative decoding with a layer trained on the new model; else 0)
    num_layers: int | None = None
    # the objective is loss + loss_weight x mtp_loss (metrics: loss is the LM's alone, mtp_loss apart)
    loss_weight: float = 0.1


@dataclass
class LoRAConfig:
    # adapters of this rank on the targets, every other weight frozen (docs/lora.md); 0: no LoRA
    rank: int = 0
    alpha: float | None = None  # the adapters' output is scaled by alpha / rank; null: 2 x rank
    dropout: float = 0.0  # on each adapter's input while training
    # Hugging Face module names and groups of them (relax_gdn.model.lora_options.LORA_GROUPS):
    # all_linear is every projection of the GDN and attention layers and the MLPs
    targets: list[str] = field(default_factory=lambda: ["all_linear"])  # of relax_gdn.choices.LoRATarget


@dataclass
class FP8Config:
    # the linear layers' GEMMs in FP8 with a torchao float8 recipe (docs/fp8.md): tensorwise,
    # rowwise or rowwise_gw_hp; null: bf16. Emulated exactly on CPU (the GEMM in fp32).
    recipe: FP8Recipe | None = None
    # module-name patterns (fnmatch) kept in bf16; output_layer: its fused loss never calls the layer
    bf16_modules: list[str] = field(default_factory=lambda: ["output_layer"])
    bf16_gdn_gates: bool = True  # the GDN input projection's beta/alpha rows in bf16, the rest in FP8
    # a frozen weight in FP8 (LoRA's base) keeps its bf16 values in host memory, the GPU its FP8 casts
    frozen_weights_on_host: bool = True


@dataclass
class ModelConfig:
    preset: ModelPreset = "qwen3_5_tiny"  # relax_gdn.model.presets (qwen3_5_tiny: 4 layers, hidden 64, CPU)
    hf_checkpoint: str | None = None  # local HF checkpoint directory; None: random init
    spec_provider: SpecProvider = "auto"  # auto: the local specs (the tested path); te: Transformer Engine's
    attention_backend: ModelAttentionBackend = "auto"
    # relax_gdn.model.fusion: one-kernel RMSNorms (and the GDN gated norm on CUDA); off: fp32 formulas
    fused_norms: bool = True
    # output layer + per-token cross-entropy in token chunks (no full-vocabulary logits); TP > 1 keeps
    # Megatron-Core's vocab-parallel loss
    fused_cross_entropy: bool = True
    # SwiGLU as Megatron-Core's fused (torch.compile) SwiGLUFunction on CUDA, which keeps only its input
    fused_swiglu: bool = True
    # weight gradients accumulated into the fp32 main grads inside the wgrad GEMM (CUDA;
    # relax_gdn.compat.wgrad), instead of a bf16 grad plus an add per parameter; at TP 1 the
    # embedding adds its rows there directly too (relax_gdn.model.fusion)
    fused_grad_accumulation: bool = True
    mtp: MTPConfig = field(default_factory=MTPConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    fp8: FP8Config = field(default_factory=FP8Config)


@dataclass
class GDNConfig:
    cp_mode: CPMode = "chunkwise"
    route: RouteStrategy = "lazy_cache"  # zigzag<->contiguous routes: built on first use / by the data side
    kernel_backend: KernelBackend = "auto"  # auto: FLA kernels on CUDA, the pure-torch reference on CPU
    swap_transport: SwapTransport = (
        "auto"  # auto: peer memory when the CP group is on one host, else all_to_all
    )
    # chunkwise: a document crossing a CP rank cut with at most this many tokens before the cut is
    # recomputed by the next rank instead of passing the recurrent state between ranks (0: always pass)
    max_recomputed_prefix: int = DEFAULT_MAX_RECOMPUTED_PREFIX
    # chunkwise: keep the residual stream in the contiguous layout through each run of GDN layers
    # (2 layout swaps per run instead of 2 per GDN layer; relax_gdn.model.gdn_runs). No effect
    # with sequence parallelism or in the other modes.
    contiguous_between_layers: bool = True


@dataclass
class DynamicCPConfig:
    enabled: bool = False
    max_cp: int | None = None  # with enabled=true: parallel.cp (a power of two); if given, equal to it


@dataclass
class ParallelConfig:
    tp: int = 1  # data parallel = world size / (tp x cp)
    cp: int = 1
    sp: bool = False  # sequence parallelism; needs tp > 1
    dynamic_cp: DynamicCPConfig = field(default_factory=DynamicCPConfig)


@dataclass
class RecomputeConfig:
    granularity: RecomputeGranularity = "none"  # full: whole layers (what all_gather CP needs)
    # what granularity=selective (and mixed's other layers) recomputes (relax_gdn.model.recompute)
    modules: list[str] = field(
        default_factory=lambda: list(RECOMPUTE_MODULES)
    )  # of relax_gdn.choices.RecomputeModule
    # granularity=full: leave out what no gradient reads (the last layer's recompute, each recomputed
    # layer's linear_fc2 GEMM; relax_gdn.model.recompute); false: Megatron-Core's plain full recompute
    skip_unused: bool = True
    # granularity=mixed: the first N layers recomputed whole, the rest selective; None: the fewest
    # that the memory model fits on the GPU (relax_gdn.train.memory.fewest_full_layers)
    full_layers: int | None = None


@dataclass
class DataConfig:
    source: DataSource = "synthetic"  # synthetic: a deterministic math SFT set, no files needed
    path: str | None = (
        None  # jsonl/parquet: a file (parquet: or a directory); hf_disk: a save_to_disk directory
    )
    eval_path: str | None = None  # evaluation records (any source/record format); None: eval.holdout_fraction
    format: RecordFormat = "auto"  # records: {role, content} turns (messages) or prompt/response fields
    prompt_field: str = "problem"
    response_field: str = "generated_solution"
    split: str = "train"  # hf_disk: the split of a saved DatasetDict
    tokenizer: str | None = (
        "embedded"  # embedded (small, built in) or a local Hugging Face tokenizer directory
    )
    # longer samples are skipped (counted and reported); None: what one micro-batch holds,
    # train.max_tokens_per_gpu x the largest CP size (RunConfig.sample_token_limit)
    max_sample_tokens: int | None = 512
    num_samples: int | None = 2048  # synthetic: set size; files: read at most this many (None: all)
    synthetic_max_steps: int = 3  # synthetic only: longest word problem (each step ~90 byte tokens)


@dataclass
class EvalConfig:
    every_steps: int = 0  # evaluate every N steps and after the last one; 0: no evaluation
    num_samples: int | None = 64  # samples evaluated each time (the first of the eval set); None: all
    holdout_fraction: float = 0.0  # without data.eval_path: this fraction of the training set, not trained on


@dataclass
class TrainConfig:
    steps: int = 30
    global_batch_size: int = 16  # samples per optimizer step (all DP ranks together)
    max_tokens_per_gpu: int = 2048  # packed tokens per micro-batch per GPU (a CP group holds cp x this)
    seed: int = 1234
    precision: Precision = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: Device = "auto"
    deterministic: bool = False  # Megatron deterministic mode (refused with chunkwise CP > 1)
    # a step whose loss or grad norm is not finite never has its update applied nor a checkpoint
    # saved after it; stop: the run ends there (exit 3), skip: it goes on, counting such steps
    on_nonfinite: NonfinitePolicy = "stop"
    max_nonfinite_steps: int = 3  # on_nonfinite=skip: this many non-finite steps in a row end the run
    collective_timeout_s: float = 600.0  # a collective that takes longer fails (every process group)
    # no step completed for this long: every rank writes its threads' stacks to <run dir>/hang/ and
    # exits 124; auto: max(10 x the median step time, 300 s) from the 4th step on; null: no watchdog
    hang_timeout_s: float | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        # the command line and config.yaml give hang_timeout_s as text (its type admits "auto")
        if isinstance(self.hang_timeout_s, str) and self.hang_timeout_s != "auto":
            try:
                self.hang_timeout_s = float(self.hang_timeout_s)
            except ValueError:
                pass  # validate names the value


@dataclass
class OptimConfig:
    name: OptimizerName = "adam"  # Adam with decoupled weight decay
    # peak rate; null: the model preset's (relax_gdn.model.presets: 1e-5 for the 9B, 2e-4 for the
    # randomly initialised reduced 9B, 3e-3 for the tiny demo). RunConfig.learning_rates resolves it.
    lr: float | None = None
    min_lr: float | None = None  # the schedule's floor; null: optim.lr / 10
    schedule: LRSchedule = "cosine"  # after a linear warm-up
    # linear warm-up from 0: a value below 1 is a fraction of train.steps (0.1 x the demo's 30
    # steps = 3), a whole number >= 1 is steps (clamped below train.steps, with a warning)
    warmup_steps: int | float = 0.1
    decay_steps: int | None = None  # step at which min_lr is reached; None: train.steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    clip_grad: float = 1.0
    # a resumed run whose schedule (lr, min_lr, warmup, decay steps / train.steps, style) differs
    # from the checkpoint's: false refuses it, true continues on the new schedule from the saved step
    reset_schedule_on_resume: bool = False


@dataclass
class WandbConfig:
    mode: WandbMode = "disabled"
    project: str = "relax-gdn"
    entity: str | None = None
    group: str | None = None  # None: derived (model/scenario); sweeps set the sweep's name
    tags: list[str] = field(default_factory=list)  # mode, route, cp, tp and model tags are added
    name: str | None = None  # None: the run name
    job_type: str | None = None  # W&B job_type; sweeps set the job's variant (relax_gdn.sweep)


@dataclass
class LoggingConfig:
    console: bool = True  # rank 0: progress bar + one line per log_every steps
    log_every: int = 1
    jsonl: bool = True  # metrics.jsonl in the run directory, one record per step
    wandb: WandbConfig = field(default_factory=WandbConfig)
    profile_steps: list[int] | None = None  # [first, last]: torch profiler traces per rank for these steps
    show_third_party_warnings: bool = False  # true: keep the notices relax_gdn.known_warnings silences
    # CUDA: count host<->device syncs in forward + backward (metrics' host_syncs) with torch's
    # process-wide sync debug mode; off in training runs, on in benchmarks and GPU tests
    count_host_syncs: bool = False


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: <run dir>/checkpoints
    every_steps: int = 0  # save every N steps and at the end; 0: no periodic saves
    save_final: bool = False  # also save at the end when every_steps is 0
    resume: str | None = None  # a step_NNNNNN directory, the directory holding them, or auto (needs dir)
    keep_last: int = 3  # complete checkpoints kept in dir (older ones deleted after a save); 0: all
    async_save: bool = False  # GPU: write in the background (Megatron-Core's async queue); CPU saves inline
    # GPU distributed optimizer: dp_reshardable (every rank writes its own shard; resumes at any DP /
    # CP / dynamic CP, same TP) or fully_reshardable (gathered into model-shaped tensors; resumes at
    # any TP too, holding the TP shard's whole fp32 optimizer state in each rank's host memory)
    optimizer_sharding: OptimizerCheckpointSharding = "dp_reshardable"
    export_hf_final: bool = False  # after the last step, write a Hugging Face directory <run dir>/hf


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    gdn: GDNConfig = field(default_factory=GDNConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run_name: str | None = (
        None  # W&B run name and run directory suffix; None: derived from mode/route/CP/TP/model
    )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_overrides(self, overrides: dict[str, Any]) -> RunConfig:
        """A copy with dotted-key overrides (``{"train.steps": 3, "parallel.dynamic_cp.enabled": True}``),
        for code that builds runs without Hydra (benchmarks, tests); an unknown key names itself."""
        values = self.to_dict()
        for key, value in overrides.items():
            node = values
            *parents, leaf = key.split(".")
            for i, part in enumerate(parents):
                if not isinstance(node.get(part), dict):
                    raise ConfigError(
                        [f"unknown config key {key!r}: {'.'.join(parents[: i + 1])} is not a group"]
                    )
                node = node[part]
            if leaf not in node:
                raise ConfigError([unknown_key_problem(key)])
            node[leaf] = value
        return run_config_from_dict(values)

    @property
    def effective_max_cp(self) -> int:
        """The largest CP group a micro-batch can run on (what head splits must divide)."""
        dyn = self.parallel.dynamic_cp
        return dyn.max_cp if dyn.enabled and dyn.max_cp is not None else self.parallel.cp

    @property
    def gdn_options(self) -> GDNOptions:
        """What every GDN layer of this run is told (``gdn.*``, the largest CP size and whether
        ``recompute.*`` recomputes its core), built once and passed to the model builder."""
        g = self.gdn
        return GDNOptions(
            cp_mode=g.cp_mode,
            route=g.route,
            kernel_backend=g.kernel_backend,
            swap_transport=g.swap_transport,
            max_recomputed_prefix=g.max_recomputed_prefix,
            max_cp_size=self.effective_max_cp,
            training=True,
            recompute_core=recomputes(self.recompute.granularity, self.recompute.modules, "gdn_core"),
        )

    @property
    def lora_options(self) -> LoRAOptions | None:
        """The adapters of this run (``model.lora``; None without: the whole model trains), built
        once and passed to the model builder."""
        lora = self.model.lora
        if not lora.rank:
            return None
        alpha = lora.alpha if lora.alpha is not None else 2 * lora.rank
        return LoRAOptions(
            rank=lora.rank,
            alpha=float(alpha),
            dropout=float(lora.dropout),
            modules=resolve_targets(lora.targets),
            init_seed=self.train.seed,
        )

    @property
    def fp8_options(self) -> FP8Options | None:
        """The FP8 GEMMs of this run (``model.fp8``; None without a recipe: bf16), built once and
        passed to the model builder."""
        fp8 = self.model.fp8
        if fp8.recipe is None:
            return None
        return FP8Options(
            recipe=fp8.recipe,
            bf16_modules=tuple(fp8.bf16_modules),
            bf16_gdn_gates=bool(fp8.bf16_gdn_gates),
            frozen_weights_on_host=bool(fp8.frozen_weights_on_host),
        )

    @property
    def learning_rates(self) -> tuple[float, float]:
        """(peak, floor) of the schedule: ``optim.lr`` or, when null, the model preset's rate
        (``Qwen3_5Preset.sft_lr``, or ``lora_lr`` with ``model.lora``); ``optim.min_lr`` or, when
        null, a tenth of the peak."""
        preset = qwen3_5_preset(self.model.preset)
        default = preset.lora_lr if self.model.lora.rank else preset.sft_lr
        lr = self.optim.lr if self.optim.lr is not None else default
        return lr, self.optim.min_lr if self.optim.min_lr is not None else lr / 10

    def resolved(self) -> RunConfig:
        """A copy with every null that stands for a derived value filled in (the learning rates):
        what ``config.yaml`` records, so a run's file says what it trained with."""
        lr, min_lr = self.learning_rates
        return dataclasses.replace(self, optim=dataclasses.replace(self.optim, lr=lr, min_lr=min_lr))

    @property
    def sample_token_limit(self) -> int:
        """The longest sample the data side keeps: ``data.max_sample_tokens``, or when that is None
        every sample one micro-batch can hold (``train.max_tokens_per_gpu`` x the largest CP size;
        an even budget times the CP size is a whole number of the 2·cp padding units)."""
        if self.data.max_sample_tokens is not None:
            return self.data.max_sample_tokens
        return self.train.max_tokens_per_gpu * self.effective_max_cp


def _build(cls, values: Any, where: str):
    """``cls`` from a nested dict; unknown keys are an error naming them (Hydra catches them on the
    command line, this catches them in hand-written dicts and YAML edits)."""
    if isinstance(values, cls):
        return values
    if not isinstance(values, dict):
        raise ConfigError(
            [f"{where or 'config'} must be a group of keys, got {type(values).__name__} {values!r}"]
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError([unknown_key_problem(f"{where}.{k}" if where else k) for k in unknown])
    kwargs = {}
    for name, value in values.items():
        sub = _NESTED.get((cls, name))
        key = f"{where}.{name}" if where else name
        kwargs[name] = _build(sub, value, key) if sub is not None else value
    return cls(**kwargs)


_NESTED = {
    (RunConfig, "model"): ModelConfig,
    (ModelConfig, "mtp"): MTPConfig,
    (ModelConfig, "lora"): LoRAConfig,
    (ModelConfig, "fp8"): FP8Config,
    (RunConfig, "gdn"): GDNConfig,
    (RunConfig, "parallel"): ParallelConfig,
    (RunConfig, "recompute"): RecomputeConfig,
    (RunConfig, "data"): DataConfig,
    (RunConfig, "eval"): EvalConfig,
    (RunConfig, "train"): TrainConfig,
    (RunConfig, "optim"): OptimConfig,
    (RunConfig, "logging"): LoggingConfig,
    (RunConfig, "checkpoint"): CheckpointConfig,
    (ParallelConfig, "dynamic_cp"): DynamicCPConfig,
    (LoggingConfig, "wandb"): WandbConfig,
}


# what users of other trainers (HF Trainer, Megatron-LM, torchtitan) call a key: the one here
KNOWN_AS = {
    "learning_rate": "optim.lr",
    "lr": "optim.lr",
    "max_steps": "train.steps",
    "train_iters": "train.steps",
    "num_steps": "train.steps",
    "eval_every": "eval.every_steps",
    "eval_steps": "eval.every_steps",
    "eval_interval": "eval.every_steps",
    "eval_fraction": "eval.holdout_fraction",
    "save_every": "checkpoint.every_steps",
    "save_steps": "checkpoint.every_steps",
    "save_interval": "checkpoint.every_steps",
    "warmup": "optim.warmup_steps",
    "lr_warmup_iters": "optim.warmup_steps",
    "micro_batch_size": "train.max_tokens_per_gpu",
    "seq_length": "train.max_tokens_per_gpu",
    "context_parallel_size": "parallel.cp",
    "tensor_model_parallel_size": "parallel.tp",
    "tensor_parallel_size": "parallel.tp",
    "sequence_parallel": "parallel.sp",
    "lora_rank": "model.lora.rank",
}


def config_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (``train.steps``, ``model.lora.rank``, ...)."""
    keys = []
    for f in dataclasses.fields(cls):
        nested = _NESTED.get((cls, f.name))
        keys += config_keys(nested, f"{prefix}{f.name}.") if nested else [f"{prefix}{f.name}"]
    return keys


def _did_you_mean(key: str) -> str:
    """`` Did you mean X?`` for a mistyped key (a close spelling, or another trainer's name for
    it), or nothing."""
    import difflib

    known = config_keys()
    leaf = key.rpartition(".")[2]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    guess = KNOWN_AS.get(leaf.lower()) or (close[0] if close else None)
    return f" Did you mean {guess}?" if guess and guess != key else ""


def unknown_key_problem(key: str) -> str:
    """The one wording for a key the schema does not have (from Hydra or from a dict)."""
    *parents, leaf = key.split(".")
    cls = RunConfig
    for part in parents:
        cls = _NESTED.get((cls, part))
        if cls is None:
            return f"unknown config key {key!r}: {'.'.join(parents)} is not a group.{_did_you_mean(key)}"
    group = ".".join(parents) or "the top level"
    return (
        f"unknown config key {key!r}: {group} has no key {leaf!r}; its keys are "
        f"{', '.join(f.name for f in dataclasses.fields(cls))} (relax_gdn/config/schema.py).{_did_you_mean(key)}"
    )


def run_config_from_dict(values: dict[str, Any]) -> RunConfig:
    """A :class:`RunConfig` from plain nested dicts (e.g. a saved ``config.yaml``)."""
    return _build(RunConfig, dict(values), "")
