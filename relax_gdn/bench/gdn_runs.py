"""Qwen3.5 forward + backward with chunkwise GDN: the residual stream kept contiguous through each
run of GDN layers (``gdn.contiguous_between_layers=true``, :mod:`relax_gdn.model.gdn_runs`) against
a swap pair around every GDN layer, side by side in one process group.

    torchrun --nproc-per-node 2 -m relax_gdn.bench.gdn_runs                    # CPU: tiny preset, gloo
    torchrun --nproc-per-node 2 -m relax_gdn.bench.gdn_runs --preset qwen3_5_9b_reduced \\
        --tokens-per-rank 8192                                                   # 2 GPUs, bf16, NCCL

Both models hold the same weights and run the same packed micro-batch (documents of seeded
log-normal lengths, padded to multiples of 2 x CP, zigzag-sharded as the data side does). The two
variants alternate for ``--rounds`` rounds of ``--iters`` timed calls (after warm-up) so drift
hits both; the table gives the median over rounds of each round's median, the ratio to per-layer
swaps, the swaps counted in one forward and one backward (the swap's profiler range), and the
largest per-token loss difference between the two (they must agree to rounding).

CPU timings (gloo, fp32, pure-torch GDN scan) say little about GPUs: there the swaps are NCCL
all-to-alls or peer-memory copies next to FLA kernels. Use the GPU command for decisions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

SWAP_RANGE = "relax_gdn.swap"
VARIANTS = {"per-layer swaps": False, "contiguous runs": True}


def document_lengths(total: int, multiple: int, mean: int, seed: int = 0) -> list[int]:
    """Seeded log-normal document lengths (sigma 1, median ``mean``), each a multiple of
    ``multiple``, summing to ``total`` (a multiple of ``multiple``)."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    left = total
    while left:
        want = int(rng.lognormal(np.log(mean), 1.0))
        length = min(left, max(multiple, -(-want // multiple) * multiple))
        lengths.append(length)
        left -= length
    return lengths


def _median_ms(fn, iters: int, warmup: int, device: torch.device) -> float:
    if device.type == "cuda":
        from relax_gdn.bench.timing import cuda_median_ms

        return cuda_median_ms(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _swaps(fn_forward, fn_backward) -> tuple[int, int]:
    from torch.profiler import profile

    with profile() as forward:
        out = fn_forward()
    with profile() as backward:
        fn_backward(out)
    count = lambda prof: sum(e.name.startswith(SWAP_RANGE) for e in prof.events())  # noqa: E731
    return count(forward), count(backward)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", help="default: qwen3_5_tiny on CPU, qwen3_5_9b_reduced on CUDA")
    parser.add_argument("--num-layers", type=int, help="override the preset's depth")
    parser.add_argument("--tokens-per-rank", type=int, help="default: 512 on CPU, 8192 on CUDA")
    parser.add_argument("--mean-doc", type=int, help="median document length (default: tokens per rank / 8)")
    parser.add_argument("--recompute", choices=("none", "full"), default="none")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from megatron.core.process_groups_config import ProcessGroupCollection

    from relax_gdn.bench.gdn_layer import packed_seq_params
    from relax_gdn.gdn.layer import CPGatedDeltaNet
    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model import build_qwen3_5_preset_model, qwen3_5_config, qwen3_5_preset

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl")
    else:  # Megatron-Core runs on CPU through the Runtime's shims (installed with main)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    preset = qwen3_5_preset(args.preset or ("qwen3_5_9b_reduced" if cuda else "qwen3_5_tiny"))
    tokens_per_rank = args.tokens_per_rank or (8192 if cuda else 512)
    total = tokens_per_rank * world
    if total % (2 * world):
        raise SystemExit(f"--tokens-per-rank {tokens_per_rank} must be even (the zigzag split needs 2 x CP)")
    lengths = document_lengths(total, 2 * world, args.mean_doc or max(2 * world, tokens_per_rank // 8))
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()

    single = [dist.new_group([r]) for r in range(world)][rank]
    pgs = ProcessGroupCollection(tp=single, cp=dist.group.WORLD, pp=single, embd=single)
    overrides = dict(use_cpu_initialization=not cuda)
    if args.num_layers:
        overrides["num_layers"] = args.num_layers
    if cuda:
        from megatron.core.tensor_parallel import random as mcore_random

        mcore_random.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
        overrides.update(bf16=True, params_dtype=torch.bfloat16)
    if args.recompute == "full":
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = qwen3_5_config(preset, **overrides)
    models = {}
    for label, contiguous in VARIANTS.items():
        torch.manual_seed(0)
        models[label] = build_qwen3_5_preset_model(
            preset,
            config,
            pg_collection=pgs,
            gdn=GDNOptions(cp_mode="chunkwise"),
            contiguous_between_layers=contiguous,
        ).to(device)
    state = models["per-layer swaps"].state_dict()
    models["contiguous runs"].load_state_dict(state)

    g = torch.Generator().manual_seed(0)
    ids = thd_rank_indices(cu, world, rank, "zigzag")
    tokens = torch.randint(0, preset.vocab_size, (1, total), generator=g)[:, ids].to(device)
    labels = torch.randint(0, preset.vocab_size, (1, total), generator=g)[:, ids].to(device)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None][:, ids].to(device)

    def forward(model):
        return model(tokens, positions, None, labels=labels, packed_seq_params=packed_seq_params(cu, device))

    def backward(loss):
        loss.float().sum().backward()

    def step(model):
        def run():
            backward(forward(model))
            model.zero_grad(set_to_none=True)

        return run

    losses, swaps = {}, {}
    for label, model in models.items():
        with torch.no_grad():
            losses[label] = forward(model).float()
        swaps[label] = _swaps(lambda m=model: forward(m), backward)
        model.zero_grad(set_to_none=True)
    rounds: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(args.rounds):
        for label, model in models.items():
            rounds[label].append(_median_ms(step(model), args.iters, args.warmup, device))
    ms = {label: statistics.median(samples) for label, samples in rounds.items()}
    loss_diff = (losses["contiguous runs"] - losses["per-layer swaps"]).abs().max()
    dist.all_reduce(loss_diff, op=dist.ReduceOp.MAX)

    if rank == 0:
        base = ms["per-layer swaps"]
        kinds = "".join(
            "G" if isinstance(layer.self_attention, CPGatedDeltaNet) else "A"
            for layer in models["contiguous runs"].decoder.layers
        )
        print(
            f"\n{preset.name} ({kinds}), CP {world} on {device.type}, {total} tokens "
            f"({len(lengths)} documents), "
            f"recompute {args.recompute}, fwd+bwd, {args.rounds} rounds x median of {args.iters}"
        )
        print(f"{'variant':<18}{'ms':>10}{'speed-up':>10}{'swaps fwd':>11}{'swaps bwd':>11}")
        for label in models:
            fwd, bwd = swaps[label]
            print(f"{label:<18}{ms[label]:>10.2f}{base / ms[label]:>9.3f}x{fwd:>11}{bwd:>11}")
        print(f"max |loss difference| per token: {loss_diff.item():.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    from relax_gdn.runtime import Runtime

    with Runtime():  # every process-wide change of the benchmark, undone when it ends
        main()
