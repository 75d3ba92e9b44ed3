"""The ONE place that decides which CP group a micro-batch runs on (docs/design/LAYOUTS.md §5).

Static CP: the model's CP group. Dynamic CP: the data side puts a sub-group and its size on
``PackedSeqParams.cp_group`` / ``local_cp_size`` for this micro-batch; every GDN and attention
layer resolves its group here, so they can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class CPGroup:
    group: dist.ProcessGroup | None  # None: a single rank, no collective ever
    size: int
    rank: int


def _size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return group.size(), group.rank()


def resolve_cp_group(packed_seq_params, static_group: dist.ProcessGroup | None) -> CPGroup:
    """CP group, size and rank for this micro-batch; inconsistent dynamic-CP metadata is an error."""
    dynamic_group = getattr(packed_seq_params, "cp_group", None)
    local_cp_size = getattr(packed_seq_params, "local_cp_size", None)
    if dynamic_group is None and local_cp_size is None:
        return CPGroup(static_group, *_size_and_rank(static_group))
    if dynamic_group is None or local_cp_size is None:
        raise ValueError(
            "dynamic CP metadata is incomplete: PackedSeqParams.cp_group and local_cp_size must be "
            f"set together (cp_group={'set' if dynamic_group is not None else None}, "
            f"local_cp_size={local_cp_size}); the data side sets both per micro-batch"
        )
    size, rank = _size_and_rank(dynamic_group)
    if size != local_cp_size:
        raise ValueError(
            f"dynamic CP metadata disagrees: PackedSeqParams.local_cp_size={local_cp_size} but its "
            f"cp_group has {size} ranks"
        )
    return CPGroup(dynamic_group, size, rank)
