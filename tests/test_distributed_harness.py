"""tests/distributed.py fails instead of hanging: a rank that raises fails the run with its
traceback while its peer is blocked in a collective, and a run past its limit fails with every
rank's stack."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _rank_sums() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _rank_one_raises_while_rank_zero_waits() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # never completes: rank 1 does not come


def _rank_one_blocks_forever() -> None:
    if dist.get_rank() == 1:
        threading.Event().wait()
    dist.barrier()


def test_every_rank_returns_its_result():
    assert run_distributed(_rank_sums, 2, runtime=False) == [3.0, 3.0]


def test_a_failing_rank_fails_the_run_with_its_traceback_first():
    with pytest.raises(AssertionError) as failure:
        run_distributed(_rank_one_raises_while_rank_zero_waits, 2, runtime=False)
    message = str(failure.value)
    first = message.split("--- rank ")[1]  # the earliest failure is reported first
    assert first.startswith("1 raised")
    assert "ValueError: rank one refuses" in first
    assert "_rank_one_raises_while_rank_zero_waits" in first
    assert "limit" not in message


def test_a_run_past_its_limit_fails_with_the_stacks_of_the_ranks_left():
    with pytest.raises(AssertionError) as failure:
        # fresh ranks forked from the fork server: started in well under a second, even under load
        run_distributed(_rank_one_blocks_forever, 2, timeout_s=5, runtime=False)
    message = str(failure.value)
    assert "passed its 5 s limit" in message
    assert "--- rank 1 stacks ---" in message
    assert "most recent call first" in message


# ---------------------------------------------------------------------------------------------
# the pool (tests/conftest.py's fixture ``gloo``): ranks started once, one job per call
# ---------------------------------------------------------------------------------------------


def _pid_and_rank_sum() -> tuple[int, float]:
    import os

    return os.getpid(), _rank_sums()


def _makes_a_group_and_sets_the_environment() -> int:
    import os

    from torch.distributed import distributed_c10d

    dist.new_group([0, 1])
    os.environ["RELAX_GDN_POOL_TEST"] = "set by a job"
    return len(distributed_c10d._world.pg_map)


def _groups_and_environment() -> tuple[int, str | None]:
    import os

    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map), os.environ.get("RELAX_GDN_POOL_TEST")


def _draws_random_numbers() -> list[float]:
    return torch.rand(3).tolist()


def _rank_one_exits() -> None:
    import os

    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _leaves_model_parallel_state() -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, create_gloo_process_groups=False)


def test_pool_keeps_its_ranks_between_jobs_and_cleans_up_after_each(gloo):
    first = gloo(_pid_and_rank_sum, 2)
    assert [s for _, s in first] == [3.0, 3.0]
    groups_before, _ = gloo(_groups_and_environment, 2)[0]
    assert gloo(_makes_a_group_and_sets_the_environment, 2) == [groups_before + 1] * 2
    assert (
        gloo(_groups_and_environment, 2) == [(groups_before, None)] * 2
    )  # the job's group and variable gone
    assert gloo(_pid_and_rank_sum, 2) == first  # the same processes
    # every job starts from the random state its rank started with, whatever ran before
    assert gloo(_draws_random_numbers, 2) == gloo(_draws_random_numbers, 2)


@pytest.fixture
def pool():
    from tests.distributed import RankPool

    pool = RankPool(2)
    yield pool
    pool.close()


def test_pool_fails_a_job_with_the_raising_rank_first_then_starts_again(pool):
    before = pool.run(_pid_and_rank_sum)
    with pytest.raises(AssertionError) as failure:
        pool.run(_rank_one_raises_while_rank_zero_waits)
    message = str(failure.value)
    assert message.split("--- rank ")[1].startswith("1 raised")
    assert "ValueError: rank one refuses" in message and "ranks [0] were still running" in message
    after = pool.run(_pid_and_rank_sum)  # a fresh pool: new processes, the same answers
    assert [s for _, s in after] == [3.0, 3.0] and {p for p, _ in after}.isdisjoint(p for p, _ in before)


def test_pool_fails_a_job_whose_rank_dies(pool):
    with pytest.raises(AssertionError, match="rank 1 exited with 3 without a result"):
        pool.run(_rank_one_exits)
    assert [s for _, s in pool.run(_pid_and_rank_sum)] == [3.0, 3.0]


def test_pool_fails_a_job_past_its_limit_with_the_stacks_of_the_ranks_left(pool):
    pool.run(_rank_sums)  # started: the limit below is the job's alone
    with pytest.raises(AssertionError) as failure:
        pool.run(_rank_one_blocks_forever, timeout_s=5)
    message = str(failure.value)
    assert "passed its 5 s limit" in message and "--- rank 1 stacks ---" in message
    assert "_rank_one_blocks_forever" in message


def test_pool_refuses_a_job_that_leaves_model_parallel_state(pool):
    with pytest.raises(AssertionError, match=r"destroy_model_parallel\(\) in a `finally`"):
        pool.run(_leaves_model_parallel_state)


def _makes_a_group_on_rank_0_only() -> None:
    if dist.get_rank() == 0:
        dist.new_group([0], use_local_synchronization=True)  # no other rank takes part: no hang


def _makes_every_group_and_sums() -> float:
    import torch

    pair = dist.new_group([0, 1])
    total = torch.ones(1)
    dist.all_reduce(total, group=pair)
    return total.item()


def test_a_job_whose_ranks_make_different_groups_fails_and_the_next_job_runs(gloo):
    """torch names groups by a per-process count and gloo finds its peers under that name: a job
    that makes a group on one rank only would leave the ranks' names out of step for later jobs."""
    with pytest.raises(AssertionError, match=r"different numbers of process groups \(\[1, 0\] by rank\)"):
        gloo(_makes_a_group_on_rank_0_only, 2)
    assert gloo(_makes_every_group_and_sums, 2) == [2.0, 2.0]
