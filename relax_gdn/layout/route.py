"""All-to-all routes between two THD layouts, built by interval intersection (LAYOUTS.md §2).

Both layouts tile the global rows ``[0, T)`` with a few intervals per rank. Cutting ``[0, T)`` at
every interval start of both layouts gives elementary runs that lie in exactly one source interval
and one target interval, so each run knows (source rank, source row, target rank, target row).
Everything is host integer work on O(W * #sequences) runs; only the final row lists are expanded
to O(T / W) and copied to the device once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from relax_gdn.layout.partition import CuSeqlens, layout_segments, validated_boundaries


@dataclass(frozen=True, eq=False)
class Route:
    """How one rank converts its rows from ``source`` layout to ``target`` layout.

    Rows sent to each destination are grouped by destination and, within a destination, ordered
    by the receiver's target row, so blocks arrive in order and one scatter places them.
    ``None`` row lists mean "identity": the buffer is used as is (zero copy).
    ``reverse()`` gives the mirror route (target -> source) sharing the same tensors.
    """

    send_rows: torch.Tensor | None  # local source rows to send, destination-major
    send_splits: tuple[int, ...]  # rows sent to each rank
    recv_rows: torch.Tensor | None  # local target row of each received row
    recv_splits: tuple[int, ...]  # rows received from each rank
    local_rows: int  # T / W: rows held per rank in either layout
    # Provenance: what the route was built for. Caches compare it with a request before reuse.
    cp_size: int
    cp_rank: int
    source: str
    target: str
    device: torch.device
    cu_seqlens: torch.Tensor | None = field(default=None, repr=False)
    cu_seqlens_version: int | None = None

    @property
    def is_identity(self) -> bool:
        """No row changes rank or position: the swap is a no-op without any collective."""
        own = self.send_splits[self.cp_rank]
        return self.send_rows is None and self.recv_rows is None and own == self.local_rows

    @functools.cached_property
    def _reversed(self) -> Route:
        return Route(
            send_rows=self.recv_rows,
            send_splits=self.recv_splits,
            recv_rows=self.send_rows,
            recv_splits=self.send_splits,
            local_rows=self.local_rows,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            source=self.target,
            target=self.source,
            device=self.device,
            cu_seqlens=self.cu_seqlens,
            cu_seqlens_version=self.cu_seqlens_version,
        )

    def reverse(self) -> Route:
        """The target -> source route: the same runs with send and receive roles exchanged."""
        return self._reversed

    def serves(self, source: str, target: str) -> bool:
        return {self.source, self.target} == {source, target}

    def oriented(self, source: str, target: str) -> Route:
        """This route or its mirror, whichever goes ``source -> target``."""
        return self if self.source == source else self.reverse()


def _expand(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``range(s, s + n)`` for each run, vectorised."""
    total = int(lengths.sum())
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(total, dtype=np.int64)


def _to_device(rows: np.ndarray, device: torch.device) -> torch.Tensor | None:
    if np.array_equal(rows, np.arange(rows.size, dtype=np.int64)):
        return None
    host = torch.from_numpy(rows)
    if device.type == "cuda":
        # pinned + non_blocking: the upload is queued on the stream, the host does not wait.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def build_route(
    cu_seqlens: CuSeqlens,
    cp_size: int,
    cp_rank: int,
    source: str,
    target: str,
    *,
    device: torch.device | str | None = None,
    provenance: torch.Tensor | None = None,
) -> Route:
    """Route for rank ``cp_rank`` from ``source`` to ``target`` layout of the packed batch ``cu_seqlens``.

    Pass a HOST copy of ``cu_seqlens`` (tensor, list or array) and building needs no device->host
    sync. ``device`` is where the row lists go (default: ``cu_seqlens``'s device, else CPU).
    ``provenance`` is the device tensor the route is cached for (see ``get_route``).
    """
    cu = validated_boundaries(cu_seqlens, cp_size, cp_rank, source, target)
    if device is None:
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    total = int(cu[-1])
    local_rows = total // cp_size

    src = layout_segments(cu, cp_size, source)
    tgt = layout_segments(cu, cp_size, target)
    run_start = np.union1d(src.start, tgt.start)
    run_start = run_start[run_start < total]
    run_len = np.diff(np.append(run_start, total))
    si = np.searchsorted(src.start, run_start, side="right") - 1
    ti = np.searchsorted(tgt.start, run_start, side="right") - 1
    src_rank, tgt_rank = src.rank[si], tgt.rank[ti]
    src_row = src.local_start[si] + run_start - src.start[si]
    tgt_row = tgt.local_start[ti] + run_start - tgt.start[ti]

    # Runs are in global order, which is also target-row (and source-row) order within a rank,
    # so a stable sort by the peer rank yields peer-major, target-row-minor order on both sides.
    mine = np.nonzero(src_rank == cp_rank)[0]
    mine = mine[np.argsort(tgt_rank[mine], kind="stable")]
    send_rows = _expand(src_row[mine], run_len[mine])
    send_splits = np.bincount(tgt_rank[mine], weights=run_len[mine], minlength=cp_size)

    theirs = np.nonzero(tgt_rank == cp_rank)[0]
    theirs = theirs[np.argsort(src_rank[theirs], kind="stable")]
    recv_rows = _expand(tgt_row[theirs], run_len[theirs])
    recv_splits = np.bincount(src_rank[theirs], weights=run_len[theirs], minlength=cp_size)

    return Route(
        send_rows=_to_device(send_rows, device),
        send_splits=tuple(int(n) for n in send_splits),
        recv_rows=_to_device(recv_rows, device),
        recv_splits=tuple(int(n) for n in recv_splits),
        local_rows=local_rows,
        cp_size=cp_size,
        cp_rank=cp_rank,
        source=source,
        target=target,
        device=device,
        cu_seqlens=provenance,
        cu_seqlens_version=None if provenance is None else provenance._version,
    )
