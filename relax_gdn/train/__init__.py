"""Training: the entry point (:func:`run_training`), the Trainer, the model builder, the step,
gradient sync + optimizer + schedule, checkpoints and resume, metrics (tok/s, TFLOP/s, MFU), FLOPs
accounting (one module), loggers (console, JSONL, W&B)."""

from relax_gdn.train.flops import ModelShape, flops_per_token, megatron_flops, relax_flops, step_flops
from relax_gdn.train.metrics import REQUIRED_RECORD_FIELDS, MetricsProcessor, StepRecord
from relax_gdn.train.run import run_training
from relax_gdn.train.run_result import TrainResult

__all__ = [
    "REQUIRED_RECORD_FIELDS",
    "MetricsProcessor",
    "ModelShape",
    "StepRecord",
    "TrainResult",
    "flops_per_token",
    "megatron_flops",
    "relax_flops",
    "run_training",
    "step_flops",
]
