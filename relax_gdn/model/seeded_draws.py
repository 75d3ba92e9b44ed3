"""Seeded draws that any TP rank makes for its own share of a tensor alone: each element's value is a
pure function of a key and the element's place in the WHOLE tensor, so every TP size, and the CPU and
a GPU, draw the same tensor (:func:`relax_gdn.model.lora.seed_base_weights`, the base of a LoRA run
without a Hugging Face checkpoint)."""

from __future__ import annotations

import math

import torch

from relax_gdn.model.hf_checkpoint.plan import TensorRule, TPSplit, shard_for_tp

_MASK32 = 0xFFFFFFFF
_SEED_ROWS = 16_384  # rows drawn at once (bounds the int64 temporaries)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x · c mod 2^32`` for ``x < 2^32`` in int64 without overflow (16-bit halves)."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of ``x < 2^32``, elementwise in int64."""
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def uniform_at(index: torch.Tensor, key: int) -> torch.Tensor:
    """A uniform draw in (0, 1) (float64) for each element index of a tensor, keyed by ``key``:
    a pure function of the index, so any shard of a tensor is drawn without the rest and every TP
    size, and the CPU and a GPU, draw the same value."""
    h = _hash32(_hash32(index ^ (key & _MASK32)) ^ ((key >> 32) & _MASK32))
    return (h.double() + 0.5) / 2.0**32


def seeded_values(rule: TensorRule, target: torch.Tensor, tp_group, key: int, low_high) -> torch.Tensor:
    """This rank's share of ``rule``'s whole tensor, each element ``low_high(u)`` of its own draw."""
    full = rule.mcore_shape
    width = math.prod(full[1:])
    if full[0] * width >= 2**32:
        raise ValueError(f"{rule.mcore}: {full} has too many elements to seed")
    group_size, group_rank = (1, 0) if tp_group is None else (tp_group.size(), tp_group.rank())
    split = rule.tp if rule.tp.dim is not None else TPSplit(None)
    rows = torch.arange(full[0])[:, None]
    cols = torch.arange(width)[None, :]
    if split.dim == 0:
        rows = shard_for_tp(rows, split, group_size, group_rank)
    elif split.dim == 1:
        cols = shard_for_tp(cols, split, group_size, group_rank)
    rows, cols = rows.to(target.device), cols.to(target.device)
    out = torch.empty(rows.shape[0], cols.shape[1], dtype=target.dtype, device=target.device)
    for start in range(0, rows.shape[0], _SEED_ROWS):
        index = rows[start : start + _SEED_ROWS] * width + cols
        out[start : start + _SEED_ROWS] = low_high(uniform_at(index, key)).to(target.dtype)
    return out.reshape(target.shape)


__all__ = ["seeded_values", "uniform_at"]
