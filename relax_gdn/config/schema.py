"""The resolved run configuration as plain typed dataclasses (torchtitan style).

One dataclass per Hydra config group (``conf/<group>/*.yaml``); field names are the YAML keys,
so an error can always name the key as ``group.field``. Nothing here reads Hydra: the
conversion from a composed ``DictConfig`` lives in :mod:`relax_gdn.config.hydra_io`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from relax_gdn.gdn import DEFAULT_MAX_RECOMPUTED_PREFIX

RECOMPUTE_GRANULARITIES = ("full", "selective", "none")
PRECISIONS = ("auto", "bf16", "fp32")
DEVICES = ("auto", "cuda", "cpu")
DATA_SOURCES = ("synthetic", "jsonl", "parquet", "hf_disk")
LR_SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adam",)
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class ModelConfig:
    preset: str = "qwen3_5_tiny"  # relax_gdn.model.PRESETS
    hf_checkpoint: str | None = None  # local HF checkpoint directory; None: random init
    spec_provider: str = "auto"
    attention_backend: str = "auto"


@dataclass
class GDNConfig:
    cp_mode: str = "chunkwise"  # relax_gdn.gdn.CP_MODES
    route: str = "lazy_cache"  # relax_gdn.layout.ROUTE_STRATEGIES
    kernel_backend: str = "auto"
    swap_transport: str = "auto"  # relax_gdn.layout.SWAP_TRANSPORTS
    max_recomputed_prefix: int = DEFAULT_MAX_RECOMPUTED_PREFIX  # chunkwise; 0: always pass the state


@dataclass
class DynamicCPConfig:
    enabled: bool = False
    max_cp: int = 1


@dataclass
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    sp: bool = False
    dynamic_cp: DynamicCPConfig = field(default_factory=DynamicCPConfig)


@dataclass
class RecomputeConfig:
    granularity: str = "none"


@dataclass
class DataConfig:
    source: str = "synthetic"
    path: str | None = None
    prompt_field: str = "problem"
    response_field: str = "generated_solution"
    split: str = "train"  # hf_disk: the split of a saved DatasetDict
    tokenizer: str = "embedded"
    max_sample_tokens: int | None = 512
    num_samples: int | None = 2048  # synthetic: set size; files: read at most this many (None: all)
    synthetic_max_steps: int = 20  # synthetic only: longest word problem (each step ~90 byte tokens)


@dataclass
class TrainConfig:
    steps: int = 30
    global_batch_size: int = 16
    max_tokens_per_gpu: int = 2048
    seed: int = 1234
    precision: str = "auto"
    device: str = "auto"
    deterministic: bool = False


@dataclass
class OptimConfig:
    name: str = "adam"
    lr: float = 3e-3
    min_lr: float = 3e-4
    schedule: str = "cosine"
    warmup_steps: int = 3
    decay_steps: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class WandbConfig:
    mode: str = "disabled"
    project: str = "relax-gdn"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    name: str | None = None


@dataclass
class LoggingConfig:
    console: bool = True
    log_every: int = 1
    jsonl: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    profile_steps: list[int] | None = None  # [first, last]: torch profiler traces per rank for these steps


@dataclass
class CheckpointConfig:
    dir: str | None = None
    every_steps: int = 0
    save_final: bool = False
    resume: str | None = None


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    gdn: GDNConfig = field(default_factory=GDNConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_overrides(self, overrides: dict[str, Any]) -> "RunConfig":
        """A copy with dotted-key overrides (``{"train.steps": 3, "parallel.dynamic_cp.enabled": True}``),
        for code that builds runs without Hydra (benchmarks, tests); an unknown key names itself."""
        values = self.to_dict()
        for key, value in overrides.items():
            node = values
            *parents, leaf = key.split(".")
            for i, part in enumerate(parents):
                if not isinstance(node.get(part), dict):
                    raise ValueError(f"unknown config key {key!r}: {'.'.join(parents[:i + 1])} is not a group")
                node = node[part]
            if leaf not in node:
                raise ValueError(f"unknown config key {key!r}; known under {'.'.join(parents) or 'the root'}: "
                                 f"{sorted(node)}")
            node[leaf] = value
        return run_config_from_dict(values)

    @property
    def effective_max_cp(self) -> int:
        """The largest CP group a micro-batch can run on (what head splits must divide)."""
        dyn = self.parallel.dynamic_cp
        return dyn.max_cp if dyn.enabled else self.parallel.cp


def _build(cls, values: Any, where: str):
    """``cls`` from a nested dict; unknown keys are an error naming them (Hydra catches them on the
    command line, this catches them in hand-written dicts and YAML edits)."""
    if isinstance(values, cls):
        return values
    if not isinstance(values, dict):
        raise ValueError(f"{where or 'config'} must be a mapping, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        keys = ", ".join(f"{where}.{k}" if where else k for k in unknown)
        raise ValueError(f"unknown config key(s) {keys}; known under {where or 'the root'}: {sorted(fields)}")
    kwargs = {}
    for name, value in values.items():
        sub = _NESTED.get((cls, name))
        key = f"{where}.{name}" if where else name
        kwargs[name] = _build(sub, value, key) if sub is not None else value
    return cls(**kwargs)


_NESTED = {
    (RunConfig, "model"): ModelConfig,
    (RunConfig, "gdn"): GDNConfig,
    (RunConfig, "parallel"): ParallelConfig,
    (RunConfig, "recompute"): RecomputeConfig,
    (RunConfig, "data"): DataConfig,
    (RunConfig, "train"): TrainConfig,
    (RunConfig, "optim"): OptimConfig,
    (RunConfig, "logging"): LoggingConfig,
    (RunConfig, "checkpoint"): CheckpointConfig,
    (ParallelConfig, "dynamic_cp"): DynamicCPConfig,
    (LoggingConfig, "wandb"): WandbConfig,
}


def run_config_from_dict(values: dict[str, Any]) -> RunConfig:
    """A :class:`RunConfig` from plain nested dicts (e.g. a saved ``config.yaml``)."""
    return _build(RunConfig, dict(values), "")
