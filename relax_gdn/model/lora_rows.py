"""Where each LoRA adapter of a column-parallel layer writes: its HF module's base output rows on
this TP rank, derived from the HF conversion plan (:mod:`relax_gdn.model.hf_checkpoint.plan`), the one
place that knows how Megatron-Core's fused linears (``in_proj``, ``linear_qkv``, ``linear_fc1``) lay
out their HF modules' rows and how TP cuts them."""

from __future__ import annotations

import torch

from relax_gdn.model.hf_checkpoint.plan import COLUMN, TensorRule, TPSplit, shard_for_tp


def part_splits(rule: TensorRule) -> list[TPSplit]:
    """How TP cuts each HF tensor of a column-parallel ``rule`` (in HF row order): by the rule's
    sections that fall in it (a stacked rule), else whole."""
    counts = [shape[0] for shape in rule.hf_shapes]
    if rule.tp.sections is None:
        return [COLUMN] * len(counts)
    sections, splits = list(rule.tp.sections), []
    for n in counts:
        taken = []
        while sum(taken) < n:
            taken.append(sections.pop(0))
        if sum(taken) != n:
            raise ValueError(
                f"{rule.mcore}: TP sections {rule.tp.sections} do not fall on its HF tensors {counts}"
            )
        splits.append(TPSplit(0, tuple(taken)) if len(taken) > 1 else COLUMN)
    return splits


def column_rows(rule: TensorRule, leaves: list[str], tp_size: int, tp_rank: int):
    """For the HF tensors ``leaves`` of a column-parallel ``rule`` (a plan made with hidden size 1):
    each one's TP split, and this rank's base output rows of each one's local B rows, in order.

    Row ids in HF order are pushed through the rule's merge (the HF -> Megatron-Core layout) and
    its TP cut; every row of a local B share must land on this rank."""
    counts = [shape[0] for shape in rule.hf_shapes]
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    ids = [torch.arange(o + 1, o + n + 1, dtype=torch.float64)[:, None] for o, n in zip(offsets, counts)]
    merged = rule.merge(ids)  # (a padded vocabulary adds rows of 0: no HF row)
    local = shard_for_tp(merged, rule.tp, tp_size, tp_rank)[:, 0].long() - 1
    where = torch.full((sum(counts),), -1, dtype=torch.long)
    mine = local >= 0
    where[local[mine]] = torch.arange(local.numel())[mine]
    names = [n.split(".")[-2] for n in rule.hf]
    splits, rows = {}, []
    for leaf in leaves:
        i = names.index(leaf)
        split = part_splits(rule)[i]
        share = shard_for_tp(torch.arange(counts[i])[:, None], split, tp_size, tp_rank)[:, 0] + offsets[i]
        at = where[share]
        if (at < 0).any():
            raise ValueError(
                f"LoRA on {leaf} of {rule.mcore}: TP {tp_size} does not keep its rows on one rank; "
                "use a parallel.tp that divides the attention query groups"
            )
        splits[leaf] = split
        rows.append(at)
    return splits, torch.cat(rows), local.numel()


def rows_mode(rows: torch.Tensor, total: int) -> tuple[str, torch.Tensor]:
    """How a column layer places the adapters' outputs (see
    :class:`~relax_gdn.model.lora.LoRAColumnParallel`)."""
    if rows.numel() == total and torch.equal(rows, torch.arange(total)):
        return "identity", rows
    if rows.numel() == total:
        inverse = torch.empty_like(rows)
        inverse[rows] = torch.arange(total)
        return "permute", inverse
    return "scatter", rows


__all__ = ["column_rows", "part_splits", "rows_mode"]
