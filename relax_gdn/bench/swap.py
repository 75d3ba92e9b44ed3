"""Swap cost on GPUs: zigzag<->contiguous with a prebuilt route vs a bare all-to-all of the same bytes.

    torchrun --nproc-per-node 2 -m relax_gdn.bench.swap [--rows 8192 --widths 12352,4096]

Rows per rank x width bf16 (12352 = the qkvzba width of a Qwen3.5-9B GDN layer, 4096 = its
hidden width, which chunkwise swaps without sequence parallelism). The bare all-to-all sends equal
splits of the same tensor with no pack or scatter: the floor a swap can reach. Host syncs inside the swaps are
counted with torch.cuda.set_sync_debug_mode("warn"). Two timings per variant: the latency of one
call (ranks aligned, GPU idle before it: the host's launch work is on the clock) and the time per
call of ``--pipelined`` calls issued back to back (the host runs ahead of the GPU, as in a model's
forward/backward, so what remains is the GPU's own cost); each is compared with the bare
all-to-all timed the same way. "host ms" is the host time to issue one call (what the latency
pays for on a slow host). A second table times the swap's scatter
kernels alone (no NCCL, so no transfer noise): every scattered row list of the multi-document
routes (``put_rows`` into index rows), as 16-byte words (what the swap does) and as 2-byte
elements (``put_rows(..., as_words=False)``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from relax_gdn.bench.needs import require_gpus
from relax_gdn.bench.timing import count_host_syncs, cuda_median_ms, host_enqueue_ms
from relax_gdn.layout import SWAP_TRANSPORTS, build_route, swap_layout
from relax_gdn.layout.route import put_rows


def _scatter_kernels(x: torch.Tensor, routes: dict, iters: int) -> dict[str, tuple[float, float]]:
    """(16-byte words, 2-byte elements) ms of each scattered index row list of the routes."""
    out = torch.empty_like(x)
    timings = {}
    for name, route in routes.items():
        for r in (route, route.reverse()):
            for field in ("keep_target", "recv_rows"):
                rows = getattr(r, field)
                if isinstance(rows, slice):
                    continue
                values = x[: len(rows)].contiguous()
                # rank-local work: ranks may have different numbers of index row lists
                row = [
                    cuda_median_ms(
                        lambda rows=rows, wide=wide: put_rows(out, rows, values, as_words=wide),
                        iters,
                        5,
                        align_ranks=False,
                    )
                    for wide in (True, False)
                ]
                timings[f"{name} {r.source}->{r.target} {field} ({len(rows)})"] = tuple(row)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8192, help="rows per rank")
    parser.add_argument("--widths", default="12352,4096")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--pipelined", type=int, default=8, help="calls back to back per pipelined sample")
    args = parser.parse_args()
    require_gpus("relax_gdn.bench.swap", gpus=2, more_ok=True)

    from relax_gdn.runtime import Runtime

    # after the checks above: installing touches CUDA, and a refused run must not pay for it
    with Runtime():  # every process-wide change of the benchmark, undone when it ends
        _run(args)


def _run(args) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    device = torch.device("cuda", rank)
    total = args.rows * world
    unit = 2 * world
    docs = [3000, 5192, 3808] if total == 16384 else [total // 4, total // 2]
    docs = [d // unit * unit for d in docs]
    packings = {
        "multi-doc": [0, *torch.tensor(docs).cumsum(0).tolist(), total],
        "single-doc": [0, total],
        "64 docs": torch.arange(0, total + 1, total // 64).tolist(),
    }
    routes = {
        name: build_route(cu, world, rank, "zigzag", "contiguous", device=device)
        for name, cu in packings.items()
    }

    for width in (int(w) for w in args.widths.split(",")):
        x = torch.randn(args.rows, width, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        k = args.pipelined

        def timings(fn):
            """(latency ms, pipelined ms per call, host ms to issue one call)"""

            def repeated():
                for _ in range(k):
                    fn()

            return (
                cuda_median_ms(fn, args.iters, 5),
                cuda_median_ms(repeated, args.iters, 2) / k,
                host_enqueue_ms(fn, args.iters),
            )

        bare = timings(lambda: dist.all_to_all_single(out, x))
        rows = [("bare all_to_all_single", *bare, 0)]
        mismatches = []
        for name, route in routes.items():
            for direction, r in (("zigzag->contiguous", route), ("contiguous->zigzag", route.reverse())):
                results = {}
                for transport in SWAP_TRANSPORTS:  # side by side, the same route and data
                    fn = lambda r=r, transport=transport: swap_layout(x, r, None, transport=transport)  # noqa: E731
                    results[transport] = fn()
                    label = f"{name} {direction}" + ("" if transport == "all_to_all" else f" [{transport}]")
                    rows.append((label, *timings(fn), count_host_syncs(fn)))
                if not all(torch.equal(results["all_to_all"], v) for v in results.values()):
                    mismatches.append(f"{name} {direction}")

        if rank == 0:
            gb = x.numel() * x.element_size() / 1e9
            print(
                f"\nswap of {args.rows} x {width} bf16 rows per rank ({gb:.3f} GB), {world} GPUs, "
                f"{torch.cuda.get_device_name()}; pipelined = {k} calls back to back"
            )
            print(
                f"{'variant':<46} {'latency ms':>10} {'vs bare':>8} {'pipelined ms':>13} {'vs bare':>8} "
                f"{'host ms':>8} {'host syncs':>10}"
            )
            for label, latency, pipelined, host, syncs in rows:
                print(
                    f"{label:<46} {latency:>10.3f} {latency / bare[0]:>7.2f}x {pipelined:>13.3f} "
                    f"{pipelined / bare[1]:>7.2f}x {host:>8.3f} {syncs:>10}"
                )
            print("transports token-identical:", "yes" if not mismatches else f"NO: {mismatches}")
        kernels = _scatter_kernels(x, routes, args.iters)
        if rank == 0:
            print(f"\nscatter kernels of the swaps (rank 0), width {width}: median ms")
            print(f"{'row list':<48} {'16-byte words':>14} {'2-byte elements':>16}")
            for label, (wide, narrow) in kernels.items():
                print(f"{label:<48} {wide:>14.3f} {narrow:>16.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
