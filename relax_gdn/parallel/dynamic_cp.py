"""Dynamic CP: a CP size per micro-batch (docs/design/LAYOUTS.md §5).

A static CP group of ``max_cp`` ranks runs each micro-batch as ``max_cp / d`` independent
sub-micro-batches, one per sub-group of ``d`` consecutive CP ranks. Short samples then run at
small ``d`` (less communication), long ones at large ``d`` (enough memory).

* :func:`plan_dynamic_cp` picks ``d`` for one micro-batch from its sample lengths and splits the
  samples into ``max_cp / d`` length-balanced partitions, one per sub-group.
* :func:`plan_dynamic_cp_over_dp` makes every DP rank use the same ``d`` for the same micro-batch
  index (the MAX over DP). The plan of every DP rank is known on every rank (the data plan is
  deterministic), so this needs no collective.
* :class:`DynamicCPGroups` creates the sub-groups of every size once, at start-up — never in a
  forward — and hands out the one a rank belongs to for a given ``d``.

The sub-group and ``d`` travel on ``PackedSeqParams.cp_group`` / ``local_cp_size``; GDN and
attention find them through :func:`relax_gdn.parallel.resolve_cp_group`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from relax_gdn.layout.partition import padded_length


def _check_power_of_two(max_cp: int) -> None:
    if not isinstance(max_cp, int) or max_cp < 1 or max_cp & (max_cp - 1):
        raise ValueError(
            f"parallel.dynamic_cp.max_cp must be a power of two >= 1, got {max_cp!r}; use 1, 2, 4 or 8"
        )


def cp_sizes(max_cp: int) -> tuple[int, ...]:
    """Every CP size dynamic CP may pick: 1, 2, 4, ..., max_cp."""
    _check_power_of_two(max_cp)
    return tuple(1 << i for i in range(max_cp.bit_length()))


@dataclass(frozen=True)
class DynamicCPPlan:
    """One micro-batch under dynamic CP: its CP size and which samples each sub-group runs."""

    cp_size: int  # d
    partitions: tuple[tuple[int, ...], ...]  # max_cp / d groups of indices into the micro-batch

    def samples_for(self, cp_rank: int) -> tuple[int, ...]:
        """Indices run by the sub-group of static CP rank ``cp_rank``."""
        return self.partitions[cp_rank // self.cp_size]


def _balanced_partitions(lengths: list[int], parts: int, cp_size: int) -> list[list[int]]:
    """Longest first, each to the partition with the fewest padded rows so far (ties: lowest
    index); indices keep their micro-batch order inside a partition."""
    loads = [0] * parts
    members: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        p = min(range(parts), key=lambda p: (loads[p], p))
        members[p].append(i)
        loads[p] += padded_length(lengths[i], cp_size)
    return [sorted(m) for m in members]


def _fits(partitions: list[list[int]], lengths: list[int], cp_size: int, max_tokens_per_gpu: int) -> bool:
    capacity = max_tokens_per_gpu * cp_size
    return all(sum(padded_length(lengths[i], cp_size) for i in p) <= capacity for p in partitions)


def plan_dynamic_cp(
    lengths: list[int], *, max_tokens_per_gpu: int, max_cp: int, min_cp: int = 1
) -> DynamicCPPlan:
    """The CP size and partitions of one micro-batch whose samples have ``lengths`` tokens.

    ``d`` starts at ``next_pow2(ceil(longest / max_tokens_per_gpu))`` (at least ``min_cp``) and
    grows while a sub-group would get no sample or a partition would exceed
    ``max_tokens_per_gpu * d`` padded rows. ``d = max_cp`` is one partition: the static plan.
    """
    sizes = cp_sizes(max_cp)
    if not lengths:  # an empty (padding-only) micro-batch: every rank idles at full CP
        return DynamicCPPlan(cp_size=max_cp, partitions=((),))
    longest = max(lengths)
    if padded_length(longest, max_cp) > max_tokens_per_gpu * max_cp:
        raise ValueError(
            f"a sample of {longest} tokens does not fit even at the largest CP size: "
            f"train.max_tokens_per_gpu * parallel.dynamic_cp.max_cp = {max_tokens_per_gpu} * {max_cp} = "
            f"{max_tokens_per_gpu * max_cp} rows (after padding to 2*max_cp); raise train.max_tokens_per_gpu or "
            "parallel.dynamic_cp.max_cp, or drop over-long samples at the source (data.max_sample_tokens)"
        )
    need = -(-longest // max_tokens_per_gpu)
    for d in sizes:
        if d < max(need, min_cp):
            continue
        parts = max_cp // d
        if len(lengths) < parts:
            continue  # some sub-group would have nothing to do
        partitions = _balanced_partitions(lengths, parts, d)
        if _fits(partitions, lengths, d, max_tokens_per_gpu):
            return DynamicCPPlan(cp_size=d, partitions=tuple(tuple(p) for p in partitions))
    # d = max_cp is a single partition holding everything; the caller planned it to fit
    if sum(padded_length(n, max_cp) for n in lengths) > max_tokens_per_gpu * max_cp:
        raise ValueError(
            f"micro-batch of {len(lengths)} samples ({sum(lengths)} tokens) exceeds "
            f"train.max_tokens_per_gpu * max_cp = {max_tokens_per_gpu * max_cp} rows: plan micro-batches "
            "with cp_size = parallel.dynamic_cp.max_cp"
        )
    return DynamicCPPlan(cp_size=max_cp, partitions=(tuple(range(len(lengths))),))


def plan_dynamic_cp_over_dp(
    lengths_per_dp_rank: list[list[list[int]]], *, max_tokens_per_gpu: int, max_cp: int
) -> list[list[DynamicCPPlan]]:
    """Plans for ``[dp_rank][micro_batch]`` (sample lengths) where every DP rank uses the same
    ``d`` for the same micro-batch index: the largest any DP rank needs (docs/design/LAYOUTS.md §5: MAX over
    DP), so the data-parallel ranks of one step stay in lock-step."""
    counts = {len(mbs) for mbs in lengths_per_dp_rank}
    if len(counts) > 1:
        raise ValueError(f"every DP rank needs the same number of micro-batches, got {sorted(counts)}")
    plans = [
        [plan_dynamic_cp(lengths, max_tokens_per_gpu=max_tokens_per_gpu, max_cp=max_cp) for lengths in mbs]
        for mbs in lengths_per_dp_rank
    ]
    agreed = []
    for dp_rank, mbs in enumerate(lengths_per_dp_rank):
        row = []
        for i, lengths in enumerate(mbs):
            d = max(p[i].cp_size for p in plans)
            row.append(
                plans[dp_rank][i]
                if plans[dp_rank][i].cp_size == d
                else plan_dynamic_cp(lengths, max_tokens_per_gpu=max_tokens_per_gpu, max_cp=max_cp, min_cp=d)
            )
        agreed.append(row)
    return agreed


class DynamicCPGroups:
    """Sub-groups of ``d`` consecutive ranks of every static CP group, for every ``d`` up to
    ``max_cp``, created once. Every rank must construct this (it calls ``new_group`` for every
    sub-group of every CP group, in the same order on all ranks).

    ``cp_group``: this rank's static CP group (size ``max_cp``); ``timeout``: the sub-groups'
    collective timeout (None: torch's default for the backend).
    """

    def __init__(self, cp_group: dist.ProcessGroup, max_cp: int, timeout: timedelta | None = None):
        sizes = cp_sizes(max_cp)
        if dist.get_world_size(cp_group) != max_cp:
            raise ValueError(
                f"parallel.dynamic_cp.max_cp={max_cp} must equal the CP group size "
                f"(parallel.cp={dist.get_world_size(cp_group)})"
            )
        my_ranks = dist.get_process_group_ranks(cp_group)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, tuple(my_ranks))  # once at start-up: every rank's CP group
        cp_groups = sorted(set(every))
        self.max_cp = max_cp
        self.cp_rank = my_ranks.index(dist.get_rank())
        self._groups: dict[int, dist.ProcessGroup | None] = {}
        for d in sizes:
            for ranks in cp_groups:
                for start in range(0, max_cp, d):
                    members = list(ranks[start : start + d])
                    group = cp_group if d == max_cp else dist.new_group(members, timeout=timeout)
                    if dist.get_rank() in members:
                        self._groups[d] = group

    def group(self, cp_size: int) -> dist.ProcessGroup:
        """This rank's sub-group of size ``cp_size``."""
        if cp_size not in self._groups:
            raise ValueError(f"no dynamic CP group of size {cp_size}; sizes are {sorted(self._groups)}")
        return self._groups[cp_size]

    def rank_in(self, cp_size: int) -> int:
        return self.cp_rank % cp_size


def dynamic_cp_micro_batches(
    plan, dp_rank: int, cp_rank: int, groups: DynamicCPGroups, max_tokens_per_gpu: int
):
    """Dynamic CP on top of a step's static micro-batch plan (``plan[dp][i]``: the samples of
    micro-batch ``i`` of DP rank ``dp``): micro-batch ``i`` of every DP rank runs at one CP size
    ``d`` (the MAX over DP ranks), its samples split over the CP group's sub-groups of size ``d``.
    Returns this rank's ``(samples, d, rank in sub-group, sub-group)`` list, the step's padded
    tokens and ``{d: packed micro-batches run at CP size d}`` for the whole step."""
    lengths = [[[len(s) for s in mb] for mb in mbs] for mbs in plan]
    cp_plans = plan_dynamic_cp_over_dp(lengths, max_tokens_per_gpu=max_tokens_per_gpu, max_cp=groups.max_cp)
    mine = []
    for samples, cp_plan in zip(plan[dp_rank], cp_plans[dp_rank]):
        d = cp_plan.cp_size
        mine.append(
            ([samples[j] for j in cp_plan.samples_for(cp_rank)], d, groups.rank_in(d), groups.group(d))
        )
    padded_tokens, counts = 0, {}
    for mbs, plans in zip(plan, cp_plans):
        for samples, cp_plan in zip(mbs, plans):
            padded_tokens += sum(padded_length(len(s), cp_plan.cp_size) for s in samples)
            counts[str(cp_plan.cp_size)] = counts.get(str(cp_plan.cp_size), 0) + len(cp_plan.partitions)
    return mine, padded_tokens, dict(sorted(counts.items(), key=lambda kv: int(kv[0])))
