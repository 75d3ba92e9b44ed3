"""relax_gdn.layout: routes vs the per-token reference, swaps on real gloo groups, caches, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from relax_gdn.layout import (
    LAYOUTS,
    SWAP_TRANSPORTS,
    attach_host_cu_seqlens,
    build_route,
    get_route,
    prebuild_routes,
    resolve_cu_seqlens,
    rows_as_tensor,
    swap_layout,
    thd_rank_indices,
)
from relax_gdn.layout import cache as cache_module

DIRECTIONS = [("zigzag", "contiguous"), ("contiguous", "zigzag")]


def random_packings(seed: int = 0):
    """(W, cu_seqlens) cases: single sequence, many short ones, empty slots, exact 2W multiples."""
    rng = np.random.default_rng(seed)
    cases = []
    for w in (1, 2, 4, 8):
        unit = 2 * w
        cases += [
            (w, [0]),  # nothing packed at all
            (w, [0, unit]),  # one sequence of exactly 2W tokens
            (w, [0, unit * 37]),  # one long sequence
            (w, np.cumsum([0] + [unit] * 50).tolist()),  # many minimal sequences
            (w, [0, unit * 3, unit * 3, unit * 5, unit * 5, unit * 5, unit * 9]),  # empty padding slots
        ]
        for _ in range(12):
            n = int(rng.integers(1, 40))
            lengths = rng.integers(0, 12, size=n) * unit  # zeros are empty slots
            cases.append((w, np.concatenate([[0], np.cumsum(lengths)]).tolist()))
    return cases


def exchange_without_communication(routes, held):
    """Run every rank's route on what each rank holds, moving rows by hand instead of all-to-all."""
    outs = []
    for r, route in enumerate(routes):
        out = torch.full((route.local_rows,), -1, dtype=torch.long)
        out[rows_as_tensor(route.keep_target)] = held[r][rows_as_tensor(route.keep_source)]
        blocks = []
        for s, sender in enumerate(routes):
            sent = held[s][rows_as_tensor(sender.send_rows)]
            offset = sum(sender.wire_send_splits[:r])
            blocks.append(sent[offset : offset + sender.wire_send_splits[r]])
        out[rows_as_tensor(route.recv_rows)] = torch.cat(blocks)
        outs.append(out)
    return outs


def exchange_by_pull(routes, held):
    """The peer-memory transport's addressing: every rank packs its outgoing rows (its staging
    buffer); each receiver finds its block in each peer's buffer from ITS OWN route alone."""
    packed = [held[s][rows_as_tensor(sender.send_rows)] for s, sender in enumerate(routes)]
    outs = []
    for r, route in enumerate(routes):
        out = torch.full((route.local_rows,), -1, dtype=torch.long)
        out[rows_as_tensor(route.keep_target)] = held[r][rows_as_tensor(route.keep_source)]
        blocks = [
            packed[s][start : start + count]
            for s, (count, start) in enumerate(zip(route.wire_recv_splits, route.peer_block_starts))
        ]
        out[rows_as_tensor(route.recv_rows)] = torch.cat(blocks)
        outs.append(out)
    return outs


@pytest.mark.parametrize("w,cu", random_packings())
def test_route_equals_reference_partition(w, cu):
    for source, target in DIRECTIONS:
        routes = [build_route(cu, w, r, source, target) for r in range(w)]
        held = [thd_rank_indices(cu, w, r, source) for r in range(w)]
        outs = exchange_without_communication(routes, held)
        for r in range(w):
            assert torch.equal(outs[r], thd_rank_indices(cu, w, r, target)), (source, target, r)
            for d in range(w):  # what r sends to d is what d expects from r
                assert routes[r].send_splits[d] == routes[d].recv_splits[r]
            assert sum(routes[r].send_splits) == sum(routes[r].recv_splits) == routes[r].local_rows
        # the mirror route brings every rank back to where it started
        back = exchange_without_communication([route.reverse() for route in routes], outs)
        assert all(torch.equal(b, h) for b, h in zip(back, held))
        # every rank holds the same whole exchange; pulling by it gives the same rows both ways
        assert all(route.pair_rows == routes[0].pair_rows for route in routes)
        assert all(torch.equal(a, b) for a, b in zip(exchange_by_pull(routes, held), outs))
        reverse = [route.reverse() for route in routes]
        assert all(torch.equal(a, b) for a, b in zip(exchange_by_pull(reverse, outs), held))
        assert all(route.reverse().source == target for route in routes)


@pytest.mark.parametrize("w,cu", random_packings(seed=1)[::3])
def test_contiguous_row_lists_are_zero_copy_slices(w, cu):
    for source, target in DIRECTIONS:
        for r in range(w):
            route = build_route(cu, w, r, source, target)
            # per-token expectation of the send order: by destination, then by target position
            src_ids = thd_rank_indices(cu, w, r, source)
            owner = torch.empty(int(cu[-1]), dtype=torch.long)
            position = torch.empty(int(cu[-1]), dtype=torch.long)
            for d in range(w):
                ids = thd_rank_indices(cu, w, d, target)
                owner[ids], position[ids] = d, torch.arange(ids.numel())
            remote = owner[src_ids] != r
            order = torch.argsort(owner[src_ids] * max(1, int(cu[-1])) + position[src_ids], stable=True)
            expected = order[remote[order]]
            assert torch.equal(rows_as_tensor(route.send_rows), expected)
            contiguous = expected.numel() == 0 or torch.equal(
                expected, torch.arange(int(expected[0]), int(expected[0]) + expected.numel())
            )
            assert isinstance(route.send_rows, slice) == contiguous
    assert all(build_route(cu, w, r, "zigzag", "zigzag").is_identity for r in range(w))
    assert all(build_route(cu, w, r, "zigzag", "contiguous").is_identity for r in range(w)) == (
        w == 1 or cu[-1] == 0
    )


def test_rank0_single_sequence_keeps_chunk0_and_ships_chunk3():
    # W=2, one sequence of 16: rank 0 holds chunks [0, 3] and contiguous rank 0 wants [0, 1].
    route = build_route([0, 16], 2, 0, "zigzag", "contiguous")
    assert route.send_splits == (4, 4) and route.recv_splits == (4, 4)
    assert route.keep_source == slice(0, 4) and route.keep_target == slice(0, 4)
    assert route.send_rows == slice(4, 8) and route.recv_rows == slice(4, 8)
    assert route.wire_send_splits == [0, 4] and not route.is_identity


# ---------------------------------------------------------------- real gloo groups


def _swap_cases(w: int):
    import torch.distributed as dist

    rank = dist.get_rank()
    results = []
    packings = [
        [0, 2 * w * 9],
        [0, 2 * w * 3, 2 * w * 3, 2 * w * 10, 2 * w * 11],
        np.cumsum([0, 2 * w, 4 * w, 2 * w, 8 * w, 2 * w]).tolist(),
        [0],  # zero rows on every rank
    ]
    gen = torch.Generator().manual_seed(0)
    for cu in packings:
        total = int(cu[-1])
        for source, target in DIRECTIONS:
            route = build_route(cu, w, rank, source, target)
            src_ids = thd_rank_indices(cu, w, rank, source)
            tgt_ids = thd_rank_indices(cu, w, rank, target)
            for dtype, trailing in [
                (torch.float32, (3,)),
                (torch.bfloat16, (2, 5)),
                (torch.int64, ()),
                (torch.int16, (4,)),
            ]:
                data = (torch.arange(total * int(np.prod(trailing))) % 1000).reshape(total, *trailing)
                data = data.to(dtype)
                y = swap_layout(data[src_ids], route, None)
                back = swap_layout(y, route.reverse(), None)
                results.append(
                    (str(cu), source, dtype, torch.equal(y, data[tgt_ids]), torch.equal(back, data[src_ids]))
                )
            # seq_dim = 1 with a leading batch dim
            data = torch.randn(2, total, 3, generator=gen)
            y = swap_layout(data[:, src_ids], route, None, seq_dim=1)
            results.append((str(cu), source, "seq_dim=1", torch.equal(y, data[:, tgt_ids]), True))
            # gradient of a swap == reverse swap of the gradient == the same global token's weight
            x = torch.randn(total, 3, generator=gen)[src_ids].requires_grad_(True)
            weight = torch.randn(total, 3, generator=gen)
            (swap_layout(x, route, None) * weight[tgt_ids]).sum().backward()
            by_reverse = swap_layout(weight[tgt_ids], route.reverse(), None)
            results.append(
                (
                    str(cu),
                    source,
                    "grad",
                    torch.equal(x.grad, by_reverse),
                    torch.equal(x.grad, weight[src_ids]),
                )
            )
    return results + _transport_cases(w)


def _transport_cases(w: int):
    """On gloo every transport setting swaps through the all-to-all; the swap's profiler range;
    rows to the next rank (recomputed prefixes), both ways; ``auto``'s one-host test."""
    import os

    import torch.distributed as dist

    from relax_gdn.layout.peer_memory import group_is_on_this_host

    rank, results = dist.get_rank(), []
    # the groups first, before any collective of this job (every rank makes every group, in order)
    halves = [dist.new_group(list(range(h * w // 2, (h + 1) * w // 2))) for h in (0, 1)]
    straddle = dist.new_group([w // 2 - 1, w // 2])  # one rank from each half
    cu = [0, 2 * w * 3, 2 * w * 10]
    route = build_route(cu, w, rank, "zigzag", "contiguous")
    data = torch.arange(cu[-1] * 2.0).reshape(-1, 2)
    for transport in SWAP_TRANSPORTS:
        y = swap_layout(data[thd_rank_indices(cu, w, rank, "zigzag")], route, None, transport=transport)
        results.append(
            (
                transport,
                "gloo",
                "transport",
                torch.equal(y, data[thd_rank_indices(cu, w, rank, "contiguous")]),
                True,
            )
        )
    # A swap is a named range in profiler traces (it is skipped when no profiler runs: host time).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        swap_layout(data[thd_rank_indices(cu, w, rank, "zigzag")], route, None)
    names = {event.name for event in prof.events()}
    results.append(("profiler", "gloo", "range", "relax_gdn.swap zigzag->contiguous" in names, True))
    # last rows to the next rank (recomputed prefixes): rank r sends its last r + 1 rows
    from relax_gdn.layout.collectives import last_rows_to_next_rank

    held = (torch.arange(8.0 * 3) + 100 * rank).reshape(8, 3).requires_grad_(True)
    send, recv = (rank + 1 if rank + 1 < w else 0), rank
    got = last_rows_to_next_rank(held, send, recv, dist.group.WORLD)
    from_previous = (torch.arange(8.0 * 3) + 100 * (rank - 1)).reshape(8, 3)[8 - recv :]
    (got * (rank + 1)).sum().backward()  # the receiver's gradient: its rank + 1 everywhere
    grad = torch.zeros(8, 3)
    grad[8 - send :] = rank + 2  # what the next rank (rank + 1) sends back for these rows
    results.append(
        ("last rows", "gloo", "to next rank", torch.equal(got, from_previous), torch.equal(held.grad, grad))
    )
    before = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        for hosts, group, expected in (
            (1, dist.group.WORLD, True),
            (2, dist.group.WORLD, False),
            (2, halves[rank * 2 // w], True),
        ):
            os.environ["LOCAL_WORLD_SIZE"] = str(w // hosts)
            results.append((hosts, expected, "one host", group_is_on_this_host(group) == expected, True))
        if rank in (w // 2 - 1, w // 2):
            results.append((2, "straddle", "one host", not group_is_on_this_host(straddle), True))
        del os.environ["LOCAL_WORLD_SIZE"]  # a launcher that does not say: never peer memory
        results.append((None, False, "one host", not group_is_on_this_host(dist.group.WORLD), True))
    finally:
        if before is not None:
            os.environ["LOCAL_WORLD_SIZE"] = before
    return results


@pytest.mark.parametrize("w", [2, 4])
def test_swap_layout_on_gloo(gloo, w):
    per_rank = gloo(_swap_cases, w, w)
    for rank, results in enumerate(per_rank):
        failed = [case for case in results if not (case[3] and case[4])]
        assert not failed, f"rank {rank}: {failed}"
        assert len(results) == 4 * 2 * 6 + 3 + 1 + 1 + 4 + (rank in (w // 2 - 1, w // 2))


# ---------------------------------------------------------------- caches


def _packed(cu: list[int]) -> tuple[PackedSeqParams, torch.Tensor]:
    t = torch.tensor(cu, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t), t


@pytest.fixture
def build_calls(monkeypatch):
    calls = []
    real = cache_module.build_route

    def counting(*args, **kwargs):
        calls.append(args[1:5])
        return real(*args, **kwargs)

    monkeypatch.setattr(cache_module, "build_route", counting)
    return calls


def test_lazy_cache_hits_and_serves_both_directions(build_calls):
    psp, cu = _packed([0, 8, 24])
    a = get_route(psp, cu, 2, 1, "zigzag", "contiguous")
    b = get_route(psp, cu, 2, 1, "zigzag", "contiguous")
    back = get_route(psp, cu, 2, 1, "contiguous", "zigzag")
    assert a is b and back is a.reverse() and len(build_calls) == 1


def test_lazy_cache_misses(build_calls):
    psp, cu = _packed([0, 8, 24])
    get_route(psp, cu, 2, 0, "zigzag", "contiguous")
    equal_values = cu.clone()
    get_route(psp, equal_values, 2, 0, "zigzag", "contiguous")  # new tensor, same values
    assert len(build_calls) == 2
    equal_values.add_(0)  # in-place refill
    get_route(psp, equal_values, 2, 0, "zigzag", "contiguous")
    assert len(build_calls) == 3
    equal_values[1:].mul_(1)  # in-place through a view bumps the base's version too
    get_route(psp, equal_values, 2, 0, "zigzag", "contiguous")
    assert len(build_calls) == 4
    get_route(psp, equal_values, 4, 0, "zigzag", "contiguous")  # W change
    get_route(psp, equal_values, 4, 3, "zigzag", "contiguous")  # rank change
    route = get_route(psp, equal_values, 4, 3, "zigzag", "contiguous", device="meta")  # device change
    assert len(build_calls) == 7 and route.device == torch.device("meta")
    get_route(psp, equal_values, 4, 3, "zigzag", "contiguous", device="meta")
    assert len(build_calls) == 7


def test_prebuild_fills_both_directions(build_calls):
    psp, cu = _packed([0, 8, 24])
    prebuild_routes(psp, None, cp_size=2, cp_rank=1)
    assert len(build_calls) == 1
    fwd = get_route(psp, cu, 2, 1, "zigzag", "contiguous", strategy="prebuild")
    bwd = get_route(psp, cu, 2, 1, "contiguous", "zigzag", strategy="prebuild")
    assert len(build_calls) == 1 and bwd is fwd.reverse()


def test_prebuilt_route_not_used_when_it_does_not_match(build_calls):
    psp, cu = _packed([0, 8, 24])
    prebuild_routes(psp, None, cp_size=2, cp_rank=1)
    with pytest.warns(UserWarning, match="prebuild"):
        other_rank = get_route(psp, cu, 2, 0, "zigzag", "contiguous", strategy="prebuild")
    assert other_rank.cp_rank == 0 and len(build_calls) == 2
    other_cu = torch.tensor([0, 12, 24], dtype=torch.int32)
    route = get_route(psp, other_cu, 2, 0, "zigzag", "contiguous", strategy="prebuild")
    assert route.cu_seqlens is other_cu and len(build_calls) == 3


def test_prebuild_is_a_noop_without_thd_or_cp(build_calls):
    psp, _ = _packed([0, 8, 24])
    prebuild_routes(psp, None, cp_size=1, cp_rank=0)
    prebuild_routes(PackedSeqParams(qkv_format="sbhd"), None, cp_size=2, cp_rank=0)
    prebuild_routes(None, None)
    assert build_calls == []


def test_attached_host_copy_means_no_device_read():
    # A meta tensor has no values: any attempt to read it on the host would raise.
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    attach_host_cu_seqlens(psp, cu, [0, 8, 24])
    route = get_route(psp, cu, 2, 0, "zigzag", "contiguous")
    assert route.device == torch.device("meta") and route.send_splits == (8, 4)
    resolved = resolve_cu_seqlens(psp, 24, 2)
    assert resolved.cu_seqlens is cu and resolved.host.tolist() == [0, 8, 24] and resolved.max_seqlen == 16


def test_resolver_runs_once_per_micro_batch(monkeypatch):
    psp, cu = _packed([0, 8, 24])
    padded = torch.tensor([0, 8, 24], dtype=torch.int32)
    psp.cu_seqlens_q_padded = psp.cu_seqlens_kv_padded = padded
    first = resolve_cu_seqlens(psp, 24, 2)
    assert first.cu_seqlens is padded  # padded boundaries win
    calls = []
    monkeypatch.setattr(cache_module, "host_cu_seqlens", lambda *a: calls.append(a))
    assert resolve_cu_seqlens(psp, 24, 2) is first and calls == []
    monkeypatch.undo()
    padded.add_(0)  # refilled in place: checked again
    assert resolve_cu_seqlens(psp, 24, 2) is not first
    assert resolve_cu_seqlens(psp, 24, 4).cu_seqlens is padded  # another W is another key


def _overwrite_through_data(cu: torch.Tensor, values: list[int]) -> None:
    cu.data.copy_(torch.tensor(values, dtype=cu.dtype))


def _overwrite_through_numpy(cu: torch.Tensor, values: list[int]) -> None:
    cu.numpy()[:] = values


@pytest.mark.parametrize("overwrite", [_overwrite_through_data, _overwrite_through_numpy])
def test_reattaching_other_values_drops_what_was_built_from_the_old_ones(overwrite):
    psp, cu = _packed([0, 8, 24])
    attach_host_cu_seqlens(psp, cu, [0, 8, 24])
    old_route = get_route(psp, cu, 2, 0, "zigzag", "contiguous")
    assert resolve_cu_seqlens(psp, 24, 2).max_seqlen == 16
    version = cu._version
    overwrite(cu, [0, 16, 24])
    assert cu._version == version  # invisible to the provenance check
    attach_host_cu_seqlens(psp, cu, [0, 16, 24])
    route = get_route(psp, cu, 2, 0, "zigzag", "contiguous")
    expected = build_route([0, 16, 24], 2, 0, "zigzag", "contiguous")
    assert route.pair_rows == expected.pair_rows != old_route.pair_rows
    resolved = resolve_cu_seqlens(psp, 24, 2)
    assert resolved.host.tolist() == [0, 16, 24] and resolved.max_seqlen == 16


def test_reattaching_the_same_values_keeps_the_route(build_calls):
    psp, cu = _packed([0, 8, 24])
    attach_host_cu_seqlens(psp, cu, [0, 8, 24])
    route = get_route(psp, cu, 2, 0, "zigzag", "contiguous")
    attach_host_cu_seqlens(psp, cu, np.array([0, 8, 24]))
    assert get_route(psp, cu, 2, 0, "zigzag", "contiguous") is route and len(build_calls) == 1


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "cu,w,r,layout,match",
    [
        (torch.zeros(2, 2, dtype=torch.int32), 2, 0, "zigzag", r"1-D.*shape=\(2, 2\)"),
        (torch.tensor([0.0, 4.0]), 2, 0, "zigzag", r"integer.*float32"),
        ([], 2, 0, "zigzag", r"at least one boundary"),
        ([1, 8], 2, 0, "zigzag", r"cu_seqlens\[0\] == 0.*=1"),
        ([0, 8, 4], 2, 0, "zigzag", r"non-decreasing.*cu_seqlens\[1\]=8 > cu_seqlens\[2\]=4"),
        ([0, 8, 14], 2, 0, "zigzag", r"multiple of 2\*cp_size.*sequence 1 has length 6.*=4"),
        ([0, 6], 4, 0, "contiguous", r"multiple of cp_size.*T=6, cp_size=4"),
        ([0, 8], 0, 0, "zigzag", r"cp_size >= 1.*cp_size=0"),
        ([0, 8], 2, 2, "zigzag", r"0 <= cp_rank < cp_size.*cp_rank=2"),
        ([0, 8], 2, -1, "zigzag", r"0 <= cp_rank < cp_size.*cp_rank=-1"),
        ([0, 8], 2, 0, "zigzags", r"unknown layout 'zigzags'"),
    ],
)
def test_layout_rules_raise(cu, w, r, layout, match):
    with pytest.raises(ValueError, match=match):
        thd_rank_indices(cu, w, r, layout)
    target = "contiguous" if layout == "zigzag" else "zigzag"
    with pytest.raises(ValueError, match=match):
        build_route(cu, w, r, layout, target)


def test_route_misuse_raises():
    route = build_route([0, 16], 2, 0, "zigzag", "contiguous")
    with pytest.raises(ValueError, match="x has 5 rows.*moves 8 rows"):
        swap_layout(torch.zeros(5), route, None)
    with pytest.raises(ValueError, match="on meta.*on cpu"):
        swap_layout(torch.zeros(8, device="meta"), route, None)
    psp, cu = _packed([0, 16])
    with pytest.raises(ValueError, match="unknown route strategy 'eager'"):
        get_route(psp, cu, 2, 0, "zigzag", "contiguous", strategy="eager")


@pytest.mark.parametrize(
    "q,kv,seq_len,w,match",
    [
        ([0, 8, 16], [0, 4, 16], 16, 2, r"identical query and key/value.*\[0, 8, 16\].*\[0, 4, 16\]"),
        ([0, 8, 16], [0, 8, 16], 32, 2, r"cu_seqlens\[-1\]=16 does not match.*global length 32"),
        ([0, 6, 16], [0, 6, 16], 16, 2, r"multiple of 2\*cp_size.*sequence 0 has length 6"),
    ],
)
def test_resolver_rules_raise(q, kv, seq_len, w, match):
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(q), cu_seqlens_kv=torch.tensor(kv))
    with pytest.raises(ValueError, match=match):
        resolve_cu_seqlens(psp, seq_len, w)


def test_layout_names_are_public():
    assert LAYOUTS == ("zigzag", "contiguous")


@pytest.mark.parametrize(
    "dtype, shape",
    [
        (torch.bfloat16, (10, 1, 12352)),
        (torch.bfloat16, (10, 6)),
        (torch.float32, (10, 3)),
        (torch.int16, (10, 5)),
        (torch.float64, (10, 2)),
        (torch.bool, (10, 16)),
    ],
)
def test_row_gather_and_scatter_move_rows_as_wide_words_exactly(dtype, shape):
    from relax_gdn.layout.route import _as_wide_rows, put_rows, take_rows

    base = (torch.randn(shape[0] + 1, *shape[1:]) * 100).to(dtype)
    for x in (base[:-1], base[1:]):  # storage offset 0 and one row in
        rows = torch.tensor([3, 1, 7, 7, 0])
        assert torch.equal(take_rows(x, rows), x.index_select(0, rows))
        out, ref = torch.zeros_like(x), torch.zeros_like(x)
        put_rows(out, torch.tensor([5, 2, 9]), x[:3])
        ref.index_copy_(0, torch.tensor([5, 2, 9]), x[:3])
        assert torch.equal(out, ref)
    row_bytes = base[0].numel() * base.element_size()
    assert (_as_wide_rows(base).dtype == torch.complex128) == (
        row_bytes % 16 == 0 and base.element_size() < 16
    )
    out = base.clone()  # zero rows (a rank that keeps or receives nothing): a no-op, not an error
    put_rows(out, torch.zeros(0, dtype=torch.long), base[:0])
    assert torch.equal(out, base) and _as_wide_rows(base[:0]).shape[0] == 0


def test_unknown_swap_transport_names_the_setting():
    route = build_route([0, 8], 1, 0, "zigzag", "contiguous")
    with pytest.raises(ValueError, match=r"gdn.swap_transport='nvshmem'"):
        swap_layout(torch.zeros(8, 2), route, None, transport="nvshmem")


@pytest.mark.parametrize("w", [2, 4])
def test_per_token_baseline_route_equals_build_route(w):
    """bench.gdn_layer runs the layer on the seed's per-token route: it must be the same route,
    whole exchange (pair_rows) included, since the peer-memory swap reads it."""
    from relax_gdn.bench.routes import per_token_route

    for cu in ([0, 16 * w], [0, 2 * w * 3, 2 * w * 3, 2 * w * 10, 2 * w * 11]):
        for r in range(w):
            for source, target in DIRECTIONS:
                naive, built = (
                    per_token_route(torch.tensor(cu), w, r, source, target),
                    build_route(cu, w, r, source, target),
                )
                assert (naive.pair_rows, naive.send_splits, naive.recv_splits) == (
                    built.pair_rows,
                    built.send_splits,
                    built.recv_splits,
                )
                for rows in ("send_rows", "recv_rows", "keep_source", "keep_target"):
                    assert torch.equal(
                        rows_as_tensor(getattr(naive, rows)), rows_as_tensor(getattr(built, rows))
                    ), rows


def test_the_swap_transport_is_the_callers_with_auto_by_default():
    import inspect

    import relax_gdn.layout as layout
    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.layout import swap as swap_module

    # each swap is told its transport (a layer passes its GDNOptions.swap_transport): no setting
    # of the process's decides it
    assert (
        inspect.signature(swap_layout).parameters["transport"].default
        == "auto"
        == GDNOptions().swap_transport
    )
    assert not [n for n in dir(layout) + dir(swap_module) if "set_swap_transport" in n or n == "_transport"]
