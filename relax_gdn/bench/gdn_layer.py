"""One GDN layer at Qwen3.5-9B shapes, CP 2: every mode side by side (fwd+bwd, bf16, TP 1).

    torchrun --nproc-per-node 2 -m relax_gdn.bench.gdn_layer [--iters 10]

Rows: packed micro-batches (global tokens). Columns: median fwd+bwd ms per rank (CUDA events,
warm-up first) and host syncs per call (torch.cuda.set_sync_debug_mode("warn") on rank 0).
"host ms" is the host time to issue one call with the GPU idle (``timing.host_enqueue_ms``):
where it comes close to "ms", the call is host-bound. "ms" starts every call on an idle GPU (the
latency of one layer alone); "pipelined ms" is the per-call time of back-to-back calls
(``timing.cuda_pipelined_ms``), the steady state inside a model whose host issues layers ahead
of the GPU (zero host syncs per layer make that possible), where host time hides behind GPU work
until it exceeds it. The ideal gets both, from the same two measurements taken both ways.

Variants: chunkwise with the cached route; the same with FLA's own CP pre-pass (which also
computes the transition summaries no rank reads, see ``relax_gdn.gdn.fla_cp_summaries``); the
same with the decay gate's activation computed by torch around FLA instead of inside FLA's
chunk cumsum (``GDNOptions.fla_fused_gate``); the same with the swaps through NCCL's all-to-all
instead of reading peers' memory (``relax_gdn.layout.peer_memory``, the default on one host);
the same with the state of a document crossing the cut always passed through FLA's CP kernels,
where by default a prefix of at most ``gdn.max_recomputed_prefix`` tokens before the cut is
recomputed by the next rank (``RecomputedPrefix``; only the 16k row with a document across the
cut differs: the 64k ones cross with longer prefixes); the same with FLA's native zigzag CP
(``GDNOptions.fla_zigzag_cp``: no swaps, FLA passes the state along 2 x CP parts; it applies only
to the one-document row, where FLA's whole-stream zigzag is the data's per-document zigzag;
every other row runs plain chunkwise) (these six are one layer each, built with its
``GDNOptions`` and the same weights, timed in ``--rounds`` interleaved rounds, both their latency
and pipelined times); chunkwise with the route rebuilt per call the
per-token way (the seed's naive baseline); headwise (ours: cached checks and row maps); headwise
(stock Megatron-Core class); all_gather (layer only: the whole-layer recompute it needs in
training is not timed here); and the ideal: half the single-GPU time of the whole micro-batch
plus a bare all-to-all of the bytes chunkwise swaps (4 swaps of T/2 x hidden bf16). A last
column times one GPU on HALF the micro-batch (the first documents up to T/2): the fixed per-call
costs that "half the one-GPU time" leaves out.

``--profile`` then profiles chunkwise and the one-GPU half micro-batch (torch profiler, rank 0):
per call, the wall time, the GPU busy time (union of kernel intervals), the kernel count, the host
time to issue it, and the kernels with the most GPU time; ``--trace-dir`` also writes chrome
traces, ``--python-hotspots`` a cProfile of chunkwise (host time per Python function).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from relax_gdn.bench.needs import require_gpus
from relax_gdn.bench.timing import count_host_syncs, cuda_median_ms, cuda_pipelined_ms, host_enqueue_ms
from relax_gdn.gdn.options import GDNOptions

# The first two (the seed's) have the CP 2 cut (T/2) on a document boundary, so chunkwise scans
# each slice alone; in the third, as in the 64k ones, a document spans the cut.
MICRO_BATCHES = {
    "16k, 4 docs": [3000, 5192, 3808, 4384],
    "16k, 16 x 1k docs": [1024] * 16,
    "16k, 4 docs, one across the cut": [3000, 5000, 4000, 4384],
    "64k, 3 docs": [20000, 24000, 21536],
    "64k, 1 doc": [65536],
}


# The defaults (swaps through peer memory under torchrun), then one change each: label -> the
# GDNOptions fields its layer is built with.
CHUNKWISE_VARIANTS = {
    "chunkwise": {},
    "chunkwise, FLA's full CP summaries": {"fla_skip_unread_cp_summaries": False},
    "chunkwise, gate outside FLA": {"fla_fused_gate": False},
    "chunkwise, NCCL all-to-all swaps": {"swap_transport": "all_to_all"},
    "chunkwise, state always passed": {"max_recomputed_prefix": 0},
    "chunkwise, FLA zigzag CP (1 doc)": {"fla_zigzag_cp": True},
}


def qwen35_gdn_config(**overrides):
    """One Qwen3.5-9B GDN layer's config (bf16 unless overridden)."""
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=1,
        hidden_size=4096,
        num_attention_heads=16,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        normalization="RMSNorm",
        params_dtype=torch.bfloat16,
        bf16=True,
        activation_func=F.silu,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def packed_seq_params(cu: list[int], device: torch.device):
    """THD ``PackedSeqParams`` of one packed micro-batch with host boundaries ``cu``, the host copy
    attached as the data side does (so the layer makes zero syncs)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from relax_gdn.layout import attach_host_cu_seqlens

    t = torch.tensor(cu, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=t,
        cu_seqlens_kv=t,
        cu_seqlens_q_padded=t,
        cu_seqlens_kv_padded=t,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    attach_host_cu_seqlens(psp, t, cu)
    return psp


def python_hotspots(fn, iters: int = 5, top: int = 25) -> str:
    """cProfile of ``iters`` calls: the Python functions with the most host time, own and
    cumulative (Python >= 3.12's cProfile sees the autograd thread's backward too)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def profile_call(fn, iters: int = 5, top: int = 18, trace: str | None = None) -> str:
    """Where one call's time goes on this rank (see the module docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    enqueue_ms = host_enqueue_ms(fn)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / iters
    if trace:
        prof.export_chrome_trace(trace)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # union of kernel intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    per_name: dict[str, list[float]] = {}
    for e in kernels:
        acc = per_name.setdefault(e.name, [0, 0.0])
        acc[0] += 1
        acc[1] += e.time_range.elapsed_us()
    lines = [
        f"    wall {wall_ms:.2f} ms/call, GPU busy {busy / 1e3 / iters:.2f} ms/call, "
        f"{len(kernels) / iters:.0f} kernels/call, host enqueue {enqueue_ms:.2f} ms/call (no profiler)"
    ]
    for name, (count, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"    {us / 1e3 / iters:7.3f} ms {count / iters:5.1f}x  {name[:110]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the chunkwise variants")
    parser.add_argument("--only", default=None, help="micro-batch names separated by ;")
    parser.add_argument(
        "--profile", action="store_true", help="profile chunkwise and one GPU on half the batch"
    )
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument(
        "--python-hotspots",
        action="store_true",
        help="with --profile: cProfile of chunkwise on rank 0 (host time per Python function)",
    )
    args = parser.parse_args()
    require_gpus("relax_gdn.bench.gdn_layer", gpus=2)  # CP 2: the micro-batches are cut in two

    from relax_gdn.runtime import Runtime

    # after the checks above: installing touches CUDA, and a refused run must not pay for it
    with Runtime():  # every process-wide change of the benchmark, undone when it ends
        _run(args)


def _run(args) -> None:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from relax_gdn.bench.routes import per_token_route
    from relax_gdn.gdn import layer as gdn_layer
    from relax_gdn.gdn import row_plans
    from relax_gdn.layout import CP_LAYOUT_PAIR, thd_rank_indices

    if os.environ.get("RELAX_GDN_HANG_DUMP_S"):  # debugging aid: every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["RELAX_GDN_HANG_DUMP_S"]), exit=True)
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    world = dist.group.WORLD
    single = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    device = torch.device("cuda", rank)
    mcore_random.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    config = qwen35_gdn_config()

    def make(mode, cp_group, stock=False, **options):
        spec = gdn_layer.gdn_cp_layer_spec(GDNOptions(cp_mode=mode, max_cp_size=2, **options))
        if stock:
            spec = ModuleSpec(module=GatedDeltaNet, submodules=spec.submodules)
        pgs = ProcessGroupCollection(tp=single, cp=cp_group)
        return build_module(spec, config=config, layer_number=1, pg_collection=pgs).to(device)

    layers = {
        **{label: make("chunkwise", world, **options) for label, options in CHUNKWISE_VARIANTS.items()},
        "headwise": make("headwise", world),
        "headwise (stock MCore)": make("headwise", world, stock=True),
        "all_gather": make("all_gather", world),
        "single GPU": make("chunkwise", single),
    }
    state = layers["chunkwise"].state_dict()
    for layer in layers.values():
        layer.load_state_dict(state)

    table = []
    variants = list(CHUNKWISE_VARIANTS)
    names = args.only.split(";") if args.only else list(MICRO_BATCHES)
    for name in names:
        docs = MICRO_BATCHES[name]
        cu = [0]
        for d in docs:
            cu.append(cu[-1] + d)
        total = cu[-1]
        torch.manual_seed(0)
        x_full = torch.randn(total, 1, config.hidden_size, device=device, dtype=torch.bfloat16)
        dy_full = torch.randn_like(x_full)
        ids = thd_rank_indices(cu, 2, rank, "zigzag").to(device)
        x_local, dy_local = x_full[ids].contiguous(), dy_full[ids].contiguous()
        psp = packed_seq_params(cu, device)

        def step(layer, x, dy, p):
            def run():
                xx = x.detach().requires_grad_(True)
                out, _ = layer(xx, None, packed_seq_params=p)
                out.backward(dy)

            return run

        row = {}
        for label in ("headwise", "headwise (stock MCore)", "all_gather"):
            fn = step(layers[label], x_local, dy_local, psp)
            row[label] = (
                cuda_median_ms(fn, args.iters),
                count_host_syncs(fn),
                host_enqueue_ms(fn),
                cuda_pipelined_ms(fn),
            )
            print(
                f"[rank {rank} {time.strftime('%H:%M:%S')}] {name}: {label} {row[label][0]:.2f} ms",
                flush=True,
            )

        # Chunkwise and its A/B variants in interleaved rounds (median of the rounds' medians): a
        # host-bound row drifts between one timing and the next, so no variant is timed alone.
        calls = {label: step(layers[label], x_local, dy_local, psp) for label in variants}
        samples = {label: ([], []) for label in variants}  # (latency, pipelined) per round
        for _ in range(args.rounds):
            for label in variants:
                samples[label][0].append(cuda_median_ms(calls[label], args.iters))
                samples[label][1].append(cuda_pipelined_ms(calls[label]))
        for label in variants:
            latency, pipelined = samples[label]
            row[label] = (
                statistics.median(latency),
                count_host_syncs(calls[label]),
                host_enqueue_ms(calls[label]),
                statistics.median(pipelined),
            )

        # naive baseline: the route rebuilt per call, per token (the chunkwise layer's own row plans
        # replaced for this row, rather than a module attribute that a move of the code would orphan)
        class PerTokenRoutes(row_plans.GDNRowPlans):
            def route(self, psp_, resolved, cp, device, source=CP_LAYOUT_PAIR[0], target=CP_LAYOUT_PAIR[1]):
                return per_token_route(resolved.cu_seqlens, cp.size, cp.rank, source, target)

        cached_plans = layers["chunkwise"].row_plans
        layers["chunkwise"].row_plans = PerTokenRoutes(**dataclasses.asdict(cached_plans))
        try:
            fn = step(layers["chunkwise"], x_local, dy_local, psp)
            row["chunkwise, per-token route per call"] = (
                cuda_median_ms(fn, args.iters),
                count_host_syncs(fn),
                host_enqueue_ms(fn),
                cuda_pipelined_ms(fn),
            )
        finally:
            layers["chunkwise"].row_plans = cached_plans

        whole_step = step(layers["single GPU"], x_full, dy_full, packed_seq_params(cu, device))
        single_ms, single_pipelined_ms = cuda_median_ms(whole_step, args.iters), cuda_pipelined_ms(whole_step)
        half = total // 2
        half_cu = [c for c in cu if c <= half]
        if half_cu[-1] < half:
            half_cu.append(half)  # the document that crosses T/2 is cut there
        half_step = step(
            layers["single GPU"], x_full[:half], dy_full[:half], packed_seq_params(half_cu, device)
        )
        row["one GPU, half micro-batch"] = (
            cuda_median_ms(half_step, args.iters),
            None,
            host_enqueue_ms(half_step),
            cuda_pipelined_ms(half_step),
        )
        buf = torch.empty(total // 2, config.hidden_size, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(buf)

        def four_swaps():
            for _ in range(4):
                dist.all_to_all_single(out, buf)

        a2a_ms, a2a_pipelined_ms = cuda_median_ms(four_swaps, args.iters), cuda_pipelined_ms(four_swaps)
        row["ideal (single/2 + bare a2a)"] = (
            single_ms / 2 + a2a_ms,
            0,
            None,
            single_pipelined_ms / 2 + a2a_pipelined_ms,
        )
        row["single GPU, whole micro-batch"] = (single_ms, None, None, single_pipelined_ms)
        table.append((name, row))
        if args.profile:
            trace = (
                (
                    lambda v: os.path.join(
                        args.trace_dir, f"{name}-{v}-rank{rank}.json".replace(" ", "_").replace(",", "")
                    )
                )
                if args.trace_dir
                else (lambda v: None)
            )
            report = {
                "chunkwise": profile_call(
                    step(layers["chunkwise"], x_local, dy_local, psp), trace=trace("chunkwise")
                ),
                "one GPU, half micro-batch": profile_call(half_step, trace=trace("half")),
            }
            if args.python_hotspots:
                chunkwise_call = step(layers["chunkwise"], x_local, dy_local, psp)
                report["chunkwise, Python hotspots"] = python_hotspots(chunkwise_call)
            if rank == 0:
                for label, text in report.items():
                    print(f"\n[profile] {name}: {label}\n{text}", flush=True)

    if rank == 0:
        print(f"\nGDN layer fwd+bwd, Qwen3.5-9B shapes, bf16, TP1 CP2, {torch.cuda.get_device_name()}")
        order = [
            *variants,
            "chunkwise, per-token route per call",
            "headwise",
            "headwise (stock MCore)",
            "all_gather",
            "ideal (single/2 + bare a2a)",
            "single GPU, whole micro-batch",
            "one GPU, half micro-batch",
        ]
        for name, row in table:
            stock, stock_pipelined = row["headwise (stock MCore)"][0], row["headwise (stock MCore)"][3]
            print(f"\n{name}")
            print(
                f"  {'variant':<38} {'ms':>8} {'vs stock headwise':>18} {'syncs/call':>11} {'host ms':>8} "
                f"{'pipelined ms':>13} {'vs stock':>9}"
            )
            for label in order:
                ms, syncs, host, pipelined = row[label]
                print(
                    f"  {label:<38} {ms:>8.2f} {stock / ms:>17.2f}x {'' if syncs is None else syncs:>11} "
                    f"{'' if host is None else f'{host:.2f}':>8} {pipelined:>13.2f} {stock_pipelined / pipelined:>8.2f}x"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
