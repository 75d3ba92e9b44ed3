"""The two THD partitions of a packed micro-batch across CP ranks (docs/design/LAYOUTS.md §1).

* ``zigzag`` (per sequence): every sequence is cut into ``2W`` equal chunks; rank ``r`` holds
  chunks ``r`` and ``2W-1-r`` of EVERY sequence, stored sequence by sequence. This is what
  Transformer Engine / Megatron attention use for causal load balance.
* ``contiguous`` (global): rank ``r`` holds global rows ``[r*T/W, (r+1)*T/W)`` of the packed
  buffer, whatever the sequence boundaries. This is what FLA's chunkwise CP kernels expect.

Two views of the same fact live here: :func:`thd_rank_indices` is the per-token ground truth
(simple, slow, used by tests), and :func:`layout_segments` describes every rank's share as a few
global intervals, which is what the route builder intersects.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

LAYOUTS = ("zigzag", "contiguous")

CuSeqlens = torch.Tensor | Sequence[int] | np.ndarray


def check_layout(layout: str, what: str = "layout") -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown {what} {layout!r}: the known THD layouts are {LAYOUTS}")


def check_cp(cp_size: int, cp_rank: int) -> None:
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"rule 'cp_size >= 1' broken: cp_size={cp_size!r}")
    if not isinstance(cp_rank, int) or isinstance(cp_rank, bool) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"rule '0 <= cp_rank < cp_size' broken: cp_rank={cp_rank!r}, cp_size={cp_size}")


def host_boundaries(cu_seqlens: CuSeqlens) -> np.ndarray:
    """``cu_seqlens`` as a host int64 array, after checking the rules that need no CP size.

    A device tensor costs one device->host copy here; callers on the hot path pass the host copy
    the data pipeline already made.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"rule 'cu_seqlens is an integer tensor' broken: dtype={cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"rule 'cu_seqlens is 1-D' broken: shape={tuple(cu_seqlens.shape)}")
        cu = cu_seqlens.detach().cpu().numpy().astype(np.int64, copy=False)
    else:
        cu = np.asarray(cu_seqlens)
        if cu.ndim != 1:
            raise ValueError(f"rule 'cu_seqlens is 1-D' broken: shape={cu.shape}")
        if cu.size and not np.issubdtype(cu.dtype, np.integer):
            raise ValueError(f"rule 'cu_seqlens holds integers' broken: dtype={cu.dtype}")
        cu = cu.astype(np.int64, copy=False)
    if cu.size == 0:
        raise ValueError("rule 'cu_seqlens has at least one boundary' broken: cu_seqlens is empty")
    if cu[0] != 0:
        raise ValueError(f"rule 'cu_seqlens[0] == 0' broken: cu_seqlens[0]={int(cu[0])}")
    steps = cu[1:] - cu[:-1]
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(
            "rule 'cu_seqlens is non-decreasing' broken: "
            f"cu_seqlens[{i}]={int(cu[i])} > cu_seqlens[{i + 1}]={int(cu[i + 1])}"
        )
    return cu


def padded_length(length: int, cp_size: int) -> int:
    """``length`` rounded up to a multiple of ``2·cp_size``: what a document occupies once padded
    for the zigzag split into 2·cp chunks (rule of §1)."""
    unit = 2 * cp_size
    return -(-length // unit) * unit


def check_divisible(cu: np.ndarray, cp_size: int, layout: str) -> None:
    """The divisibility a layout needs: zigzag cuts every sequence in 2W chunks, contiguous cuts T in W."""
    if cp_size == 1:
        return
    if layout == "zigzag":
        lengths = cu[1:] - cu[:-1]
        bad = np.nonzero(lengths % (2 * cp_size))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                "rule 'every sequence length is a multiple of 2*cp_size' broken: "
                f"sequence {i} has length {int(lengths[i])}, not a multiple of 2*cp_size={2 * cp_size}; "
                "pad every packed document to a multiple of 2*cp_size"
            )
    elif int(cu[-1]) % cp_size:
        raise ValueError(
            "rule 'total length is a multiple of cp_size' broken: "
            f"T={int(cu[-1])}, cp_size={cp_size}; pad the packed micro-batch"
        )


def validated_boundaries(cu_seqlens: CuSeqlens, cp_size: int, cp_rank: int, *layouts: str) -> np.ndarray:
    """Every rule of docs/design/LAYOUTS.md §1 for (cu_seqlens, W, r, layouts); returns the host
    boundaries."""
    for layout in layouts:
        check_layout(layout)
    check_cp(cp_size, cp_rank)
    cu = host_boundaries(cu_seqlens)
    for layout in layouts:
        check_divisible(cu, cp_size, layout)
    return cu


def thd_rank_indices(cu_seqlens: CuSeqlens, cp_size: int, cp_rank: int, layout: str) -> torch.Tensor:
    """Reference partition: the global token ids rank ``cp_rank`` holds, in local storage order.

    Deliberately per token and independent of the interval code, so it can be the ground truth.
    """
    cu = validated_boundaries(cu_seqlens, cp_size, cp_rank, layout)
    total = int(cu[-1])
    if layout == "contiguous" or cp_size == 1:
        part = total // cp_size
        return torch.arange(cp_rank * part, (cp_rank + 1) * part, dtype=torch.long)
    pieces = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        token_ids = torch.arange(start, end, dtype=torch.long)
        chunks = token_ids.chunk(2 * cp_size) if end > start else ()
        if chunks:
            pieces += [chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)


@dataclass(frozen=True)
class Segments:
    """Every rank's share of one layout as global intervals, sorted by ``start``.

    Together the intervals of all ranks tile ``[0, T)`` exactly once. Within one rank, local rows
    grow with global position in both layouts, which is what lets routes be built by sorting.
    """

    start: np.ndarray  # global row of the interval's first token
    rank: np.ndarray  # CP rank that holds it
    local_start: np.ndarray  # its row in that rank's local storage


def layout_segments(cu: np.ndarray, cp_size: int, layout: str) -> Segments:
    """Interval description of ``layout`` for validated host boundaries ``cu`` (all ranks at once)."""
    total = int(cu[-1])
    j, owner, second, ranks = _zigzag_chunk_constants(cp_size)
    if layout == "contiguous" or cp_size == 1:  # with one rank both layouts are the identity
        return Segments(
            start=ranks * (total // cp_size), rank=ranks, local_start=np.zeros(cp_size, dtype=np.int64)
        )
    seq_start, lengths = cu[:-1], cu[1:] - cu[:-1]
    if not lengths.all():  # repeated boundaries are empty padding slots
        keep = lengths > 0
        seq_start, lengths = seq_start[keep], lengths[keep]
    chunk = (lengths // (2 * cp_size))[:, None]
    # Chunk j of a sequence lives on rank owner[j] as its first or second (second[j]) local chunk;
    # each rank holds L_i / W rows of every sequence, so sequence i starts at cu_i / W locally.
    return Segments(
        start=(seq_start[:, None] + j * chunk).ravel(),
        rank=np.tile(owner, seq_start.size),
        local_start=((seq_start // cp_size)[:, None] + second * chunk).ravel(),
    )


@functools.cache
def _zigzag_chunk_constants(cp_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(natural chunk index j = 0..2W-1, the rank holding chunk j = min(j, 2W-1-j), 1 where chunk j
    is its rank's second local chunk, ranks 0..W-1): shared by every route build of this W, since
    a route's host time is its count of numpy calls. Read-only."""
    j = np.arange(2 * cp_size, dtype=np.int64)
    constants = (j, np.minimum(j, 2 * cp_size - 1 - j), (j >= cp_size).astype(np.int64), j[:cp_size].copy())
    for a in constants:
        a.flags.writeable = False
    return constants
