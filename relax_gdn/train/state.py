"""The stateful objects of a run: what a step updates and a checkpoint holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TrainState:
    """The model, its optimizer and its LR schedule, made once in the Trainer's setup and handed to
    the step (:class:`relax_gdn.train.step.TrainStep`) and the checkpoint manager
    (:class:`relax_gdn.train.checkpoint_manager.CheckpointManager`)."""

    model: torch.nn.Module  # the model itself (what checkpoints and exports read), not its wrappers
    optimizer: (
        Any  # relax_gdn.train.optimizer: zero_grad, step, sharded_state_dict, checkpoint_form, main_params
    )
    scheduler: Any  # Megatron-Core's OptimizerParamScheduler
