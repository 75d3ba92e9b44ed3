"""Process groups (the default one, :func:`init_distributed`; the run's, :class:`ParallelContext`,
made once at start-up) and the per-micro-batch CP group decision."""

from relax_gdn.parallel.context import ParallelContext
from relax_gdn.parallel.cp_group import CPGroup, resolve_cp_group
from relax_gdn.parallel.default_group import init_distributed, launcher_rank, launcher_world_size
from relax_gdn.parallel.dynamic_cp import (
    DynamicCPGroups,
    DynamicCPPlan,
    cp_sizes,
    dynamic_cp_micro_batches,
    plan_dynamic_cp,
    plan_dynamic_cp_over_dp,
)

__all__ = [
    "CPGroup",
    "DynamicCPGroups",
    "DynamicCPPlan",
    "ParallelContext",
    "cp_sizes",
    "dynamic_cp_micro_batches",
    "init_distributed",
    "launcher_rank",
    "launcher_world_size",
    "plan_dynamic_cp",
    "plan_dynamic_cp_over_dp",
    "resolve_cp_group",
]
