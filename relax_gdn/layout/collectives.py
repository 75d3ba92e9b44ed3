"""Differentiable collectives the CP paths share (one implementation, used everywhere)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable


class _AllGather(torch.autograd.Function):
    """``[*s] -> [W, *s]``; the backward is the matching reduce-scatter (SUM).

    Written out rather than taken from ``torch.distributed.nn.functional.all_gather``, which torch
    2.14 deprecates (a FutureWarning per call) and which emulates the reduce-scatter with W
    scatters on gloo.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous().view(1, *x.shape)  # gloo wants the output as a dim-0 concatenation
        out = x.new_empty((dist.get_world_size(group), *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        grad_x = grad.new_empty((1, *grad.shape[1:]))
        dist.reduce_scatter_tensor(grad_x, grad, op=dist.ReduceOp.SUM, group=ctx.group)
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
