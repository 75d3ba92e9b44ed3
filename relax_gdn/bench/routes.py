"""Route build time: interval intersection vs the per-token approach, side by side.

    python -m relax_gdn.bench.routes [--quick]

The per-token baseline is the approach the seed started from (Relax Stage 1): for every rank,
per-token partition indices (bucketize over cu_seqlens, boolean masks, nonzero), then an
argsort by (destination, target row) for the send side and a mask + nonzero per source rank for
the receive side: O(W * T) tensor work per direction. It runs here on CPU tensors; on a GPU the
same code also pays a host sync per nonzero. Both directions are timed for the baseline (it was
recomputed per swap); one interval route serves both directions, so it is built once.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from relax_gdn.layout import build_route


def per_token_indices(cu: torch.Tensor, cp_size: int, cp_rank: int, layout: str) -> torch.Tensor:
    """Global token ids of one rank, computed per token on ``cu``'s device (the baseline's partition
    step; on a GPU ``int(cu[-1])`` and the boolean index are host syncs)."""
    cu = cu.long()
    total = int(cu[-1])
    ids = torch.arange(total, device=cu.device)
    if layout == "contiguous":
        part = total // cp_size
        return ids[cp_rank * part : (cp_rank + 1) * part]
    seq = torch.bucketize(ids, cu[1:], right=True)
    pos = ids - cu[seq]
    chunk = pos // ((cu[seq + 1] - cu[seq]) // (2 * cp_size))
    return ids[(chunk == cp_rank) | (chunk == 2 * cp_size - 1 - cp_rank)]


def random_packing(total: int, num_seqs: int, cp_size: int, rng: np.random.Generator) -> list[int]:
    """``num_seqs`` documents of random lengths (multiples of 2W) that sum to ``total``."""
    unit = 2 * cp_size
    units = total // unit
    cuts = np.sort(rng.choice(np.arange(1, units), size=num_seqs - 1, replace=False))
    return (np.concatenate([[0], cuts, [units]]) * unit).tolist()


def paired_medians(
    fast, slow, rounds: int, fast_per_round: int = 20, fast_warmup: int = 3
) -> tuple[float, float]:
    """Median seconds of ``fast()`` and ``slow()``, timed interleaved so that both see the same
    machine (a shared VM's speed drifts from one second to the next, which skews a ratio of
    back-to-back medians): each round runs ``slow`` once, then ``fast`` ``fast_warmup`` times
    untimed (the slow call leaves caches and the allocator cold) and ``fast_per_round`` times timed."""
    fast(), slow()  # warm-up
    fast_samples, slow_samples = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        slow()
        slow_samples.append(time.perf_counter() - start)
        for _ in range(fast_warmup):
            fast()
        for _ in range(fast_per_round):
            start = time.perf_counter()
            fast()
            fast_samples.append(time.perf_counter() - start)
    return statistics.median(fast_samples), statistics.median(slow_samples)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few rows only (smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(1234)
    grid = [(t, n, w) for t in (8192, 16384, 32768, 65536) for n in (1, 16, 64, 256) for w in (2, 4, 8)]
    if args.quick:
        grid = [(8192, 16, 2), (32768, 64, 4)]
    print(
        f"{'T':>6} {'seqs':>5} {'W':>2} | {'interval (both dirs)':>20} | {'per-token x2':>13} | {'speed-up':>8}"
    )
    for total, num_seqs, cp_size in grid:
        cu_list = random_packing(total, num_seqs, cp_size, rng)
        cu = torch.tensor(cu_list)
        rank = cp_size - 1  # the last rank receives from everyone in zigzag->contiguous
        rounds = 10 if total * cp_size > 2**18 else 30
        interval, per_token = paired_medians(
            lambda: build_route(cu_list, cp_size, rank, "zigzag", "contiguous"),
            lambda: (
                per_token_route(cu, cp_size, rank, "zigzag", "contiguous"),
                per_token_route(cu, cp_size, rank, "contiguous", "zigzag"),
            ),
            rounds,
        )
        print(
            f"{total:>6} {num_seqs:>5} {cp_size:>2} | {interval * 1e3:>17.3f} ms | "
            f"{per_token * 1e3:>10.2f} ms | {per_token / interval:>7.1f}x"
        )


def per_token_route(cu: torch.Tensor, cp_size: int, cp_rank: int, source: str, target: str):
    """The baseline route, per token, on ``cu``'s device. On a GPU this is the seed's naive path
    with its host syncs (``int(cu[-1])``, nonzero, boolean indexing, ``.tolist()``); it returns a
    :class:`relax_gdn.layout.Route` so the layer can use it unchanged."""
    from relax_gdn.layout import Route

    total = int(cu[-1])
    owner = torch.empty(total, dtype=torch.long, device=cu.device)
    position = torch.empty(total, dtype=torch.long, device=cu.device)
    for d in range(cp_size):
        ids = per_token_indices(cu, cp_size, d, target)
        owner[ids] = d
        position[ids] = torch.arange(ids.numel(), device=cu.device)
    sources = [per_token_indices(cu, cp_size, s, source) for s in range(cp_size)]
    mine = sources[cp_rank]
    dest = owner[mine]
    keep = (dest == cp_rank).nonzero().squeeze(1)
    order = torch.argsort(dest * total + position[mine], stable=True)
    remote = order[dest[order] != cp_rank]
    # the whole exchange in one host copy (the route's splits are its row and column)
    pair_rows = torch.stack([torch.bincount(owner[ids], minlength=cp_size) for ids in sources]).tolist()
    recv_blocks = [position[ids[owner[ids] == cp_rank]] for s, ids in enumerate(sources) if s != cp_rank]
    return Route(
        pair_rows=tuple(map(tuple, pair_rows)),
        keep_source=keep,
        keep_target=position[mine[keep]],
        send_rows=remote,
        recv_rows=torch.cat(recv_blocks),
        local_rows=total // cp_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        source=source,
        target=target,
        device=cu.device,
    )


if __name__ == "__main__":
    from relax_gdn.runtime import Runtime

    with Runtime():  # every process-wide change of the benchmark, undone when it ends
        main()
