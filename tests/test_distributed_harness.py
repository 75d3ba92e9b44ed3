"""tests/distributed.py fails instead of hanging: a rank that raises fails the run with its
traceback while its peer is blocked in a collective, and a run past its limit fails with every
rank's stack."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _rank_sums() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _rank_one_raises_while_rank_zero_waits() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # never completes: rank 1 does not come


def _rank_one_blocks_forever() -> None:
    if dist.get_rank() == 1:
        threading.Event().wait()
    dist.barrier()


def test_every_rank_returns_its_result():
    assert run_distributed(_rank_sums, 2, runtime=False) == [3.0, 3.0]


def test_a_failing_rank_fails_the_run_with_its_traceback_first():
    with pytest.raises(AssertionError) as failure:
        run_distributed(_rank_one_raises_while_rank_zero_waits, 2, runtime=False)
    message = str(failure.value)
    first = message.split("--- rank ")[1]  # the earliest failure is reported first
    assert first.startswith("1 raised")
    assert "ValueError: rank one refuses" in first
    assert "_rank_one_raises_while_rank_zero_waits" in first
    assert "limit" not in message


@pytest.mark.slow
def test_a_run_past_its_limit_fails_with_the_stacks_of_the_ranks_left():
    with pytest.raises(AssertionError) as failure:
        run_distributed(_rank_one_blocks_forever, 2, timeout_s=30, runtime=False)
    message = str(failure.value)
    assert "passed its 30 s limit" in message
    assert "--- rank 1 stacks ---" in message
    assert "most recent call first" in message
