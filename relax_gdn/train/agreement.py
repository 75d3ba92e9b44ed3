"""Decisions every rank must take alike, taken once.

Two ways, both collectives over the default process group:

* :func:`decided_by_rank0`: rank 0 decides (reads the file system, checks a checkpoint) and every
  rank acts on its answer. Ranks that looked themselves could see different things (a network file
  system with attribute caching lists a directory differently per node) and then wait in
  different collectives.
* :func:`agree_on_errors`: every rank does the same work; a :class:`~relax_gdn.errors.RecipeError`
  raised on any rank is raised on every rank, right there, so no rank goes on into a collective
  the failed one never joins (and no rank waits for a launcher to kill it).

Either way the error raised is marked ``agreed`` (rank 0 reports it, the others exit quietly once it
has: :func:`relax_gdn.errors.report_user_error`). Only :class:`RecipeError` s are shared: anything
else is a bug and stays that rank's traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from relax_gdn.errors import RecipeError

T = TypeVar("T")


def _agreed(error: RecipeError, found_on_rank: int | None) -> RecipeError:
    error.agreed = True
    error.found_on_rank = found_on_rank
    return error


def decided_by_rank0[T](decide: Callable[[], T]) -> T:
    """``decide()`` on rank 0; its value (picklable) on every rank, or the RecipeError it raised
    raised on every rank."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("value", decide())
        except RecipeError as e:
            box[0] = ("error", _agreed(e, None))
    dist.broadcast_object_list(box, src=0)
    kind, payload = box[0]
    if kind == "error":
        raise payload
    return payload


def agree_on_errors[T](work: Callable[[], T]) -> T:
    """``work()`` on every rank; its value when it succeeded everywhere, else the RecipeError of the
    lowest rank that raised one, raised on every rank (``found_on_rank`` names that rank unless
    every rank raised)."""
    value, error = None, None
    try:
        value = work()
    except RecipeError as e:
        error = e
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [rank for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return value
    origin = None if len(failed) == len(errors) else failed[0]
    if error is not None and failed[0] == dist.get_rank():
        raise _agreed(error, origin)  # this rank's own, with its traceback
    raise _agreed(errors[failed[0]], origin) from error
