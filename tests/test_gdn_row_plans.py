"""relax_gdn.gdn.row_plans on the host alone: what a GDN layer builds once per micro-batch (the kernels'
row boundaries for each CP form), built from the host copies and cached on the micro-batch. The
zigzag rows are FLA's native zigzag CP (GPU only): this is the one place they run on a CPU."""

from __future__ import annotations

import numpy as np
import torch

from relax_gdn.gdn.row_plans import GDNRowPlans
from relax_gdn.layout import resolve_cu_seqlens
from relax_gdn.parallel import CPGroup
from tests.gdn_harness import packed_params

PLANS = GDNRowPlans(conv_kernel_size=4, route_strategy="lazy_cache", max_recomputed_prefix=1024)


def _micro_batch(cu: list[int], cp_size: int):
    psp = packed_params(cu, "cpu")
    return psp, resolve_cu_seqlens(psp, cu[-1], cp_size)


def test_zigzag_rows_are_the_whole_document_once_per_micro_batch():
    # one document of 64 tokens, then the empty slots a fixed-size boundary tensor ends with
    psp, resolved = _micro_batch([0, 64, 64, 64], cp_size=2)
    cp = CPGroup(group=None, size=2, rank=1)
    rows = PLANS.zigzag_rows(psp, resolved, cp)
    assert rows.cu_host.tolist() == [0, 64]  # the empty slots dropped
    assert torch.equal(rows.cu_device, rows.cu_host)
    assert (rows.cp_layout, rows.cp_group, rows.conv_kernel_size) == ("zigzag", None, 4)
    # every GDN layer of the micro-batch gets the same rows, whatever plans object asks
    other_layer = GDNRowPlans(conv_kernel_size=4, route_strategy="prebuild", max_recomputed_prefix=0)
    assert PLANS.zigzag_rows(psp, resolved, cp) is rows
    assert other_layer.zigzag_rows(psp, resolved, cp) is rows


def test_contiguous_rows_scan_a_slice_alone_when_no_state_crosses_a_rank_cut():
    cu = [0, 16, 40, 80, 120, 160]  # the cut at 80 (W = 2) falls on a document boundary
    psp, resolved = _micro_batch(cu, cp_size=2)
    for rank, local in ((0, [0, 16, 40, 80]), (1, [0, 40, 80])):
        rows, prefix = PLANS.contiguous_rows(psp, resolved, CPGroup(group=None, size=2, rank=rank))
        assert rows.cu_host.tolist() == local and rows.cp_group is None  # scanned alone, local bounds
        assert (prefix.recv, prefix.send, prefix.any_rank_has_one) == (0, 0, False)


def test_contiguous_rows_recompute_a_short_prefix_and_pass_the_state_past_the_limit():
    cu = [0, 16, 48, 88, 120, 160]  # 32 tokens of the third document before the cut at 80
    psp, resolved = _micro_batch(cu, cp_size=2)
    rows, prefix = PLANS.contiguous_rows(psp, resolved, CPGroup(group=None, size=2, rank=1))
    assert (prefix.recv, prefix.send) == (32, 0)
    assert rows.cu_host.tolist() == [0, 40, 72, 112]  # the 32 recomputed rows in front of the slice
    strict = GDNRowPlans(conv_kernel_size=4, route_strategy="lazy_cache", max_recomputed_prefix=8)
    rows, prefix = strict.contiguous_rows(psp, resolved, CPGroup(group=None, size=2, rank=1))
    assert prefix is None  # over the limit: the CP kernels pass the state
    assert np.array_equal(rows.cu_host.numpy(), resolved.host)  # the global boundaries, with the group
