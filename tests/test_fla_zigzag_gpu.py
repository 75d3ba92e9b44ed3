"""FLA 0.6's native zigzag CP (``GDNOptions.fla_zigzag_cp``) on 2 GPUs (NCCL): a
one-document micro-batch scanned on its zigzag rows equals the single-rank fp32 torch reference
and the swap + contiguous chunkwise path (output, input gradient, every parameter gradient), with
no swap and no host sync; a micro-batch of several documents is left to the swap path (bit for
bit). Shapes as in ``test_gdn_layer_gpu`` (Qwen3.5-9B heads), bf16.

The one-document check and the option's kernel choice run on CPU too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relax_gdn.gdn.layer import one_document
from tests.distributed import run_distributed

ONE_DOCUMENT = [0, 1280, 1280]  # with a trailing empty padding slot
SEVERAL = [0, 192, 192, 704, 768, 1280]
SWAP_RANGE = "relax_gdn.swap"


def test_one_document_ignores_empty_padding_slots():
    assert one_document(np.array([0, 1280]))
    assert one_document(np.array([0, 0, 1280, 1280]))
    assert not one_document(np.array([0, 640, 1280]))
    assert not one_document(np.array([0, 0]))


def test_fla_zigzag_cp_is_the_layers_option_and_the_reference_never_uses_it():
    pytest.importorskip("fla.ops.cp")
    from relax_gdn.gdn.kernels import select_kernels
    from relax_gdn.gdn.options import GDNOptions

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # names only: no GPU is touched
    assert (
        not GDNOptions().fla_zigzag_cp
        and not select_kernels(GDNOptions(kernel_backend="fla"), cuda).zigzag_cp
    )
    assert select_kernels(GDNOptions(kernel_backend="fla", fla_zigzag_cp=True), cuda).zigzag_cp
    assert not select_kernels(GDNOptions(kernel_backend="torch", fla_zigzag_cp=True), cpu).zigzag_cp


def _swaps(fn) -> int:
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return sum(e.name.startswith(SWAP_RANGE) for e in prof.events())


def _zigzag_cases():
    import torch.distributed as dist

    from relax_gdn.bench.timing import count_host_syncs
    from tests import gdn_harness as h
    from tests.gdn_harness import HIDDEN, nine_b_heads
    from tests.gdn_harness import as_fp32 as _as_fp32
    from tests.gdn_harness import paired as _paired
    from tests.gdn_harness import vs_reference as _vs_reference

    rank, world = dist.get_rank(), dist.group.WORLD
    dtype = torch.bfloat16
    device, _, reference, fla_layer = nine_b_heads(dtype)
    layer = fla_layer()
    native_layer = fla_layer(fla_zigzag_cp=True)
    x = torch.randn(ONE_DOCUMENT[-1], 1, HIDDEN, device=device)
    weight = torch.randn_like(x)
    results = {}

    def run(cu, on=layer):
        return _as_fp32(
            h.cp_run(on, x.to(dtype), weight.to(dtype), h.packed_params(cu, device), 2, rank, world, cu=cu)
        )

    ref = h.reference_run(reference, x, weight, h.packed_params(ONE_DOCUMENT, device))
    swapped = run(ONE_DOCUMENT)
    native = run(ONE_DOCUMENT, native_layer)
    ids = native[3]
    psp = h.packed_params(ONE_DOCUMENT, device)

    def call():
        out, _ = native_layer(x[ids].to(dtype).requires_grad_(True), None, packed_seq_params=psp)
        out.backward(weight[ids].to(dtype))

    call()  # routes, FLA context and chunk index of this micro-batch built
    results["swaps, native"] = _swaps(call)
    results["host syncs, native"] = count_host_syncs(call)
    several_native = run(SEVERAL, native_layer)

    def swap_path_call():
        out, _ = layer(
            x[ids].to(dtype).requires_grad_(True),
            None,
            packed_seq_params=h.packed_params(ONE_DOCUMENT, device),
        )
        out.backward(weight[ids].to(dtype))

    results["swaps, swap path"] = _swaps(swap_path_call)
    several = run(SEVERAL)
    results["native vs reference"] = max(_vs_reference(ref, native, dtype).values())
    results["swap path vs reference"] = max(_vs_reference(ref, swapped, dtype).values())
    results["native vs swap path"] = max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() for _, a, b in _paired(native, swapped)
    )
    results["several documents untouched"] = all(
        torch.equal(a, b) for _, a, b in _paired(several_native, several)
    )
    return results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fla_native_zigzag_matches_reference_without_swaps():
    from tests.gdn_harness import CP_TOLERANCE, TOLERANCE

    for rank, results in enumerate(run_distributed(_zigzag_cases, 2, backend="nccl")):
        print(f"rank {rank}: {results}")
        assert results["native vs reference"] < TOLERANCE[torch.bfloat16], (rank, results)
        assert results["native vs swap path"] < CP_TOLERANCE[torch.bfloat16], (rank, results)
        assert results["swaps, native"] == 0 and results["swaps, swap path"] == 4, (
            rank,
            results,
        )  # fwd 2 + bwd 2
        assert results["host syncs, native"] == 0, (rank, results)
        assert results["several documents untouched"], (rank, results)
