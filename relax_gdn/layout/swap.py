"""Execute a route: pack -> one ``all_to_all_single`` -> scatter, with autograd
(docs/design/LAYOUTS.md §2.6), or, on GPUs of one host, pack -> device barrier -> pull from peers'
memory (``peer_memory``).

Nothing here reads device data on the host: split sizes are host ints from the route, row lists
are device tensors, so a swap issues no device->host sync.

The transport is the caller's (``GDNOptions.swap_transport``, passed with every swap): two layers
built with different transports run side by side.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from relax_gdn.choices import SWAP_TRANSPORTS, choice_problem
from relax_gdn.layout.peer_memory import exchange_through_peer_memory, group_is_on_this_host
from relax_gdn.layout.route import Route, copy_rows, put_rows, take_rows

# group name -> every rank on this host (auto's choice): a fact of the machines, not of a model or
# run, asked once per group instead of at every swap
_on_one_host: dict[str, bool] = {}


def _uses_peer_memory(x: torch.Tensor, group: dist.ProcessGroup, transport: str) -> bool:
    """``all_to_all``: NCCL's all-to-all (any topology); ``peer_memory``: symmetric memory (the
    group's GPUs on one host, ``relax_gdn.layout.peer_memory``); ``auto``: peer_memory when the CP
    group is on this host. CPU tensors and gloo always take the all-to-all."""
    if transport == "all_to_all" or not x.is_cuda or dist.get_backend(group) != "nccl":
        return False
    if transport == "peer_memory":
        return True
    if group.group_name not in _on_one_host:  # host facts, identical on every rank of the group
        _on_one_host[group.group_name] = group_is_on_this_host(group)
    return _on_one_host[group.group_name]


# gloo's all-to-all handles only some dtypes (int16 fails, for one). An all-to-all just moves
# bytes, so any other dtype travels as the raw bytes of the same rows.
_GLOO_NATIVE = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
}


def _needs_byte_transport(dtype: torch.dtype, group: dist.ProcessGroup | None) -> bool:
    return dtype not in _GLOO_NATIVE and dist.get_backend(group) == "gloo"


def _exchange(x: torch.Tensor, route: Route, group: dist.ProcessGroup | None, transport: str) -> torch.Tensor:
    """Move rows of ``x`` (rows on dim 0, ``route.local_rows`` of them) along ``route``."""
    process_group = group or dist.group.WORLD
    if _uses_peer_memory(x, process_group, transport):
        exchange = exchange_through_peer_memory
    else:
        exchange = _exchange_rows
    if not torch.autograd._profiler_enabled():  # the named range costs host time on every swap
        return exchange(x, route, process_group)
    # A named range in torch profiler traces, and an NVTX range under emit_nvtx (nsys).
    with record_function(f"relax_gdn.swap {route.source}->{route.target}"):
        return exchange(x, route, process_group)


def _exchange_rows(x: torch.Tensor, route: Route, group: dist.ProcessGroup | None) -> torch.Tensor:
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
    copy_rows(out, route.keep_target, x, route.keep_source)
    work.wait()
    if not recv_in_place:
        put_rows(out, route.recv_rows, recv)
    return out


class _SwapLayout(torch.autograd.Function):
    """Forward moves rows along the route; backward moves gradients along its mirror."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, route: Route, group: dist.ProcessGroup | None, transport: str
    ) -> torch.Tensor:
        ctx.route, ctx.group, ctx.transport = route, group, transport
        return _exchange(x, route, group, transport)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.route.reverse(), ctx.group, ctx.transport), None, None, None


def swap_layout(
    x: torch.Tensor,
    route: Route,
    cp_group: dist.ProcessGroup | None,
    seq_dim: int = 0,
    transport: str = "auto",
) -> torch.Tensor:
    """Convert ``x`` (this rank's rows in ``route.source`` layout along ``seq_dim``) to ``route.target``.

    Any trailing shape and dtype; differentiable (the backward is the reverse swap). An identity
    route (CP = 1, or source == target) returns ``x`` itself with no collective. ``transport``:
    one of :data:`SWAP_TRANSPORTS` (the caller's ``gdn.swap_transport``).
    """
    if transport not in SWAP_TRANSPORTS:
        raise ValueError(choice_problem("gdn.swap_transport", transport, SWAP_TRANSPORTS))
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
        return _SwapLayout.apply(x, route, cp_group, transport)
    moved = _SwapLayout.apply(x.movedim(seq_dim, 0), route, cp_group, transport)
    return moved.movedim(0, seq_dim)
