"""Training: the loop, gradient sync + optimizer + schedule, checkpoint/resume, metrics (tok/s,
TFLOP/s, MFU), FLOPs accounting (one module), loggers (console, JSONL, W&B)."""

from relax_gdn.train.flops import ModelShape, flops_per_token, megatron_flops, relax_flops, step_flops
from relax_gdn.train.loop import run_training
from relax_gdn.train.run_result import TrainResult
from relax_gdn.train.metrics import REQUIRED_RECORD_FIELDS, MetricsProcessor, StepRecord

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
