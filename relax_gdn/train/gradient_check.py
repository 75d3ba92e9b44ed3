"""Trainable parameters that got no gradient: checked once, after the first step of a process.

A parameter that requires grad but gets none trains silently not at all: the run's loss still
falls (the other parameters train), so nothing else shows it. What does it: a graph cut before the
parameter (a detached tensor; a reentrant recompute whose inputs need no gradient, as a frozen
embedding under LoRA was), or a loss term that never reaches it. After the first optimizer step of
the process every rank flags the trainable parameters whose gradient is non-zero somewhere in its
tensor, the flags are OR-ed over all ranks, and rank 0 names the ones left (one host read, once).

A parameter built to start without gradient (``STARTS_WITHOUT_GRADIENT``, set where LoRA makes
its factors: the one whose partner starts at zero) is not checked; its partner is.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from relax_gdn.model.lora_options import STARTS_WITHOUT_GRADIENT

logger = logging.getLogger(__name__)

NAMED = 8  # names in the warning; the count says how many more


def _gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    """What the step accumulated: Megatron-Core DDP's ``main_grad`` buffer, else ``.grad``."""
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def _nonzero(grad: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Whether ``grad`` has a non-zero (or NaN) element, as a bool on ``device``; min and max
    instead of ``grad != 0``, which would allocate a tensor of the gradient's size."""
    if grad is None:
        return torch.zeros((), dtype=torch.bool, device=device)
    low, high = torch.aminmax(grad)
    return ((low != 0) | (high != 0)).to(device)


def parameters_without_gradient(model: torch.nn.Module, device: torch.device) -> list[str]:
    """Names of ``model``'s trainable parameters with an all-zero (or no) gradient on every rank,
    read after a step's backward (a collective over the default group when initialised).

    Under Megatron-Core's distributed optimizer the reduce-scatter writes each rank's shard in
    place and leaves the rest of the buffer as this rank accumulated it, so "non-zero somewhere on
    some rank" holds for every parameter that got a gradient anywhere."""
    checked = [
        (name, p)
        for name, p in model.named_parameters()
        if p.requires_grad and not getattr(p, STARTS_WITHOUT_GRADIENT, False)
    ]
    if not checked:
        return []
    flags = torch.stack([_nonzero(_gradient(p), device) for _, p in checked]).to(torch.int32)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    reached = flags.tolist()  # the one host read
    return [name for (name, _), got in zip(checked, reached) if not got]


def warn_parameters_without_gradient(names: list[str], step: int) -> None:
    """Rank 0's warning naming what :func:`parameters_without_gradient` found."""
    if not names:
        return
    more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
    logger.warning(
        "step %d: %d trainable parameters got no gradient on any rank, so they do not train: %s%s. "
        "A tensor detached on the way to them, a recompute whose inputs need no gradient, or a loss "
        "term that does not reach them does this.",
        step,
        len(names),
        ", ".join(names[:NAMED]),
        more,
    )
