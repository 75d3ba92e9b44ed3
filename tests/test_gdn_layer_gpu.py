"""relax_gdn.gdn.layer on 2 GPUs (NCCL) with FLA kernels (the interleaved case on one GPU too):
every CP mode in bf16 and fp32 vs the single-rank fp32 torch reference (chunkwise also with the
rank cut on a document boundary, where each slice is scanned alone, and with the crossing
document's prefix recomputed by the next rank), zero host syncs in steady-state chunkwise and
headwise calls,
and chunkwise bit-identical with and without ``GDNOptions.fla_skip_unread_cp_summaries`` (the
skipped summaries are multiplied by zero, so skipping them must not change a bit); and two
layers built with different options, run interleaved under whole-layer recompute, each giving
its own result.

Head counts and head dims are Qwen3.5-9B's (16 QK / 32 V heads x 128): FLA autotunes per head
shape and dtype (minutes per shape on a fresh machine), so the test tunes exactly the kernels
the layer benchmark and training use; with ``TRITON_CACHE_AUTOTUNING=1`` they tune once. fp32
is its own test so that its first-use tuning cannot hold up the bf16 one.
"""

from __future__ import annotations

import pytest
import torch

from relax_gdn.bench.timing import count_host_syncs
from tests.distributed import run_distributed
from tests.gdn_harness import CP_TOLERANCE, HIDDEN, TOLERANCE, nine_b_heads
from tests.gdn_harness import as_fp32 as _as_fp32
from tests.gdn_harness import paired as _paired
from tests.gdn_harness import vs_reference as _vs_reference

pytestmark = pytest.mark.gpu
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

CU = [0, 192, 192, 704, 768, 1280]
# the same T with the rank cut (640) on a document boundary: chunkwise scans each slice alone
WHOLE_DOCUMENTS_PER_RANK = [0, 192, 640, 704, 1280]


def _gpu_cases(dtype: torch.dtype):
    import torch.distributed as dist

    from relax_gdn.gdn import fla_cp_summaries
    from relax_gdn.gdn.options import GDNOptions
    from tests import gdn_harness as h

    rank, world = dist.get_rank(), dist.group.WORLD
    device, single, reference, fla_layer = nine_b_heads(dtype)
    x = torch.randn(CU[-1], 1, HIDDEN, device=device)
    weight = torch.randn_like(x)
    ref = h.reference_run(reference, x, weight, h.packed_params(CU, device))
    results, syncs, identical, runs = {}, {}, {}, {}

    # chunkwise passes the state through FLA's CP kernels here (the general path: layers built
    # with max_recomputed_prefix=0); the recomputed prefix, the default for this batch's 448
    # tokens before the cut, comes below
    for mode in ("chunkwise", "headwise", "all_gather"):
        print(f"[rank {rank}] {mode} {dtype}: start", flush=True)  # progress for `pytest -s` logs
        layer = fla_layer(mode, max_recomputed_prefix=0)
        psp = h.packed_params(CU, device)
        got = _as_fp32(h.cp_run(layer, x.to(dtype), weight.to(dtype), psp, 2, rank, world, cu=CU))
        errors = _vs_reference(ref, got, dtype)
        runs[mode] = got
        results[(mode, str(dtype))] = max(errors.values())
        worst = sorted(errors.items(), key=lambda kv: -kv[1])[:4]
        print(
            f"[rank {rank}] {mode} {dtype}: max relative error {results[(mode, str(dtype))]:.2e}, worst {worst}",
            flush=True,
        )
        if mode == "chunkwise":
            assert fla_cp_summaries.installed()  # by the Runtime the test harness installs
            # FLA's own pre-pass, unread summaries included: same bits
            stock_layer = fla_layer(mode, max_recomputed_prefix=0, fla_skip_unread_cp_summaries=False)
            stock = h.cp_run(
                stock_layer, x.to(dtype), weight.to(dtype), h.packed_params(CU, device), 2, rank, world, cu=CU
            )
            identical = {k: torch.equal(a, b.float()) for k, a, b in _paired(got, stock)}
            # the gate's activation by torch around FLA, as Megatron-Core
            unfused_layer = fla_layer(mode, max_recomputed_prefix=0, fla_fused_gate=False)
            unfused = _as_fp32(
                h.cp_run(
                    unfused_layer,
                    x.to(dtype),
                    weight.to(dtype),
                    h.packed_params(CU, device),
                    2,
                    rank,
                    world,
                    cu=CU,
                )
            )
            results[("chunkwise, gate outside FLA", str(dtype))] = max(
                _vs_reference(ref, unfused, dtype).values()
            )
        if mode != "all_gather":
            ids = got[3]

            def call():
                xx = x[ids].to(dtype).requires_grad_(True)
                out, _ = layer(xx, None, packed_seq_params=psp)
                out.backward(weight[ids].to(dtype))

            syncs[mode] = count_host_syncs(call)  # steady state: routes/checks cached
            psp_new = h.packed_params(CU, device)  # built outside the counted call
            where: dict = {}
            syncs[mode + " (new micro-batch)"] = count_host_syncs(
                lambda: layer(x[ids].to(dtype), None, packed_seq_params=psp_new)[0].sum().backward(), where
            )
            syncs[mode + " (new micro-batch) at"] = where
    # every rank cut on a document boundary: chunkwise runs FLA's plain varlen kernels per slice
    layer = fla_layer("chunkwise")
    whole_ref = h.reference_run(reference, x, weight, h.packed_params(WHOLE_DOCUMENTS_PER_RANK, device))
    psp = h.packed_params(WHOLE_DOCUMENTS_PER_RANK, device)
    got = _as_fp32(
        h.cp_run(layer, x.to(dtype), weight.to(dtype), psp, 2, rank, world, cu=WHOLE_DOCUMENTS_PER_RANK)
    )
    results[("chunkwise, whole documents per rank", str(dtype))] = max(
        _vs_reference(whole_ref, got, dtype).values()
    )
    ids = got[3]
    syncs["chunkwise, whole documents per rank"] = count_host_syncs(
        lambda: layer(x[ids].to(dtype).requires_grad_(True), None, packed_seq_params=psp)[0].sum().backward()
    )
    # the crossing document's 448 tokens before the cut recomputed by rank 1 instead of passing
    # the state (RecomputedPrefix, on by default up to gdn.max_recomputed_prefix tokens): FLA's
    # plain varlen kernels on the extended slice
    assert GDNOptions().max_recomputed_prefix >= 448
    layer = fla_layer("chunkwise")
    psp = h.packed_params(CU, device)
    got = _as_fp32(h.cp_run(layer, x.to(dtype), weight.to(dtype), psp, 2, rank, world, cu=CU))
    results[("chunkwise, prefix recomputed", str(dtype))] = max(_vs_reference(ref, got, dtype).values())
    runs["chunkwise, prefix recomputed"] = got
    ids = got[3]
    syncs["chunkwise, prefix recomputed"] = count_host_syncs(
        lambda: layer(x[ids].to(dtype).requires_grad_(True), None, packed_seq_params=psp)[0].sum().backward()
    )
    psp_new = h.packed_params(CU, device)  # the plan and its boundaries built from host copies too
    syncs["chunkwise, prefix recomputed (new micro-batch)"] = count_host_syncs(
        lambda: (
            layer(x[ids].to(dtype).requires_grad_(True), None, packed_seq_params=psp_new)[0].sum().backward()
        )
    )
    # CP parity proper: every mode against all_gather, which runs FLA on the whole sequence
    # (the single-rank computation), quantity by quantity, relative to its largest value.
    whole = runs["all_gather"]
    for mode in ("chunkwise", "headwise", "chunkwise, prefix recomputed"):
        diffs = {
            k: ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
            for k, a, b in _paired(runs[mode], whole)
        }
        results[(mode, "vs all_gather")] = max(diffs.values())
    return results, syncs, identical


@TWO_GPUS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fla_modes_match_reference_and_are_sync_free(dtype):
    per_rank = run_distributed(_gpu_cases, 2, dtype, backend="nccl")
    for rank, (results, syncs, identical) in enumerate(per_rank):
        print(
            f"rank {rank}: max relative errors {results}; host syncs {syncs}; "
            f"chunkwise bit-identical to FLA's full CP summaries: {identical}"
        )
        bad = {
            k: v
            for k, v in results.items()
            if not v < (CP_TOLERANCE if k[1] == "vs all_gather" else TOLERANCE)[dtype]
        }
        assert not bad, f"rank {rank}: {bad}"
        assert identical and all(identical.values()), identical
        assert syncs["chunkwise"] == 0 and syncs["headwise"] == 0, syncs
        assert syncs["chunkwise, whole documents per rank"] == 0, syncs
        assert syncs["chunkwise, prefix recomputed"] == 0, syncs
        assert syncs["chunkwise, prefix recomputed (new micro-batch)"] == 0, syncs
        # a NEW micro-batch too: routes from host copies, FLA's chunk index uploaded non-blocking
        assert syncs["chunkwise (new micro-batch)"] == 0 and syncs["headwise (new micro-batch)"] == 0, syncs


# the document over [512, 2560) crosses the CP-2 cut (2048) with 1536 tokens before it: both models
# pass the state through FLA's CP kernels (max_recomputed_prefix=0 for the first one as well)
INTERLEAVED_CU = [0, 512, 512, 2560, 3072, 4096]


def _interleaved_fla_case():
    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model.fusion import Fusion
    from tests.model_harness import interleaved_options_case

    return interleaved_options_case(
        "qwen3_5_9b_reduced",
        8192,
        INTERLEAVED_CU,
        torch.float32,
        {
            "defaults": dict(gdn=GDNOptions(kernel_backend="fla", max_cp_size=2, max_recomputed_prefix=0)),
            "other options": dict(
                gdn=GDNOptions(
                    kernel_backend="fla",
                    max_cp_size=2,
                    max_recomputed_prefix=0,
                    fla_fused_gate=False,
                    fla_skip_unread_cp_summaries=False,
                    swap_transport="all_to_all",
                ),
                fusion=Fusion(norms=False, cross_entropy=False),
            ),
        },
    )


@pytest.mark.parametrize(
    "gpus",
    [
        pytest.param(2, marks=TWO_GPUS, id="cp2"),
        pytest.param(
            1, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), id="one_gpu"
        ),
    ],
)
def test_interleaved_fla_options_keep_their_own_results(gpus):
    """Two models (one block of the 9B, fp32, full recompute) with different FLA options (gate in or
    around FLA, summaries skipped or not, peer memory or NCCL swaps, fused or plain norms and loss),
    forward a, forward b, backward a, backward b: each gives what it gives alone (up to the
    run-to-run noise of FLA's non-deterministic CP kernels), its recompute ran inside backward. On one
    GPU (CP 1) the CP options have nothing to act on; the gate and the fused norms and loss do."""
    for rank, result in enumerate(run_distributed(_interleaved_fla_case, gpus, backend="nccl")):
        print(f"rank {rank}: {result}")
        assert max(result["interleaved_vs_alone"].values()) < 1e-3, (rank, result)
        assert result["recomputed_in_backward"] == {"defaults": 1, "other options": 1}, (rank, result)
        assert result["a_vs_b"] > 0, (rank, result)
