"""Differentiable collectives the CP paths share (one implementation, used everywhere)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable


class _AllGather(torch.autograd.Function):
    """``[*s] -> [W, *s]``; the backward is the matching reduce-scatter (SUM).

    Written out rather than taken from ``torch.distributed.nn.functional.all_gather``, which torch
    2.14 deprecates (a FutureWarning per call) and which emulates the reduce-scatter with W
    scatters on gloo. ``all_gather_single`` / ``reduce_scatter_single`` are torch 2.14's names for
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (the old names warn on every call).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous().view(1, *x.shape)  # gloo wants the output as a dim-0 concatenation
        out = x.new_empty((dist.get_world_size(group), *x.shape[1:]))
        dist.all_gather_single(out, x, group=group)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        grad_x = grad.new_empty((1, *grad.shape[1:]))
        dist.reduce_scatter_single(grad_x, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_x[0], None


def all_gather_stacked(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``x`` stacked on a new leading dim (rank order); gradients are summed back."""
    return _AllGather.apply(x, group)


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's rows of ``x`` (dim 0), concatenated in rank order; the backward reduce-scatters
    (SUM) the gradient. A group of one (or none) returns ``x`` itself, with no collective."""
    if group is None or group.size() == 1:
        return x
    return all_gather_stacked(x, group).flatten(0, 1)


def _rows_to_neighbour(rows: torch.Tensor, send: int, recv: int, step: int, group) -> torch.Tensor:
    """Send ``rows`` (``send`` of them) to the rank ``step`` after this one and receive ``recv``
    rows from the rank ``step`` before it (``step`` = +1 or -1; no wrap-around)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    out = rows.new_empty((recv, *rows.shape[1:]))
    send_splits, recv_splits = [0] * size, [0] * size
    if 0 <= rank + step < size:
        send_splits[rank + step] = send
    if 0 <= rank - step < size:
        recv_splits[rank - step] = recv
    dist.all_to_all_single(
        out, rows.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group
    )
    return out


class _LastRowsToNextRank(torch.autograd.Function):
    """Forward: this rank's last ``send`` rows go to the next rank, ``recv`` rows come from the
    previous one. Backward: the received rows' gradients go back and land on the sent rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: int, recv: int, group) -> torch.Tensor:
        ctx.rows, ctx.send, ctx.recv, ctx.group = x.shape[0], send, recv, group
        return _rows_to_neighbour(x[x.shape[0] - send :], send, recv, +1, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        back = _rows_to_neighbour(grad, ctx.recv, ctx.send, -1, ctx.group)
        grad_x = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        grad_x[ctx.rows - ctx.send :] = back
        return grad_x, None, None, None


def last_rows_to_next_rank(x: torch.Tensor, send: int, recv: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Each rank's last ``send`` rows of ``x`` (dim 0) to the next rank in ``group``; returns the
    ``recv`` rows from the previous rank (rank 0 receives none, the last rank sends none).
    Differentiable: the gradient of the received rows is added to the sender's. Every rank of
    the group must call it (it is one collective), with ``send`` equal to the next rank's
    ``recv``."""
    return _LastRowsToNextRank.apply(x, send, recv, group)
