"""relax_gdn.gdn.fla_cp_summaries: which CP transition summaries some rank reads, decided from FLA's
own rank metadata, checked against FLA's merge rule; the explicit install / uninstall; and that
only the CP contexts a layer marks are skipped.

The kernels themselves need CUDA: tests/test_gdn_layer_gpu.py checks that the chunkwise layer
gives bit-identical results with and without the skip."""

from __future__ import annotations

import random

import pytest
import torch

fla_context = pytest.importorskip("fla.ops.cp.context")

from relax_gdn.gdn import fla_cp_summaries  # noqa: E402


def _contexts(cu: list[int], world: int):
    cu_t = torch.tensor(cu, dtype=torch.long)
    return [
        fla_context.get_cp_cu_seqlens(cu_t, cu_seqlens_cpu=cu_t, world_size=world, rank=r)
        for r in range(world)
    ]


def _read_by_merges(contexts) -> tuple[set[int], set[int]]:
    """Ranks whose M (forward) / dM (backward) FLA's merge multiplies by a possibly nonzero state.

    Forward: rank r merges ranks r - n .. r - 1 (n = pre_num_ranks) left to right from a zero state,
    so the first of them meets zero. Backward: ranks r + n .. r + 1 (n = post_num_ranks), from zero."""
    fwd: set[int] = set()
    bwd: set[int] = set()
    for r, c in enumerate(contexts):
        if not c.is_first_rank:
            fwd.update(range(r - c.pre_num_ranks + 1, r))
        if not c.is_last_rank:
            bwd.update(range(r + 1, r + c.post_num_ranks))
    return fwd, bwd


def _random_packings(world: int, n: int, rng: random.Random):
    unit = world  # FLA's contiguous split needs T divisible by W
    yield [0, 64 * world]  # one document over every rank
    yield [0, 3 * unit, 64 * world]
    for _ in range(n):
        total = unit * rng.randint(4, 80)
        cuts = sorted(rng.sample(range(1, total), rng.randint(0, min(12, total - 1))))
        yield [0, *cuts, total]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_skipped_summaries_are_exactly_the_unread_ones(world):
    rng = random.Random(world)
    for cu in _random_packings(world, 200, rng):
        contexts = _contexts(cu, world)
        fwd_read, bwd_read = _read_by_merges(contexts)
        for r, c in enumerate(contexts):
            read = fla_cp_summaries.transition_is_read(c)
            assert read == (r in fwd_read) == (r in bwd_read), (cu, r, fwd_read, bwd_read)
        if world == 2:  # a sequence spans at most two ranks: nothing is ever read
            assert not fwd_read and not bwd_read


def test_install_replaces_and_uninstall_restores_fla_functions():
    import importlib

    chunk = importlib.import_module("fla.ops.gated_delta_rule.chunk")
    from fla.ops.cp import chunk_delta_h

    fla_cp_summaries.install()
    fla_cp_summaries.install()  # idempotent: wraps FLA's function once
    try:
        assert fla_cp_summaries.installed()
        fwd = chunk.chunk_gated_delta_rule_fwd_h_pre_process
        assert fwd.relax_gdn_original is chunk_delta_h.chunk_gated_delta_rule_fwd_h_pre_process
        # no CP context: FLA's function runs unchanged (returns the initial state it is given)
        state = torch.zeros(1)
        assert fwd(k=None, w=None, u=None, initial_state=state, context=None) is state
    finally:
        fla_cp_summaries.uninstall()
    assert not fla_cp_summaries.installed()
    assert (
        chunk.chunk_gated_delta_rule_fwd_h_pre_process
        is chunk_delta_h.chunk_gated_delta_rule_fwd_h_pre_process
    )


def test_only_a_marked_context_is_skipped_and_marking_needs_the_patch():
    context = _contexts([0, 128], 2)[1]
    context.group = object()  # stands for the CP group: the rule reads only whether there is one
    assert not fla_cp_summaries.installed()
    with pytest.raises(RuntimeError, match=r"relax_gdn\.runtime\.Runtime"):
        fla_cp_summaries.skip_unread_summaries_of(context)  # the patch is not there to honour it
    assert not fla_cp_summaries._skippable(context, use_graph=False)
    fla_cp_summaries.install()
    try:
        unmarked = _contexts([0, 128], 2)[1]
        unmarked.group = object()
        fla_cp_summaries.skip_unread_summaries_of(context)
        assert fla_cp_summaries._skippable(context, use_graph=False)
        assert not fla_cp_summaries._skippable(context, use_graph=True)  # FLA's CUDA-graph branch
        assert not fla_cp_summaries._skippable(unmarked, use_graph=False)  # another layer's choice
    finally:
        fla_cp_summaries.uninstall()


def test_install_refuses_another_fla_version(monkeypatch):
    import fla

    monkeypatch.setattr(fla, "__version__", "0.7.0")
    with pytest.raises(RuntimeError, match="fla-core==0.6.0"):
        fla_cp_summaries.install()
