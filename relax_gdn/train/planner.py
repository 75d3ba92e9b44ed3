"""This rank's micro-batches of a global batch: :class:`MicroBatchPlanner`.

A global batch is planned identically on every rank (``relax_gdn.data.plan_micro_batches``: the
micro-batches of every DP rank, a pure function of the samples); this rank keeps its DP rank's
micro-batches and shards each for its CP rank. With dynamic CP each micro-batch runs at its own CP
size ``d``, its samples split over the CP group's sub-groups of size ``d``
(``relax_gdn.parallel.dynamic_cp_micro_batches``). The training step and the evaluator both plan
through here, so an eval set is packed exactly as a training global batch is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from relax_gdn.data import MicroBatch, Sample, make_micro_batch, padded_length, plan_micro_batches
from relax_gdn.parallel import ParallelContext, dynamic_cp_micro_batches


@dataclass(frozen=True)
class PlannedMicroBatch:
    """One micro-batch this rank runs, before it is built."""

    samples: list[Sample]  # this rank's CP group's share (dynamic CP: its sub-group's)
    cp_size: int  # the CP size it runs at
    cp_rank: int  # this rank's place in that CP group
    cp_group: dist.ProcessGroup | None


@dataclass(frozen=True)
class StepPlan:
    """This rank's share of one global batch, and what the whole batch costs."""

    micro_batches: list[PlannedMicroBatch]
    padded_tokens: int  # tokens of the whole global batch after CP padding (every rank alike)
    cp_size_counts: dict[str, int] | None  # dynamic CP: packed micro-batches per CP size; else None


class MicroBatchPlanner:
    """Plans and builds this rank's micro-batches under the run's parallel layout."""

    def __init__(
        self,
        parallel: ParallelContext,
        *,
        max_tokens_per_gpu: int,
        device: torch.device,
        pad_id: int,
        route_strategy: str,
        mtp: bool = False,
    ):
        """Args:
        parallel: the run's process groups (DP / CP ranks, dynamic-CP sub-groups).
        max_tokens_per_gpu: packed tokens per micro-batch per rank (``train.max_tokens_per_gpu``).
        device: where the micro-batch tensors go.
        pad_id: the tokenizer's padding id.
        route_strategy: when zigzag<->contiguous routes are built (``gdn.route``).
        mtp: the micro-batches carry the multi-token-prediction targets (``model.mtp.num_layers``).
        """
        self.parallel = parallel
        self.max_tokens_per_gpu = max_tokens_per_gpu
        self.device = device
        self.pad_id = pad_id
        self.route_strategy = route_strategy
        self.mtp = mtp

    def plan(self, batch: list[Sample]) -> StepPlan:
        """This rank's micro-batches of the global batch ``batch``."""
        p = self.parallel
        plan = plan_micro_batches(
            batch, max_tokens_per_gpu=self.max_tokens_per_gpu, cp_size=p.cp, dp_size=p.dp
        )
        if p.dynamic_groups is not None:
            mine, padded_tokens, counts = dynamic_cp_micro_batches(
                plan, p.dp_rank, p.cp_rank, p.dynamic_groups, self.max_tokens_per_gpu
            )
            return StepPlan([PlannedMicroBatch(*planned) for planned in mine], padded_tokens, counts)
        mine = [PlannedMicroBatch(samples, p.cp, p.cp_rank, p.cp_group) for samples in plan[p.dp_rank]]
        return StepPlan(mine, sum(padded_length(len(s), p.cp) for s in batch), None)

    def build(self, planned: PlannedMicroBatch) -> MicroBatch:
        """The micro-batch's tensors on the device (this rank's zigzag shard)."""
        return make_micro_batch(
            planned.samples,
            cp_size=planned.cp_size,
            cp_rank=planned.cp_rank,
            device=self.device,
            pad_id=self.pad_id,
            route_strategy=self.route_strategy,
            cp_group=planned.cp_group,
            carries_cp_group=self.parallel.dynamic_groups is not None,
            mtp=self.mtp,
        )

    def micro_batches(self, samples: list[Sample]) -> Iterator[MicroBatch]:
        """This rank's built micro-batches of ``samples``, packed as a training global batch."""
        return (self.build(planned) for planned in self.plan(samples).micro_batches)
