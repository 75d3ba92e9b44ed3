"""Training: the entry point (:func:`run_training`), the Trainer, the model builder, the step,
gradient sync + optimizer + schedule, checkpoints and resume, metrics (tok/s, TFLOP/s, MFU), FLOPs
accounting (one module), loggers (console, JSONL, W&B).

The names below load on first use (PEP 562), as in ``relax_gdn.model``: importing one light module
of this package (``relax_gdn.train.watchdog``, ``relax_gdn.train.memory``) then does not pull in
:func:`run_training`'s Megatron-Core, FLA and wandb, about 5 s of a fresh process on the 2-core
development machine (docs/testing.md).
"""

from __future__ import annotations

from relax_gdn.lazy_names import lazy_getattr

_LAZY = {
    **dict.fromkeys(
        ("ModelShape", "flops_per_token", "megatron_flops", "relax_flops", "step_flops"),
        "relax_gdn.train.flops",
    ),
    **dict.fromkeys(("REQUIRED_RECORD_FIELDS", "MetricsProcessor", "StepRecord"), "relax_gdn.train.metrics"),
    "run_training": "relax_gdn.train.run",
    "TrainResult": "relax_gdn.train.run_result",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = sorted(_LAZY)
