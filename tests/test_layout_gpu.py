"""relax_gdn.layout on NCCL (2 GPUs): token-exact swaps, gradients, and zero host syncs, through
both swap transports (NCCL all-to-all and peer memory)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _nccl_swap_cases():
    import torch.distributed as dist

    from relax_gdn.layout import SWAP_TRANSPORTS, build_route, swap_layout

    rank, device = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    failures = []
    for transport in SWAP_TRANSPORTS:
        # The first peer-memory swap allocates the staging buffers (a host-blocking
        # rendezvous, once): done here, for the largest case, before syncs are forbidden.
        swap_layout(
            torch.zeros(8192, 3, 16, device=device),
            build_route([0, 16384], 2, rank, "zigzag", "contiguous", device=device),
            None,
            transport=transport,
        )
        failures += [(transport, *f) for f in _swap_cases(rank, device, transport)]
    return failures


def _swap_cases(rank: int, device: torch.device, transport: str):
    from relax_gdn.layout import build_route, swap_layout, thd_rank_indices

    failures = []
    torch.manual_seed(0)  # every rank draws the same global data
    for cu in ([0, 16384], [0, 3000, 5192 + 3000, 16384 - 4384, 16384], [0, 4, 4, 64, 1024]):
        for source, target in (("zigzag", "contiguous"), ("contiguous", "zigzag")):
            route = build_route(cu, 2, rank, source, target, device=device)
            src_ids = thd_rank_indices(cu, 2, rank, source).to(device)
            tgt_ids = thd_rank_indices(cu, 2, rank, target).to(device)
            for dtype in (torch.float32, torch.bfloat16):
                data = torch.randn(cu[-1], 3, 16, device=device).to(dtype)
                x = data[src_ids].requires_grad_(True)
                weight = torch.randn_like(data)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
                y = swap_layout(x, route, None, transport=transport)
                (y * weight[tgt_ids]).sum().backward()
                back = swap_layout(y.detach(), route.reverse(), None, transport=transport)
                torch.cuda.set_sync_debug_mode("default")
                ok = (
                    torch.equal(y, data[tgt_ids])
                    and torch.equal(back, data[src_ids])
                    and torch.equal(x.grad, weight[src_ids])
                )
                if not ok:
                    failures.append((cu, source, str(dtype)))
    return failures


def test_swap_on_nccl_is_exact_and_sync_free():
    assert run_distributed(_nccl_swap_cases, 2, backend="nccl") == [[], []]


def _back_to_back_peer_memory_swaps():
    """Many peer-memory swaps issued with no host sync between them (as in a model's forward and
    backward), alternating routes, widths and directions, with a staging-buffer growth in the
    middle: each result must still be exact. This is what the double buffering must get right —
    a rank racing ahead may not overwrite a half its peer is still reading."""
    import torch.distributed as dist

    from relax_gdn.layout import build_route, swap_layout, thd_rank_indices

    rank, device = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(1)  # every rank draws the same global data
    packings = ([0, 3000, 8192, 12000, 16384], [0, 16384], [0, 1024 * 4, 1024 * 8, 1024 * 16])
    big = [0, 20000, 65536]  # needs larger staging halves than the 16k batches
    plan = [
        (cu, width, direction)
        for _ in range(3)
        for cu in packings
        for width in (64, 1536)
        for direction in (("zigzag", "contiguous"), ("contiguous", "zigzag"))
    ]
    plan.insert(len(plan) // 2, (big, 1536, ("zigzag", "contiguous")))
    cases = []  # everything that needs the host built first, so the swaps below go back to back
    for cu, width, (source, target) in plan:
        data = torch.randn(cu[-1], width, device=device, dtype=torch.bfloat16)
        route = build_route(cu, 2, rank, source, target, device=device)
        src, tgt = (thd_rank_indices(cu, 2, rank, layout).to(device) for layout in (source, target))
        cases.append((data[src].contiguous(), route, data[tgt]))
    torch.cuda.synchronize()
    outputs = [swap_layout(x, route, None, transport="peer_memory") for x, route, _ in cases]
    torch.cuda.synchronize()
    return [i for i, (y, (_, _, expected)) in enumerate(zip(outputs, cases)) if not torch.equal(y, expected)]


def test_back_to_back_peer_memory_swaps_are_exact():
    assert run_distributed(_back_to_back_peer_memory_swaps, 2, backend="nccl") == [[], []]
