"""All-to-all routes between two THD layouts, built by interval intersection (docs/design/LAYOUTS.md §2).

Both layouts tile the global rows ``[0, T)`` with a few intervals per rank. Cutting ``[0, T)`` at
every interval start of both layouts gives elementary runs that lie in exactly one source interval
and one target interval, so each run knows (source rank, source row, target rank, target row).
Everything is host integer work on O(W * #sequences) runs; only the final row lists are expanded
to O(T / W) and copied to the device once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from relax_gdn.layout.partition import CuSeqlens, layout_segments, validated_boundaries

Rows = slice | torch.Tensor
"""A selection of local rows: a ``slice`` when they are one contiguous range (zero-copy view),
else a device index tensor."""


def take_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


# ``index_copy_`` moves one ELEMENT per thread: scattering bf16 rows as 16-byte words needs 8x
# fewer threads and index computations (faster: ``python -m relax_gdn.bench.swap``'s scatter
# table, docs/benchmarks.md; ``index_select`` is as fast either way, so gathers stay plain).
# Rows move as raw bytes, so any dtype of the same width works: complex128 is just torch's
# 16-byte element, nothing reads it as a number.
_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32)


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (dim 0) of ``t``, from its shape: no ``t[0]`` view (host time per call)."""
    return math.prod(t.shape[1:]) * t.element_size()


def _as_wide_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, rows on dim 0) viewed as ``[rows, words]`` of the widest element that
    divides a row's bytes and the storage offset; ``t`` itself when none does."""
    if t.dim() == 0 or not t.is_contiguous():
        return t
    t_row_bytes = row_bytes(t)
    offset_bytes = t.storage_offset() * t.element_size()
    for wide in _WIDE_DTYPES:
        size = wide.itemsize
        if size > t.element_size() and t_row_bytes and t_row_bytes % size == 0 and offset_bytes % size == 0:
            return t.reshape(t.shape[0], t_row_bytes // t.element_size()).view(wide)
    return t


def put_rows(out: torch.Tensor, rows: Rows, values: torch.Tensor, as_words: bool = True) -> None:
    """``out[rows] = values``; ``as_words=False`` scatters element by element (the benchmark's
    comparison)."""
    if isinstance(rows, slice):
        out[rows].copy_(values)
        return
    wide_out, wide_values = _as_wide_rows(out), _as_wide_rows(values.contiguous())
    if as_words and wide_out is not out and wide_values.dtype == wide_out.dtype:
        wide_out.index_copy_(0, rows, wide_values)
    else:
        out.index_copy_(0, rows, values)


def copy_rows(out: torch.Tensor, out_rows: Rows, x: torch.Tensor, x_rows: Rows) -> None:
    """``out[out_rows] = x[x_rows]`` in ONE pass over the rows when either side is a range (the
    gather writes straight into the destination range; a source range is read as a view)."""
    if isinstance(out_rows, slice) and not isinstance(x_rows, slice):
        torch.index_select(x, 0, x_rows, out=out[out_rows])
    else:
        put_rows(out, out_rows, take_rows(x, x_rows))


def rows_as_tensor(rows: Rows) -> torch.Tensor:
    """The selected row ids as a CPU tensor (for tests and debugging, not the hot path)."""
    if isinstance(rows, slice):
        return torch.arange(rows.start, rows.stop)
    return rows.cpu()


@dataclass(frozen=True, eq=False)
class Route:
    """How one rank converts its rows from ``source`` layout to ``target`` layout.

    Rows that stay on this rank move by one local copy (``keep_source`` -> ``keep_target``) that
    overlaps the all-to-all; only rows for other ranks go through it. Those are sent grouped by
    destination and, within a destination, ordered by the receiver's target row, so blocks
    arrive in order and one scatter (``recv_rows``) places them. Row selections that are one
    contiguous range are slices: zero-copy views, no gather or scatter kernel.
    ``reverse()`` gives the mirror route (target -> source) sharing the same tensors.
    """

    # The whole exchange: pair_rows[s][d] = rows rank s sends to rank d (diagonal: kept rows).
    # This rank's splits are its row and column; a transport that reads peers' packed buffers
    # also needs the other rows to find its block in each.
    pair_rows: tuple[tuple[int, ...], ...]
    keep_source: Rows  # own-rank rows, in source storage ...
    keep_target: Rows  # ... and where they go in target storage (same order)
    send_rows: Rows  # source rows for OTHER ranks, destination-major, receiver-row order
    recv_rows: Rows  # target row of each row received from other ranks, source-major
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
        """On EVERY rank no row moves (CP = 1, same layout, or nothing packed): the swap is a no-op
        with no collective. Decided on facts all ranks share, so no rank skips a collective that
        its peers enter."""
        return self.cp_size == 1 or self.source == self.target or self.local_rows == 0

    # cached: a swap runs several times per layer and micro-batch; its host time is on the clock
    @functools.cached_property
    def send_splits(self) -> tuple[int, ...]:
        """Rows this rank's source sends to each rank (own rank included)."""
        return self.pair_rows[self.cp_rank]

    @functools.cached_property
    def recv_splits(self) -> tuple[int, ...]:
        """Rows this rank's target receives from each rank."""
        return tuple(row[self.cp_rank] for row in self.pair_rows)

    @functools.cached_property
    def wire_send_splits(self) -> list[int]:
        """Split sizes of the all-to-all: own-rank rows never go on the wire."""
        return [0 if d == self.cp_rank else n for d, n in enumerate(self.send_splits)]

    @functools.cached_property
    def wire_recv_splits(self) -> list[int]:
        return [0 if s == self.cp_rank else n for s, n in enumerate(self.recv_splits)]

    @functools.cached_property
    def _reversed(self) -> Route:
        return Route(
            pair_rows=tuple(zip(*self.pair_rows)),
            keep_source=self.keep_target,
            keep_target=self.keep_source,
            send_rows=self.recv_rows,
            recv_rows=self.send_rows,
            local_rows=self.local_rows,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            source=self.target,
            target=self.source,
            device=self.device,
            cu_seqlens=self.cu_seqlens,
            cu_seqlens_version=self.cu_seqlens_version,
        )

    @functools.cached_property
    def peer_block_starts(self) -> list[int]:
        """Row offset, in each peer's destination-major send buffer, of the block it sends to
        this rank: its rows for the ranks before this one (its own rank never goes on the wire)."""
        me = self.cp_rank
        return [sum(n for d, n in enumerate(self.pair_rows[s][:me]) if d != s) for s in range(self.cp_size)]

    def reverse(self) -> Route:
        """The target -> source route: the same runs with send and receive roles exchanged."""
        return self._reversed

    def serves(self, source: str, target: str) -> bool:
        return {self.source, self.target} == {source, target}

    def oriented(self, source: str, target: str) -> Route:
        """This route or its mirror, whichever goes ``source -> target``."""
        return self if self.source == source else self.reverse()


def expand_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concat(range(s, s + n))`` over the runs, vectorised (int64)."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def upload_rows(
    rows: np.ndarray, device: torch.device | str, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """Host values (integers unless ``dtype`` says otherwise) to ``device`` without making the host
    wait for the device."""
    device = torch.device(device)
    host = torch.from_numpy(np.ascontiguousarray(rows))
    if host.dtype != dtype:
        host = host.to(dtype)
    if device.type == "cuda":
        # pinned + non_blocking: the upload is queued on the stream, the host does not wait.
        return host.pin_memory().to(device, non_blocking=True)
    return host if device.type == "cpu" else host.to(device)


def _rows(starts: np.ndarray, lengths: np.ndarray, device: torch.device) -> Rows:
    """``concat(range(s, s + n))`` over the runs: a slice when the runs chain into one range
    (decided on the runs, before anything is expanded), else a device index tensor."""
    if starts.size == 0:  # runs are never empty, so no runs means no rows
        return slice(0, 0)
    ends = starts + lengths
    if (starts[1:] == ends[:-1]).all():
        return slice(int(starts[0]), int(ends[-1]))
    return upload_rows(expand_runs(starts, lengths), device)


def _locate(
    run_start: np.ndarray, segments, cp_size: int, total: int, layout: str
) -> tuple[np.ndarray, np.ndarray]:
    """(rank, local row) of every run start in ``layout``: arithmetic for contiguous (rank r holds
    ``[r T/W, (r+1) T/W)``), a sorted lookup in the interval list otherwise."""
    if layout == "contiguous" or cp_size == 1:
        part = total // cp_size
        rank = run_start // part
        return rank, run_start - rank * part
    i = np.searchsorted(segments.start, run_start, side="right") - 1
    return segments.rank[i], segments.local_start[i] + (run_start - segments.start[i])


def _elementary_runs(source_starts: np.ndarray, target_starts: np.ndarray, total: int):
    """``(start, length)`` of the runs of rows that no interval of either layout cuts: a run starts at
    every interval start of either. A sort plus a neighbour test is several times cheaper than
    np.union1d's hashing at these sizes (host time is the whole cost of a route)."""
    cuts = np.concatenate((source_starts, target_starts))
    cuts.sort()
    run_start = cuts[np.concatenate(([True], cuts[1:] != cuts[:-1])) & (cuts < total)]
    run_len = np.empty_like(run_start)
    run_len[:-1] = run_start[1:] - run_start[:-1]
    if run_len.size:
        run_len[-1] = total - run_start[-1]
    return run_start, run_len


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

    src = layout_segments(cu, cp_size, source)
    tgt = layout_segments(cu, cp_size, target)
    run_start, run_len = _elementary_runs(src.start, tgt.start, total)
    src_rank, src_row = _locate(run_start, src, cp_size, total, source)
    tgt_rank, tgt_row = _locate(run_start, tgt, cp_size, total, target)

    # Runs are in global order, which is also target-row (and source-row) order within a rank,
    # so a stable sort by the peer rank yields peer-major, target-row-minor order on both sides.
    from_me, to_me = src_rank == cp_rank, tgt_rank == cp_rank
    kept = from_me & to_me
    outgoing = np.nonzero(from_me & ~to_me)[0]
    incoming = np.nonzero(to_me & ~from_me)[0]
    if cp_size > 2:  # with two ranks every moved run has the same peer: already in order
        outgoing = outgoing[np.argsort(tgt_rank[outgoing], kind="stable")]
        incoming = incoming[np.argsort(src_rank[incoming], kind="stable")]
    pair_rows = np.bincount(src_rank * cp_size + tgt_rank, weights=run_len, minlength=cp_size * cp_size)
    pair_rows = pair_rows.astype(np.int64).reshape(cp_size, cp_size)

    return Route(
        pair_rows=tuple(map(tuple, pair_rows.tolist())),
        keep_source=_rows(src_row[kept], run_len[kept], device),
        keep_target=_rows(tgt_row[kept], run_len[kept], device),
        send_rows=_rows(src_row[outgoing], run_len[outgoing], device),
        recv_rows=_rows(tgt_row[incoming], run_len[incoming], device),
        local_rows=total // cp_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        source=source,
        target=target,
        device=device,
        cu_seqlens=provenance,
        cu_seqlens_version=None if provenance is None else provenance._version,
    )


@dataclass(frozen=True, eq=False)
class GatheredOrder:
    """Row maps between the RANK-MAJOR concatenation of every rank's zigzag shard (what an
    all-gather or a sequence all-to-all produces) and the natural order of the packed batch."""

    natural_rows: torch.Tensor  # natural[i] = rank_major[natural_rows[i]]
    rank_major_rows: torch.Tensor  # rank_major[j] = natural[rank_major_rows[j]]
    local_rows: int  # T / W
    # host copy of rank_major_rows (what host-side index builders read without a device copy)
    rank_major_host: np.ndarray | None = field(default=None, repr=False)

    def own_rows(self, cp_rank: int) -> torch.Tensor:
        """Natural-order ids of the rows ``cp_rank`` holds, in its local (zigzag) order."""
        return self.rank_major_rows[cp_rank * self.local_rows : (cp_rank + 1) * self.local_rows]


def gathered_zigzag_order(cu_seqlens: CuSeqlens, cp_size: int, device: torch.device | str) -> GatheredOrder:
    """Host-built (no sync when ``cu_seqlens`` is a host copy) maps for a gathered zigzag batch."""
    cu = validated_boundaries(cu_seqlens, cp_size, 0, "zigzag")
    device = torch.device(device)
    local_rows = int(cu[-1]) // cp_size
    seg = layout_segments(cu, cp_size, "zigzag")
    lengths = np.diff(np.append(seg.start, int(cu[-1])))
    natural = expand_runs(seg.rank * local_rows + seg.local_start, lengths)
    by_rank = np.lexsort((seg.local_start, seg.rank))  # rank-major order of the segments
    rank_major = expand_runs(seg.start[by_rank], lengths[by_rank])
    return GatheredOrder(
        upload_rows(natural, device), upload_rows(rank_major, device), local_rows, rank_major_host=rank_major
    )
