"""The run configuration: typed dataclasses, validation, and (only here) the Hydra/OmegaConf bridge."""

from relax_gdn.config.mesh import ParallelDims
from relax_gdn.config.schema import (
    CheckpointConfig,
    DataConfig,
    DynamicCPConfig,
    EvalConfig,
    FP8Config,
    GDNConfig,
    LoggingConfig,
    LoRAConfig,
    ModelConfig,
    MTPConfig,
    OptimConfig,
    ParallelConfig,
    RecomputeConfig,
    RunConfig,
    TrainConfig,
    WandbConfig,
    run_config_from_dict,
)
from relax_gdn.config.validate import validate
from relax_gdn.errors import ConfigError

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DynamicCPConfig",
    "EvalConfig",
    "GDNConfig",
    "LoggingConfig",
    "FP8Config",
    "LoRAConfig",
    "ModelConfig",
    "MTPConfig",
    "OptimConfig",
    "ParallelConfig",
    "ParallelDims",
    "RecomputeConfig",
    "RunConfig",
    "TrainConfig",
    "WandbConfig",
    "run_config_from_dict",
    "validate",
]
