"""relax_gdn.gdn.reference and cp_reference: the scans against FLA's naive reference and each other, the conv
against ``F.conv1d``, and the chunkwise-CP functions on real gloo process groups (W = 2, 4)."""

from __future__ import annotations

import importlib.util
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from relax_gdn.gdn.cp_reference import (
    contiguous_shard,
    cp_causal_conv1d,
    cp_gated_delta_rule,
    recomputed_prefix,
)
from relax_gdn.gdn.reference import causal_conv1d, gated_delta_rule_chunked, gated_delta_rule_recurrent

F64 = torch.float64
CHUNK = 8
# Lengths 1, 8 (exactly one chunk), 17 (two chunks and a bit), 1, 13.
PACKED_CU = [0, 1, 9, 26, 27, 40]
SCAN_NAMES = ("q", "k", "v", "g", "beta")


def scan_inputs(cu, key_heads=2, heads=4, dk=8, dv=6, dtype=F64, seed=0, batch=1):
    """q, k, v, g, beta for ``batch`` rows of ``cu[-1]`` tokens, in the ranges Qwen3.5 produces:
    g = logsigmoid(.) <= 0, beta in (0, 1), |k| <= 1 so the scan stays bounded without l2norm."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, cu[-1])

    def randn(*s):
        return torch.randn(*shape, *s, generator=gen, dtype=dtype)

    norm = 0.5 + 0.5 * torch.rand(*shape, key_heads, 1, generator=gen, dtype=dtype)
    return {
        "q": randn(key_heads, dk),
        "k": F.normalize(randn(key_heads, dk), dim=-1) * norm,
        "v": randn(heads, dv),
        "g": F.logsigmoid(randn(heads) + 2),
        "beta": torch.rand(*shape, heads, generator=gen, dtype=dtype),
    }


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def fla_naive():
    """FLA's pure-torch GDN references (fla/ops/gated_delta_rule/naive.py), loaded from their file
    alone: importing the ``fla`` package pulls in triton and costs over 10 s on a small CPU box."""
    package = importlib.util.find_spec("fla")
    if package is None:
        pytest.skip("FLA (fla-core) is not installed")
    path = Path(package.origin).parent / "ops" / "gated_delta_rule" / "naive.py"
    spec = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Scans
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 0.3])
def test_recurrent_matches_fla_naive(scale):
    naive = fla_naive()
    x = scan_inputs([0, 20], key_heads=2, heads=2, dtype=torch.float32)
    h0 = torch.randn(1, 2, 8, 6)
    ref_o, ref_h = naive.naive_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["beta"], x["g"], scale=scale, initial_state=h0, output_final_state=True
    )
    o, h = gated_delta_rule_recurrent(**x, scale=scale, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float32 and h.shape == (1, 2, 8, 6)
    assert max_err(o, ref_o) < 1e-5
    assert max_err(h, ref_h) < 1e-5


def test_recurrent_gradients_match_fla_naive():
    """Every input's gradient, the gate's included, against autograd through FLA's naive scan:
    the reference the GPU tests hold FLA's Triton kernels to is itself right in the backward."""
    naive = fla_naive()
    x = {
        n: t.requires_grad_()
        for n, t in scan_inputs([0, 20], key_heads=2, heads=2, dtype=torch.float32).items()
    }
    h0 = torch.randn(1, 2, 8, 6, requires_grad=True)
    leaves = [*x.values(), h0]
    grad_o, grad_h = torch.randn(1, 20, 2, 6), torch.randn(1, 2, 8, 6)
    ref = torch.autograd.grad(
        naive.naive_recurrent_gated_delta_rule(
            x["q"], x["k"], x["v"], x["beta"], x["g"], scale=0.3, initial_state=h0, output_final_state=True
        ),
        leaves,
        (grad_o, grad_h),
    )
    got = torch.autograd.grad(
        gated_delta_rule_recurrent(**x, scale=0.3, initial_state=h0, output_final_state=True),
        leaves,
        (grad_o, grad_h),
    )
    for name, a, b in zip([*SCAN_NAMES, "h0"], got, ref, strict=True):
        assert max_err(a, b) < 1e-5 * max(1.0, b.abs().max().item()), name


@pytest.mark.parametrize("heads", [2, 4], ids=["H=HV", "GVA"])
@pytest.mark.parametrize("l2norm", [False, True], ids=["raw", "l2norm"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["zero_h0", "h0"])
def test_chunked_matches_recurrent(heads, l2norm, with_h0):
    x = scan_inputs(PACKED_CU, heads=heads)
    h0 = torch.randn(len(PACKED_CU) - 1, heads, 8, 6, dtype=F64) if with_h0 else None
    kwargs = dict(
        initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=PACKED_CU
    )
    ref_o, ref_h = gated_delta_rule_recurrent(**x, **kwargs)
    o, h = gated_delta_rule_chunked(**x, **kwargs, chunk_size=CHUNK)
    assert o.shape == (1, 40, heads, 6) and h.shape == (5, heads, 8, 6)
    assert max_err(o, ref_o) < 1e-12
    assert max_err(h, ref_h) < 1e-12


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_chunked_any_chunk_size(chunk_size):
    x = scan_inputs(PACKED_CU)
    ref_o, ref_h = gated_delta_rule_recurrent(**x, output_final_state=True, cu_seqlens=PACKED_CU)
    o, h = gated_delta_rule_chunked(**x, output_final_state=True, cu_seqlens=PACKED_CU, chunk_size=chunk_size)
    assert max_err(o, ref_o) < 1e-12 and max_err(h, ref_h) < 1e-12


def test_chunked_gradients_match_recurrent():
    x = {n: t.requires_grad_() for n, t in scan_inputs(PACKED_CU).items()}
    h0 = torch.randn(5, 4, 8, 6, dtype=F64, requires_grad=True)
    inputs = [*x.values(), h0]
    kwargs = dict(
        initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=PACKED_CU
    )
    grad_o, grad_h = torch.randn(1, 40, 4, 6, dtype=F64), torch.randn(5, 4, 8, 6, dtype=F64)

    ref = torch.autograd.grad(gated_delta_rule_recurrent(**x, **kwargs), inputs, (grad_o, grad_h))
    got = torch.autograd.grad(
        gated_delta_rule_chunked(**x, **kwargs, chunk_size=CHUNK), inputs, (grad_o, grad_h)
    )
    for name, a, b in zip([*SCAN_NAMES, "h0"], got, ref, strict=True):
        assert max_err(a, b) < 1e-10, name


@pytest.mark.parametrize("scan", [gated_delta_rule_recurrent, gated_delta_rule_chunked])
def test_scan_packed_equals_documents_alone(scan):
    x = scan_inputs(PACKED_CU)
    h0 = torch.randn(5, 4, 8, 6, dtype=F64)
    o, h = scan(**x, initial_state=h0, output_final_state=True, cu_seqlens=PACKED_CU)
    for n, (bos, eos) in enumerate(pairwise(PACKED_CU)):
        doc = {name: t[:, bos:eos] for name, t in x.items()}
        o_doc, h_doc = scan(**doc, initial_state=h0[n : n + 1], output_final_state=True)
        assert max_err(o[:, bos:eos], o_doc) < 1e-12
        assert max_err(h[n], h_doc[0]) < 1e-12


def test_scan_batch_rows_are_sequences():
    x = scan_inputs([0, 10], batch=3)
    o, h = gated_delta_rule_chunked(**x, output_final_state=True, chunk_size=4)
    packed = {n: t.reshape(1, 30, *t.shape[2:]) for n, t in x.items()}
    cu_cpu_tensor = torch.tensor([0, 10, 20, 30])
    o_p, h_p = gated_delta_rule_chunked(
        **packed, output_final_state=True, cu_seqlens=cu_cpu_tensor, chunk_size=4
    )
    assert max_err(o.reshape(1, 30, 4, 6), o_p) < 1e-12 and max_err(h, h_p) < 1e-12


@pytest.mark.parametrize("scan", [gated_delta_rule_recurrent, gated_delta_rule_chunked])
def test_scan_empty_sequence_keeps_its_initial_state(scan):
    x = scan_inputs([0, 20])
    h0 = torch.randn(3, 4, 8, 6, dtype=F64)
    _, h = scan(**x, initial_state=h0, output_final_state=True, cu_seqlens=[0, 10, 10, 20])
    assert max_err(h[1], h0[1]) == 0


def test_scan_keeps_dtype_and_state_in_fp32():
    x = {n: t.to(torch.bfloat16) for n, t in scan_inputs(PACKED_CU).items()}
    o, h = gated_delta_rule_chunked(**x, output_final_state=True, cu_seqlens=PACKED_CU)
    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Causal conv1d
# ---------------------------------------------------------------------------------------------


def conv_inputs(total, dim=10, width=4, seed=1, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, total, dim, generator=gen, dtype=dtype),
        torch.randn(dim, width, generator=gen, dtype=dtype),
        torch.randn(dim, generator=gen, dtype=dtype),
    )


def conv1d_alone(x_doc, weight, bias, activation, left=None):
    """``nn.Conv1d(groups=D)`` on one document ``[L, D]``, after ``left`` rows of context (or zeros)."""
    width = weight.shape[1]
    left = x_doc.new_zeros(width - 1, x_doc.shape[1]) if left is None else left
    y = F.conv1d(torch.cat([left, x_doc]).T[None], weight[:, None, :], bias, groups=weight.shape[0])[0].T
    return F.silu(y) if activation else y


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_matches_conv1d_per_document(activation, with_bias):
    x, weight, bias = conv_inputs(40)
    bias = bias if with_bias else None
    y, final = causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=PACKED_CU)
    assert final is None and y.shape == x.shape
    for bos, eos in pairwise(PACKED_CU):
        assert max_err(y[0, bos:eos], conv1d_alone(x[0, bos:eos], weight, bias, activation)) < 1e-12


def test_conv_initial_tokens_precede_only_the_first_document():
    x, weight, bias = conv_inputs(40)
    halo = torch.randn(3, 10, dtype=F64)
    y, _ = causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=[0, 2, 40], initial_tokens=halo)
    assert max_err(y[0, :2], conv1d_alone(x[0, :2], weight, bias, "silu", left=halo)) < 1e-12
    assert max_err(y[0, 2:], conv1d_alone(x[0, 2:], weight, bias, "silu")) < 1e-12


def test_conv_batch_rows_are_sequences():
    x, weight, bias = conv_inputs(30)
    y_rows, _ = causal_conv1d(x.reshape(3, 10, 10), weight, bias, activation="silu")
    y_packed, _ = causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=[0, 10, 20, 30])
    assert max_err(y_rows.reshape(1, 30, 10), y_packed) == 0


# ---------------------------------------------------------------------------------------------
# Input checks and the shard helper
# ---------------------------------------------------------------------------------------------


def test_bad_inputs_raise_value_error():
    x = scan_inputs(PACKED_CU, key_heads=2, heads=3)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule_chunked(**x, cu_seqlens=PACKED_CU)
    x = scan_inputs(PACKED_CU)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=39 must equal"):
        gated_delta_rule_chunked(**x, cu_seqlens=[0, 39])
    with pytest.raises(ValueError, match="non-decreasing"):
        gated_delta_rule_recurrent(**x, cu_seqlens=[0, 20, 10, 40])
    with pytest.raises(ValueError, match="host copy"):
        gated_delta_rule_chunked(**x, cu_seqlens=torch.tensor([0, 40], device="meta"))
    with pytest.raises(ValueError, match="initial_state must be"):
        gated_delta_rule_chunked(**x, initial_state=torch.zeros(1, 4, 8, 6), cu_seqlens=PACKED_CU)
    with pytest.raises(ValueError, match="beta must be"):
        gated_delta_rule_chunked(**{**x, "beta": x["beta"][..., :2]})
    conv_x, weight, _ = conv_inputs(40)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(conv_x, weight, activation="relu")
    with pytest.raises(ValueError, match="initial_tokens"):
        causal_conv1d(conv_x, weight, initial_tokens=torch.zeros(4, 10, dtype=F64))
    with pytest.raises(ValueError, match="T % W == 0"):
        contiguous_shard([0, 10], 4, 0)
    with pytest.raises(ValueError, match="rank must be"):
        contiguous_shard([0, 12], 4, 4)
    with pytest.raises(ValueError, match="contiguous slice"):
        cp_causal_conv1d(conv_x[:, :10], weight, cu_seqlens_global=PACKED_CU, group=None)


def test_contiguous_shard():
    cu = [0, 10, 10, 13, 14, 47, 48]  # T = 48, W = 4: slices of 12 rows
    assert [contiguous_shard(cu, 4, r).cu_seqlens for r in range(4)] == [
        (0, 10, 12),
        (0, 1, 2, 12),
        (0, 12),
        (0, 11, 12),
    ]
    assert [(s.pre_tokens, s.pre_ranks) for s in (contiguous_shard(cu, 4, r) for r in range(4))] == [
        (0, ()),
        (2, (0,)),
        (10, (1,)),
        (22, (1, 2)),
    ]
    on_boundary = contiguous_shard([0, 12, 48], 4, 1)
    assert (on_boundary.start, on_boundary.stop) == (12, 24)
    assert (on_boundary.pre_tokens, on_boundary.pre_ranks) == (0, ())
    assert contiguous_shard(torch.tensor([0, 5, 48]), 1, 0).cu_seqlens == (0, 5, 48)


def _sequences_cross_ranks(cu, world: int) -> bool:
    """The limit-0 plan: None iff some sequence spans two ranks."""
    return recomputed_prefix(cu, world, 0, max_tokens=0) is None


def test_no_recompute_limit_means_no_plan_iff_some_rank_starts_inside_a_sequence():
    for cu in ([0, 10, 10, 13, 14, 47, 48], [0, 12, 48], [0, 12, 24, 24, 36, 48], [0, 48], [0, 24, 30, 48]):
        for world in (1, 2, 3, 4, 6):
            expected = any(contiguous_shard(cu, world, r).pre_tokens for r in range(world))
            assert _sequences_cross_ranks(cu, world) == expected, (cu, world)
    assert not _sequences_cross_ranks([0, 12, 24, 24, 36, 48], 4)  # every cut on a boundary, empty slot
    assert _sequences_cross_ranks([0, 12, 48], 2)
    with pytest.raises(ValueError, match="T % W == 0"):
        _sequences_cross_ranks([0, 10], 4)


def test_recomputed_prefix_makes_every_slice_start_at_a_sequence_start():
    """Checked per token: the extended slice of rank r is the global rows [start - recv, stop),
    its local boundaries are the global ones inside it, and it begins at a sequence start; sends
    and receives pair up; a prefix over the limit or over a whole rank means None everywhere."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        world, total = rng.choice([1, 2, 3, 4]), 48 * rng.randint(1, 4)
        cuts = rng.sample(range(1, total), rng.randint(0, 8))
        cu = [0, *sorted(cuts + cuts[:1]), total]  # one empty sequence when there are cuts
        limit = rng.choice([0, 5, 20, 10**6])
        part = cu[-1] // world
        plans = [recomputed_prefix(cu, world, r, limit) for r in range(world)]
        pre = [contiguous_shard(cu, world, r).pre_tokens for r in range(world)]
        if any(p > min(limit, part - 1) for p in pre):
            assert plans == [None] * world, (cu, world, limit)
            continue
        assert _sequences_cross_ranks(cu, world) == any(pre)
        for r, plan in enumerate(plans):
            start = r * part - plan.recv
            assert start in cu, "the extended slice starts at a sequence start"
            inside = [b - start for b in cu if start < b < (r + 1) * part]
            assert plan.cu_seqlens == (0, *sorted(set(inside)), part + plan.recv)
            assert plan.send == (plans[r + 1].recv if r + 1 < world else 0)
            assert plan.any_rank_has_one == any(pre)
        assert plans[0].recv == 0


def test_cp_without_group_is_the_plain_function():
    x = scan_inputs(PACKED_CU)
    o, _ = gated_delta_rule_chunked(**x, use_qk_l2norm_in_kernel=True, cu_seqlens=PACKED_CU, chunk_size=CHUNK)
    o_cp, final = cp_gated_delta_rule(
        **x, use_qk_l2norm_in_kernel=True, cu_seqlens_global=PACKED_CU, group=None, chunk_size=CHUNK
    )
    assert final is None and max_err(o, o_cp) == 0
    conv_x, weight, bias = conv_inputs(40)
    y, _ = causal_conv1d(conv_x, weight, bias, activation="silu", cu_seqlens=PACKED_CU)
    y_cp, _ = cp_causal_conv1d(
        conv_x, weight, bias, activation="silu", cu_seqlens_global=PACKED_CU, group=None
    )
    assert max_err(y, y_cp) == 0


# ---------------------------------------------------------------------------------------------
# Chunkwise CP on gloo
# ---------------------------------------------------------------------------------------------

# (name, global cu_seqlens, use_qk_l2norm_in_kernel, conv activation). With W = 4 the slices hold
# 12 rows (2 for the last case), with W = 2 they hold 24 (4).
CP_CASES = [
    ("one_document", [0, 48], True, "silu"),
    ("spans_all_ranks_then_length_one", [0, 3, 40, 41, 48], False, None),
    ("documents_start_on_rank_boundaries", [0, 12, 24, 30, 48], True, "silu"),
    ("short_document_crosses_boundary_and_empty_slot", [0, 10, 10, 13, 14, 47, 48], True, "silu"),
    ("slices_shorter_than_the_conv_halo", [0, 1, 8], False, "silu"),
]


def _cp_errors(cases):
    """Run on every rank: max |CP - single process| over this rank's rows, per output and gradient."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # W processes share a few cores; the tensors are tiny
    group = dist.group.WORLD
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    errors = {}
    for case, (name, cu, l2norm, activation) in enumerate(cases):
        part = cu[-1] // world_size
        mine = slice(rank * part, (rank + 1) * part)
        gen = torch.Generator().manual_seed(100 + case)

        full = scan_inputs(cu, seed=case)
        grad_o = torch.randn(1, cu[-1], 4, 6, generator=gen, dtype=F64)
        leaves = [t.requires_grad_() for t in full.values()]
        kwargs = dict(use_qk_l2norm_in_kernel=l2norm, chunk_size=CHUNK)
        o_ref, _ = gated_delta_rule_chunked(*leaves, cu_seqlens=cu, **kwargs)
        grads_ref = torch.autograd.grad(o_ref, leaves, grad_o)
        local = [t.detach()[:, mine].clone().requires_grad_() for t in leaves]
        o_cp, _ = cp_gated_delta_rule(*local, cu_seqlens_global=cu, group=group, **kwargs)
        grads_cp = torch.autograd.grad(o_cp, local, grad_o[:, mine])
        errors[f"{name}/o"] = max_err(o_cp, o_ref[:, mine])
        for n, got, ref in zip(SCAN_NAMES, grads_cp, grads_ref, strict=True):
            errors[f"{name}/d{n}"] = max_err(got, ref[:, mine])

        x, weight, bias = (t.requires_grad_() for t in conv_inputs(cu[-1], seed=case))
        grad_y = torch.randn(1, cu[-1], 10, generator=gen, dtype=F64)
        y_ref, _ = causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu)
        dx_ref, dw_ref, db_ref = torch.autograd.grad(y_ref, (x, weight, bias), grad_y)
        x_local = x.detach()[:, mine].clone().requires_grad_()
        y_cp, _ = cp_causal_conv1d(
            x_local, weight, bias, activation=activation, cu_seqlens_global=cu, group=group
        )
        dx, dw, db = torch.autograd.grad(y_cp, (x_local, weight, bias), grad_y[:, mine])
        # weight and bias are replicated over CP: each rank holds a partial gradient.
        dist.all_reduce(dw, group=group)
        dist.all_reduce(db, group=group)
        errors[f"{name}/y"] = max_err(y_cp, y_ref[:, mine])
        errors[f"{name}/dx"] = max_err(dx, dx_ref[:, mine])
        errors[f"{name}/dweight"] = max_err(dw, dw_ref)
        errors[f"{name}/dbias"] = max_err(db, db_ref)
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_matches_single_process(gloo, world_size):
    per_rank = gloo(_cp_errors, world_size, CP_CASES, runtime=False)  # pure torch
    assert len(per_rank[0]) == 10 * len(CP_CASES)
    bad = [
        f"rank {r} {key}: {err:.1e}"
        for r, errs in enumerate(per_rank)
        for key, err in errs.items()
        if err > 1e-10
    ]
    assert not bad, "CP differs from the single-process result:\n" + "\n".join(bad)
