"""Dynamic CP planning (pure) and its process groups (real gloo, 4 ranks)."""

from __future__ import annotations

import random

import pytest

from relax_gdn.parallel.dynamic_cp import DynamicCPGroups, cp_sizes, plan_dynamic_cp, plan_dynamic_cp_over_dp


def _padded(n: int, d: int) -> int:
    return -(-n // (2 * d)) * 2 * d


def _check(plan, lengths, max_tokens, max_cp):
    d = plan.cp_size
    assert d in cp_sizes(max_cp) and len(plan.partitions) == max_cp // d
    assert sorted(i for p in plan.partitions for i in p) == list(range(len(lengths)))  # each sample once
    for p in plan.partitions:
        assert p, "no sub-group may be idle"
        assert sum(_padded(lengths[i], d) for i in p) <= max_tokens * d


def test_short_samples_run_at_cp1_long_ones_at_larger_cp():
    assert plan_dynamic_cp([100, 200, 300, 400], max_tokens_per_gpu=512, max_cp=4).cp_size == 1
    assert plan_dynamic_cp([900, 100, 100, 100], max_tokens_per_gpu=512, max_cp=4).cp_size == 2
    assert plan_dynamic_cp([1500, 100], max_tokens_per_gpu=512, max_cp=4).cp_size == 4


def test_cp_size_grows_until_no_sub_group_is_idle():
    plan = plan_dynamic_cp([100, 100], max_tokens_per_gpu=512, max_cp=4)  # 4 sub-groups, 2 samples
    assert plan.cp_size == 2 and plan.partitions == ((0,), (1,))


def test_cp_size_grows_when_partitions_overflow():
    # each sample fits one rank, but six of 300 tokens can't share 4 ranks of 512 rows
    lengths = [300] * 6
    plan = plan_dynamic_cp(lengths, max_tokens_per_gpu=512, max_cp=4)
    _check(plan, lengths, 512, 4)
    assert plan.cp_size == 2


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_are_valid(seed):
    rng = random.Random(seed)
    max_cp, max_tokens = rng.choice([1, 2, 4, 8]), rng.choice([256, 1024])
    lengths = [rng.randint(1, max_tokens * max_cp // 2) for _ in range(rng.randint(1, 12))]
    while sum(_padded(n, max_cp) for n in lengths) > max_tokens * max_cp:
        lengths.pop()
    if lengths:
        _check(
            plan_dynamic_cp(lengths, max_tokens_per_gpu=max_tokens, max_cp=max_cp),
            lengths,
            max_tokens,
            max_cp,
        )


def test_dp_ranks_agree_on_the_largest_cp_size():
    plans = plan_dynamic_cp_over_dp([[[100, 100, 100, 100]], [[1500]]], max_tokens_per_gpu=512, max_cp=4)
    assert [p[0].cp_size for p in plans] == [4, 4]
    with pytest.raises(ValueError, match="same number of micro-batches"):
        plan_dynamic_cp_over_dp([[[1]], []], max_tokens_per_gpu=512, max_cp=4)


def test_sample_too_long_even_at_max_cp_is_a_clear_error():
    with pytest.raises(ValueError, match=r"train.max_tokens_per_gpu \* parallel.dynamic_cp.max_cp"):
        plan_dynamic_cp([5000], max_tokens_per_gpu=512, max_cp=4)
    with pytest.raises(ValueError, match="power of two"):
        plan_dynamic_cp([10], max_tokens_per_gpu=512, max_cp=3)


def _group_cases():
    import torch.distributed as dist

    world = dist.group.WORLD
    groups = DynamicCPGroups(world, max_cp=4)
    return {d: (dist.get_process_group_ranks(groups.group(d)), groups.rank_in(d)) for d in (1, 2, 4)}


def test_groups_of_every_size_on_gloo(gloo):
    per_rank = gloo(_group_cases, 4, runtime=False)  # pure torch: no Megatron-Core to shim
    for rank, got in enumerate(per_rank):
        assert got[1] == ([rank], 0)
        assert got[2] == ([rank - rank % 2, rank - rank % 2 + 1], rank % 2)
        assert got[4] == ([0, 1, 2, 3], rank)
