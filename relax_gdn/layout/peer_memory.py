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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from relax_gdn.layout.route import Route, copy_rows, put_rows


@dataclass
class _Staging:
    """One rank's symmetric staging memory for one group: two halves of ``half_bytes``."""

    local: torch.Tensor  # uint8 [2 * half_bytes], this rank's buffer
    peers: list[torch.Tensor]  # the same buffer of every rank, mapped into this device
    handle: object  # torch's _SymmetricMemory (barrier)
    half_bytes: int
    calls: int = 0


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
    row_bytes = like[0].numel() * like.element_size() if like.shape[0] else 0
    raw = buffer[start_byte : start_byte + rows * row_bytes]
    return raw.view(like.dtype).view(rows, *like.shape[1:])


def _sub_rows(rows, start: int, stop: int):
    """Rows ``[start, stop)`` of a row selection (a view, no copy)."""
    if isinstance(rows, slice):
        return slice(rows.start + start, rows.start + stop)
    return rows[start:stop]


def exchange_through_peer_memory(x: torch.Tensor, route: Route, group: dist.ProcessGroup) -> torch.Tensor:
    """Move rows of ``x`` along ``route`` (see the module doc); the same result as the all-to-all."""
    x = x.contiguous()
    row_bytes = x[0].numel() * x.element_size() if x.shape[0] else 0
    staging = _staging(group, x.device, route.local_rows * row_bytes)
    half = staging.calls % 2
    staging.calls += 1
    base = half * staging.half_bytes

    out = x.new_empty((route.local_rows, *x.shape[1:]))
    # Own-rank rows move on a side stream, overlapping the pack, the barrier's wait and the pulls
    # (which are bound by NVLink, not by this GPU's memory). The current stream joins it before
    # returning, so x and out outlive its work without record_stream.
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        copy_rows(out, route.keep_target, x, route.keep_source)

    sent = sum(route.wire_send_splits)
    copy_rows(_rows_view(staging.local, base, sent, x), slice(0, sent), x, route.send_rows)
    staging.handle.barrier(channel=0)

    # Each peer packed its rows destination-major (``peer_block_starts`` finds this rank's block);
    # received rows are source-major, so peer s's block fills recv_rows' next entries.
    received = 0
    for peer, (count, start) in enumerate(zip(route.wire_recv_splits, route.peer_block_starts)):
        if count == 0:
            continue
        block = _rows_view(staging.peers[peer], base + start * row_bytes, count, x)
        put_rows(out, _sub_rows(route.recv_rows, received, received + count), block)
        received += count
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
