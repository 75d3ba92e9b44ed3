"""Training throughput of CP variants side by side, in one process group.

    torchrun --nproc-per-node 2 -m relax_gdn.bench.train_cp                 # reduced 9B, bf16, 2 GPUs
    torchrun --nproc-per-node 2 -m relax_gdn.bench.train_cp --variants static:chunkwise,dynamic:chunkwise

Each variant is a short ``run_training`` on the same samples (the same seed, so the same global
batches); the table gives medians over the steps after ``--skip`` warm-up steps (kernel compile,
autotune, caches), and the ratio of tokens/s to the first variant. ``static:<mode>`` is
``parallel.cp=<world>``; ``dynamic:<mode>`` adds ``parallel.dynamic_cp`` with ``max_cp=<world>``.
"""

from __future__ import annotations

import argparse
import statistics

import torch.distributed as dist


def _variant_overrides(variant: str, world: int) -> dict:
    kind, _, mode = variant.partition(":")
    if kind not in ("static", "dynamic") or mode not in ("chunkwise", "headwise", "all_gather"):
        raise ValueError(f"--variants entry {variant!r}: want static|dynamic:chunkwise|headwise|all_gather")
    overrides = {"gdn.cp_mode": mode, "parallel.cp": world,
                 "recompute.granularity": "full" if mode == "all_gather" else "none"}
    if kind == "dynamic":
        overrides |= {"parallel.dynamic_cp.enabled": True, "parallel.dynamic_cp.max_cp": world}
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="static:chunkwise,dynamic:chunkwise,static:headwise")
    parser.add_argument("--preset", default="qwen3_5_9b_reduced")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=2048)
    args = parser.parse_args()

    from relax_gdn.config import RunConfig
    from relax_gdn.train.loop import init_distributed, run_training, select_device
    from relax_gdn.train.metrics import cp_size_histogram

    base = RunConfig().with_overrides({
        "model.preset": args.preset, "train.steps": args.steps, "train.global_batch_size": args.global_batch_size,
        "train.max_tokens_per_gpu": args.max_tokens_per_gpu, "data.max_sample_tokens": 2 * args.max_tokens_per_gpu,
        "data.synthetic_max_steps": 60, "data.num_samples": args.global_batch_size * args.steps,
        "optim.warmup_steps": 1, "optim.lr": 1e-5, "optim.min_lr": 1e-6, "logging.console": False, "logging.jsonl": False,
    })
    init_distributed(select_device(base))
    world = dist.get_world_size()
    rows = []
    for variant in args.variants.split(","):
        records = run_training(base.with_overrides(_variant_overrides(variant, world)), None).records
        timed = records[args.skip:] or records
        # static CP: every micro-batch ran at CP = world
        histogram = cp_size_histogram(timed) or {str(world): sum(r["num_micro_batches"] for r in timed)}
        rows.append(dict(
            variant=variant, tok_s=statistics.median(r["tokens_per_s"] for r in timed),
            step_s=statistics.median(r["step_time_s"] for r in timed),
            mfu=statistics.median(r["mfu"] or 0.0 for r in timed),
            syncs=statistics.median(r["host_syncs"] or 0 for r in timed),
            mem=max(r["peak_mem_gb"] or 0.0 for r in timed), loss=timed[-1]["loss"], cp_sizes=histogram,
        ))
    if dist.get_rank() == 0:
        first = rows[0]["tok_s"]
        print(f"\n{args.preset}, world {world}, global batch {args.global_batch_size}, max_tokens_per_gpu "
              f"{args.max_tokens_per_gpu}, medians of steps {args.skip + 1}-{args.steps}")
        print(f"{'variant':<22}{'tok/s':>10}{'vs first':>10}{'step s':>9}{'MFU':>7}{'syncs':>7}{'GiB':>7}"
              f"{'loss':>8}  micro-batches per CP size")
        for r in rows:
            print(f"{r['variant']:<22}{r['tok_s']:>10.0f}{r['tok_s'] / first:>9.2f}x{r['step_s']:>9.3f}"
                  f"{r['mfu']:>7.3f}{r['syncs']:>7.0f}{r['mem']:>7.1f}{r['loss']:>8.4f}  {r['cp_sizes']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
