"""Swap transport through symmetric (peer-mapped) GPU memory: pack -> device barrier -> pull.

The all-to-all transport makes three passes over the moved rows: a gather into a send buffer,
NCCL's copy over the wire into a receive buffer, and a scatter into place. On GPUs that map each
other's memory (one NVLink host), a rank can instead READ its peers' packed rows straight into
place: each rank gathers the rows it sends into its symmetric staging buffer, a device-side
barrier (a kernel on the current stream, no host wait) says every peer has packed, and each rank
scatters the peers' packed blocks into its output through the peer mapping. The copy over
NVLink and the scatter are one kernel.

Staging buffers are double-buffered: call n packs into half n % 2. A rank can only pack into a
half again (call n + 2) after passing the barrier of call n + 1, which each peer reaches only
after its reads of call n have run (stream order), so one barrier per call is enough.

Buffers are allocated once per (group, device) and grown by powers of two; allocation is a
collective, host-blocking rendezvous, decided on facts every rank shares (rows per rank and row
bytes), so steady-state calls issue no host sync. Requires the NCCL group's ranks to be GPUs of
one host with peer access (symmetric memory's CUDA backend); multicast is not used.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from relax_gdn.layout.route import Route, Rows, copy_rows, put_rows, row_bytes


@dataclass
class _Pulls:
    """Views one call reuses for a (route, staging half, row shape): building them costs more
    host time than issuing the copies."""

    pack: torch.Tensor  # this rank's packed send rows in its staging half
    blocks: list[tuple[torch.Tensor, Rows]]  # (peer's block for this rank, where its rows go)


@dataclass
class _Staging:
    """One rank's symmetric staging memory for one group: two halves of ``half_bytes``."""

    local: torch.Tensor  # uint8 [2 * half_bytes], this rank's buffer
    peers: list[torch.Tensor]  # the same buffer of every rank, mapped into this device
    handle: object  # torch's _SymmetricMemory (barrier)
    half_bytes: int
    calls: int = 0
    # Per route (dropped with it: routes live per micro-batch), per (half, dtype, row shape).
    pulls: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def pulls_for(self, route: Route, half: int, x: torch.Tensor) -> _Pulls:
        per_route = self.pulls.get(route)
        if per_route is None:
            per_route = self.pulls[route] = {}
        key = (half, x.dtype, x.shape[1:])
        if key not in per_route:
            x_row_bytes = row_bytes(x)
            base = half * self.half_bytes
            blocks, received = [], 0
            # Each peer packed its rows destination-major (``peer_block_starts`` finds this
            # rank's block); received rows are source-major, so peer s's block fills recv_rows'
            # next entries.
            for peer, (count, start) in enumerate(zip(route.wire_recv_splits, route.peer_block_starts)):
                if count:
                    block = _rows_view(self.peers[peer], base + start * x_row_bytes, count, x)
                    blocks.append((block, _sub_rows(route.recv_rows, received, received + count)))
                    received += count
            per_route[key] = _Pulls(_rows_view(self.local, base, sum(route.wire_send_splits), x), blocks)
        return per_route[key]


_STAGING: dict[tuple[str, torch.device], _Staging] = {}


def _staging(group: dist.ProcessGroup, device: torch.device, need_bytes: int) -> _Staging:
    import torch.distributed._symmetric_memory as symm_mem

    key = (group.group_name, device)
    held = _STAGING.get(key)
    if held is not None and held.half_bytes >= need_bytes:
        return held
    if held is not None:
        # Peers may still be reading the old buffer (their scatters of the last call): the
        # device barrier orders them before this point, the host wait before the free.
        held.handle.barrier(channel=0)
        torch.cuda.current_stream(device).synchronize()
    half = 1 << max(20, math.ceil(math.log2(max(need_bytes, 1))))  # >= 1 MiB, powers of two
    try:
        local = symm_mem.empty(2 * half, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(local, group)
    except RuntimeError as err:
        raise RuntimeError(
            f"gdn.swap_transport=peer_memory could not map {2 * half} bytes of symmetric memory "
            f"across the CP group (ranks {dist.get_process_group_ranks(group)}): {err}. Its GPUs must "
            "be on one host with peer access; set gdn.swap_transport=all_to_all"
        ) from err
    peers = [handle.get_buffer(r, (2 * half,), torch.uint8, 0) for r in range(dist.get_world_size(group))]
    held = _Staging(local=local, peers=peers, handle=handle, half_bytes=half)
    _STAGING[key] = held
    return held


def _rows_view(buffer: torch.Tensor, start_byte: int, rows: int, like: torch.Tensor) -> torch.Tensor:
    """``rows`` rows shaped like ``like``'s, stored at ``buffer[start_byte:]``."""
    raw = buffer[start_byte : start_byte + rows * row_bytes(like)]
    return raw.view(like.dtype).view(rows, *like.shape[1:])


def _sub_rows(rows, start: int, stop: int):
    """Rows ``[start, stop)`` of a row selection (a view, no copy)."""
    if isinstance(rows, slice):
        return slice(rows.start + start, rows.start + stop)
    return rows[start:stop]


def exchange_through_peer_memory(x: torch.Tensor, route: Route, group: dist.ProcessGroup) -> torch.Tensor:
    """Move rows of ``x`` along ``route`` (see the module doc); the same result as the all-to-all."""
    x = x.contiguous()
    staging = _staging(group, x.device, route.local_rows * row_bytes(x))
    pulls = staging.pulls_for(route, staging.calls % 2, x)
    staging.calls += 1
    out = x.new_empty((route.local_rows, *x.shape[1:]))
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    # Issue order is the latency of one call: the pack, the barrier and the pulls go first; the
    # own-rank rows follow on a side stream forked before the pack, so on the GPU they still
    # overlap the pack, the barrier's wait and the pulls (NVLink-bound, not bound by this GPU's
    # memory). The current stream joins it before returning, so x and out outlive its work
    # without record_stream.
    side.wait_stream(main)
    copy_rows(pulls.pack, slice(0, pulls.pack.shape[0]), x, route.send_rows)
    staging.handle.barrier(channel=0)
    for block, rows in pulls.blocks:
        put_rows(out, rows, block)
    with torch.cuda.stream(side):
        copy_rows(out, route.keep_target, x, route.keep_source)
    main.wait_stream(side)
    return out


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def group_is_on_this_host(group: dist.ProcessGroup) -> bool:
    """Whether every rank of ``group`` runs on this host, as torchrun places ranks (node n holds
    global ranks ``[n L, (n+1) L)``, ``L = LOCAL_WORLD_SIZE``). False when the launcher does not
    say (no ``LOCAL_WORLD_SIZE``): peer memory is then never chosen automatically."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local <= 0:
        return False
    node = dist.get_rank() // local
    return all(r // local == node for r in dist.get_process_group_ranks(group))
