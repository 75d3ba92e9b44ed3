"""Execute a route with autograd (LAYOUTS.md §2.6), over one of two transports.

- all-to-all: gather the rows for other ranks -> one ``all_to_all_single`` -> scatter the
  received rows. Three passes over the moved rows, but ONE collective whatever the packing.
- p2p: every piece (a row range contiguous on the sender AND on the receiver, see ``Route``)
  goes straight from a view of the input into a view of the output, one send/recv pair per piece
  in ONE ``batch_isend_irecv``: no gather, no scatter, but one NCCL point-to-point op per piece.
  Worth it only when few pieces move between each pair of ranks (1-3 documents); with many
  documents the per-op cost wins (batched per-run sends were 6-10x slower for 64 documents).

``_uses_p2p`` picks one (``SWAP_TRANSPORT`` forces either, for benchmarks and tests). In both,
own-rank rows are copied locally while the transfer runs, and nothing reads device data on the
host: split sizes and pieces are host ints from the route, row lists are device tensors, so a
swap issues no device->host sync.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from relax_gdn.layout.route import Route, put_rows, take_rows

MAX_P2P_PIECES_PER_PAIR = 8
"""Most pieces between one pair of ranks for which "auto" takes the p2p transport."""

SWAP_TRANSPORT = "auto"
"""``"auto"`` (``_uses_p2p``'s rule), ``"p2p"`` (whenever the route allows it, whatever its
piece count) or ``"all_to_all"``: the benchmark's and the tests' switch. Set it to the same value
on every rank."""

TRANSPORTS = ("auto", "p2p", "all_to_all")


def _uses_p2p(route: Route) -> bool:
    """Whether ``route`` moves its rows with point-to-point ops instead of the all-to-all.

    Every rank must answer the same: a rank that posts sends and receives while its peer enters
    an all-to-all waits forever. So the rule reads only facts computed from the GLOBAL runs
    (``max_pieces_per_pair``, ``p2p_ready``), identical on all ranks, never a rank's own pieces.
    ``p2p_ready`` (every rank sends and receives a piece) is required because a rank with no
    piece would post no op at all, and NCCL wants every rank in a group's first batched p2p call.
    """
    if SWAP_TRANSPORT not in TRANSPORTS:
        raise ValueError(f"SWAP_TRANSPORT must be one of {TRANSPORTS}, got {SWAP_TRANSPORT!r}")
    if SWAP_TRANSPORT == "all_to_all" or not route.p2p_ready:
        return False
    return SWAP_TRANSPORT == "p2p" or route.max_pieces_per_pair <= MAX_P2P_PIECES_PER_PAIR


# gloo's all-to-all handles only some dtypes (int16 fails, for one). Both transports just move
# bytes, so any other dtype travels as the raw bytes of the same rows.
_GLOO_NATIVE = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool,
}


def _needs_byte_transport(dtype: torch.dtype, group: dist.ProcessGroup | None) -> bool:
    return dtype not in _GLOO_NATIVE and dist.get_backend(group) == "gloo"


@functools.cache
def _global_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """Global rank of each rank of ``group``: ``P2POp`` peers are global ranks, route ranks are
    group ranks. Cached per group (a group's membership never changes); the world group maps to
    itself and is never cached, since a process may initialise the world again."""
    return tuple(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)))


def _peer_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...] | range:
    if group is None or group is dist.group.WORLD:
        return range(dist.get_world_size())
    return _global_ranks(group)


def _exchange(x: torch.Tensor, route: Route, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Move rows of ``x`` (rows on dim 0, ``route.local_rows`` of them) along ``route``."""
    p2p = _uses_p2p(route)
    # A named range in torch profiler traces, and an NVTX range under emit_nvtx (nsys).
    with record_function(f"relax_gdn.swap {route.source}->{route.target} ({'p2p' if p2p else 'all_to_all'})"):
        return _exchange_pieces(x, route, group) if p2p else _exchange_rows(x, route, group)


def _exchange_pieces(x: torch.Tensor, route: Route, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The p2p transport: each piece from a view of ``x`` into a view of the output."""
    x = x.contiguous()
    out = x.new_empty((route.local_rows, *x.shape[1:]))
    # Row ranges of contiguous row-major tensors are contiguous views: nothing is copied. Viewing
    # each range (not the whole tensor) as bytes keeps rows on dim 0 whatever the trailing shape.
    as_bytes = _needs_byte_transport(x.dtype, group)

    def wire(rows: torch.Tensor) -> torch.Tensor:
        return rows.view(torch.uint8) if as_bytes else rows

    peers = _peer_ranks(group)
    ops = [
        dist.P2POp(dist.isend, wire(x[row : row + n]), peer=peers[dst], group=group)
        for dst, row, n in route.send_pieces
    ] + [
        dist.P2POp(dist.irecv, wire(out[row : row + n]), peer=peers[src], group=group)
        for src, row, n in route.recv_pieces
    ]
    # Pieces of one pair are listed in the same order on both sides, which is how messages
    # between two ranks are matched. Issued async so the own-rank copy below overlaps them.
    works = dist.batch_isend_irecv(ops)
    _copy_rows(out, route.keep_target, x, route.keep_source)
    for work in works:
        work.wait()  # on NCCL: the current stream waits, the host does not
    return out


def _exchange_rows(x: torch.Tensor, route: Route, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The all-to-all transport: gather -> one ``all_to_all_single`` -> scatter."""
    x = x.contiguous()
    send = take_rows(x, route.send_rows)
    out = x.new_empty((route.local_rows, *x.shape[1:]))
    # Received rows that form one range of the output land there directly: no scatter pass.
    recv_in_place = isinstance(route.recv_rows, slice)
    if recv_in_place:
        recv = out[route.recv_rows]
    else:
        recv = x.new_empty((sum(route.wire_recv_splits), *x.shape[1:]))
    wire_send, wire_recv = send, recv
    if _needs_byte_transport(x.dtype, group):
        wire_send, wire_recv = send.view(torch.uint8), recv.view(torch.uint8)
    # Issued async so the own-rank copy below overlaps the transfer; on NCCL, wait() only makes
    # the current stream wait for the collective, the host never blocks.
    work = dist.all_to_all_single(
        wire_recv,
        wire_send,
        output_split_sizes=route.wire_recv_splits,
        input_split_sizes=route.wire_send_splits,
        group=group,
        async_op=True,
    )
    _copy_rows(out, route.keep_target, x, route.keep_source)
    work.wait()
    if not recv_in_place:
        put_rows(out, route.recv_rows, recv)
    return out


def _copy_rows(out: torch.Tensor, out_rows, x: torch.Tensor, x_rows) -> None:
    """``out[out_rows] = x[x_rows]`` in ONE pass over the rows when either side is a range (the
    gather writes straight into the destination range; a source range is read as a view)."""
    if isinstance(out_rows, slice) and not isinstance(x_rows, slice):
        torch.index_select(x, 0, x_rows, out=out[out_rows])
    else:
        put_rows(out, out_rows, take_rows(x, x_rows))


class _SwapLayout(torch.autograd.Function):
    """Forward moves rows along the route; backward moves gradients along its mirror."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, route: Route, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.route, ctx.group = route, group
        return _exchange(x, route, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.route.reverse(), ctx.group), None, None


def swap_layout(
    x: torch.Tensor, route: Route, cp_group: dist.ProcessGroup | None, seq_dim: int = 0
) -> torch.Tensor:
    """Convert ``x`` (this rank's rows in ``route.source`` layout along ``seq_dim``) to ``route.target``.

    Any trailing shape and dtype; differentiable (the backward is the reverse swap). An identity
    route (CP = 1, or source == target) returns ``x`` itself with no collective.
    """
    if x.shape[seq_dim] != route.local_rows:
        raise ValueError(
            f"swap_layout: x has {x.shape[seq_dim]} rows on seq_dim={seq_dim} but the route "
            f"({route.source}->{route.target}, cp_size={route.cp_size}) moves {route.local_rows} "
            "rows per rank; was the route built for this micro-batch?"
        )
    if x.device != route.device:
        raise ValueError(
            f"swap_layout: x is on {x.device} but the route's row lists are on {route.device}; "
            "build (or get_route) the route for the device of the activations"
        )
    if route.is_identity:
        return x
    if seq_dim % x.dim() == 0:
        return _SwapLayout.apply(x, route, cp_group)
    moved = _SwapLayout.apply(x.movedim(seq_dim, 0), route, cp_group)
    return moved.movedim(0, seq_dim)
