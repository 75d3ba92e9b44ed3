"""This rank's place in the run's process groups, made once at start-up: :class:`ParallelContext`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state

from relax_gdn.parallel.dynamic_cp import DynamicCPGroups


@dataclass(frozen=True)
class ParallelContext:
    """The process groups of a run (Megatron-Core's ``parallel_state``) as this rank sees them.

    Made by :meth:`initialize` on every rank before the model is built; nothing creates a group
    after it. The ranks are this process's position in each group.
    """

    tp: int  # tensor-parallel size
    cp: int  # context-parallel size (with dynamic CP: the largest CP size, the static group's)
    dp: int  # data-parallel size: world size / (tp x cp)
    dp_rank: int
    cp_rank: int
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup  # data x context parallel: the gradient-sum and checkpoint group
    dynamic_groups: DynamicCPGroups | None  # dynamic CP: the CP group's sub-groups of every size

    @classmethod
    def initialize(
        cls, *, tp: int, cp: int, dynamic_max_cp: int | None, timeout: timedelta | None = None
    ) -> ParallelContext:
        """Create the TP / CP / DP groups in the default process group, and with ``dynamic_max_cp``
        (dynamic CP; it must equal ``cp``) the CP sub-groups of every size up to it. A collective
        over every rank. ``timeout``: every group's collective timeout (``train.collective_timeout_s``;
        None: Megatron-Core's and torch's defaults)."""
        minutes = {} if timeout is None else {"distributed_timeout_minutes": timeout.total_seconds() / 60}
        if not parallel_state.model_parallel_is_initialized():
            # a model built earlier on explicit groups made Megatron-Core's global buffer (it needs
            # one for SP gathers); initialize_model_parallel makes its own and refuses an existing one
            parallel_state.destroy_global_memory_buffer()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            create_gloo_process_groups=False,
            **minutes,
        )
        cp_group = parallel_state.get_context_parallel_group()
        return cls(
            tp=tp,
            cp=cp,
            dp=parallel_state.get_data_parallel_world_size(),
            dp_rank=parallel_state.get_data_parallel_rank(),
            cp_rank=parallel_state.get_context_parallel_rank(),
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            cp_group=cp_group,
            dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
            dynamic_groups=DynamicCPGroups(cp_group, dynamic_max_cp, timeout)
            if dynamic_max_cp is not None
            else None,
        )

    @staticmethod
    def destroy() -> None:
        """Remove the groups :meth:`initialize` made (the default process group stays)."""
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
