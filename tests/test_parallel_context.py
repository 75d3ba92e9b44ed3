"""ParallelContext: the run's process groups, made once at start-up."""

from __future__ import annotations


def _groups_after_a_model_on_explicit_groups() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from relax_gdn.model import qwen3_5_config
    from relax_gdn.parallel import ParallelContext
    from tests.gdn_harness import self_group
    from tests.model_harness import build

    single = self_group()
    config = qwen3_5_config(
        "qwen3_5_tiny", use_cpu_initialization=True, tensor_model_parallel_size=2, sequence_parallel=True
    )
    build(config, dist.group.WORLD, single, single)  # TP 2 with SP on the default group
    buffer_made_by_the_build = parallel_state._GLOBAL_MEMORY_BUFFER is not None
    try:
        context = ParallelContext.initialize(tp=1, cp=2, dynamic_max_cp=None)
        return {
            "buffer_made_by_the_build": buffer_made_by_the_build,
            "cp": context.cp,
            "cp_rank": context.cp_rank,
            "buffer": parallel_state._GLOBAL_MEMORY_BUFFER is not None,
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_groups_are_made_after_a_model_built_on_explicit_groups(gloo):
    """A model built on explicit groups with sequence parallelism makes Megatron-Core's global
    buffer (its gathers need it);
    a run started afterwards in the same process (a notebook, a test pool's rank) still makes its
    groups, where initialize_model_parallel alone refuses the existing buffer."""
    results = gloo(_groups_after_a_model_on_explicit_groups, 2)
    assert [r["cp_rank"] for r in results] == [0, 1]
    assert all(r["buffer_made_by_the_build"] and r["cp"] == 2 and r["buffer"] for r in results), results
