"""The fused ops of ``relax_gdn.model.fusion`` against the plain formulas, one GPU, 9B shapes.

    python -m relax_gdn.bench.fused_ops [--tokens 8192]

fwd+bwd medians (CUDA events) and peak extra memory of each op per micro-batch, bf16: the
zero-centred RMSNorm (8192 x 4096), the GDN gated norm ((8192·32) x 128), SwiGLU (8192 x 12288,
plain vs Megatron-Core's fused ``bias_swiglu_impl``), the wgrad GEMM accumulating into an fp32
main grad (``relax_gdn.compat.wgrad``) against a bf16 GEMM plus DDP's add, and the output layer + per-token
cross-entropy (4096 -> 248,320): Megatron-Core's vocab-parallel loss on full logits, the chunked
:func:`~relax_gdn.model.fusion.linear_cross_entropy`, and liger-kernel's fused linear
cross-entropy (``reduction="none"``) where it imports. Each row also counts host syncs.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from relax_gdn.bench.needs import require_gpus
from relax_gdn.bench.timing import count_host_syncs, cuda_median_ms


def _fwd_bwd(fn, inputs, seed_grad=None):
    def run():
        for t in inputs:
            t.grad = None
        out = fn()
        out.backward(seed_grad if seed_grad is not None else torch.ones_like(out))

    return run


def _measure(name, run, rows):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    syncs = count_host_syncs(run)
    ms = cuda_median_ms(run, iters=10, warmup=3, align_ranks=False)
    rows.append((name, ms, extra, syncs))
    print(f"{name:<48}{ms:>9.2f}{extra:>8.2f}{syncs:>7d}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    require_gpus("relax_gdn.bench.fused_ops")

    from relax_gdn.runtime import Runtime

    # after the checks above: installing touches CUDA, and a refused run must not pay for it
    with Runtime():  # every process-wide change of the benchmark, undone when it ends
        _measure_all(args)


def _measure_all(args) -> None:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from relax_gdn.model import fusion
    from relax_gdn.parallel import ParallelContext, init_distributed

    init_distributed(torch.device("cuda", 0))  # the plain loss asks for its (one-rank) TP group
    ParallelContext.initialize(tp=1, cp=1, dynamic_max_cp=None)

    torch.manual_seed(0)
    dev, bf16, n = torch.device("cuda"), torch.bfloat16, args.tokens
    rows: list = []
    print(f"{'op (fwd+bwd, bf16, ' + str(n) + ' tokens)':<48}{'ms':>9}{'+GiB':>8}{'syncs':>7}")

    x = torch.randn(n, 4096, device=dev, dtype=bf16, requires_grad=True)
    w = (0.1 * torch.randn(4096, device=dev, dtype=bf16)).requires_grad_()

    def plain_norm():
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.float() + 1.0)).to(x.dtype)

    _measure("rmsnorm zero-centred: plain fp32 chain", _fwd_bwd(plain_norm, [x, w]), rows)
    _measure(
        "rmsnorm zero-centred: fused F.rms_norm",
        _fwd_bwd(lambda: fusion.fused_rms_norm(x, w, 1e-6, True), [x, w]),
        rows,
    )

    o = torch.randn(n * 32, 128, device=dev, dtype=bf16, requires_grad=True)
    z = torch.randn(n * 32, 128, device=dev, dtype=bf16, requires_grad=True)
    gw = (1 + 0.1 * torch.randn(128, device=dev, dtype=bf16)).requires_grad_()

    def plain_gated():
        o32 = o.float()
        y = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + 1e-6) * gw.float()
        return (y * F.silu(z.float())).to(o.dtype)

    _measure("gated norm: plain", _fwd_bwd(plain_gated, [o, z, gw]), rows)
    _measure(
        "gated norm: FLA rms_norm_gated",
        _fwd_bwd(lambda: fusion.fused_gated_rms_norm(o, z, gw, 1e-6), [o, z, gw]),
        rows,
    )

    a = torch.randn(n, 2 * 12288, device=dev, dtype=bf16, requires_grad=True)

    def plain_swiglu():
        g, lin = torch.chunk(a, 2, dim=-1)
        return F.silu(g) * lin

    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    _measure("swiglu: plain", _fwd_bwd(plain_swiglu, [a]), rows)
    _measure("swiglu: Megatron bias_swiglu_impl", _fwd_bwd(lambda: bias_swiglu_impl(a, None), [a]), rows)
    a = None  # frees it (the closures above are done with it)

    from relax_gdn.compat.wgrad import FUSED_WGRAD_MODULE

    x_in = torch.randn(n, 4096, device=dev, dtype=bf16)
    g_out = torch.randn(n, 12288, device=dev, dtype=bf16)
    main_grad = torch.zeros(12288, 4096, device=dev)

    def unfused_wgrad():  # the linear's bf16 weight gradient, then DDP's add into the fp32 buffer
        main_grad.add_(g_out.t() @ x_in)

    def fused_wgrad():
        FUSED_WGRAD_MODULE.wgrad_gemm_accum_fp32(x_in, g_out, main_grad)

    _measure("wgrad 12288x4096: bf16 GEMM + fp32 add", unfused_wgrad, rows)
    _measure("wgrad 12288x4096: addmm into fp32 main_grad", fused_wgrad, rows)
    x_in = g_out = main_grad = None  # frees them

    vocab = 248_320
    h = torch.randn(n, 4096, device=dev, dtype=bf16, requires_grad=True)
    head = (0.02 * torch.randn(vocab, 4096, device=dev, dtype=bf16)).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device=dev)
    weights = torch.rand(n, device=dev)  # a loss mask / token count as the loop's upstream gradient
    kernels = fusion.ChunkKernels()  # compiled once, as a model's loss keeps them

    def plain_ce():
        logits = (h @ head.t()).unsqueeze(1)  # [s, b, V] like the output layer
        return vocab_parallel_cross_entropy(logits, labels.unsqueeze(1)).squeeze(1)

    _measure("lm_head + CE: plain (Megatron vocab-parallel)", _fwd_bwd(plain_ce, [h, head], weights), rows)
    _measure(
        "lm_head + CE: chunked linear_cross_entropy",
        _fwd_bwd(lambda: fusion.linear_cross_entropy(h, head, labels, kernels=kernels), [h, head], weights),
        rows,
    )
    mask = (weights > 0.3).float()  # the training loss: the masked sum, gradients formed in forward
    _measure(
        "lm_head + CE: plain, masked sum",
        _fwd_bwd(lambda: (plain_ce().float() * mask).sum(), [h, head]),
        rows,
    )
    _measure(
        "lm_head + CE: chunked weighted_linear_cross_entropy_sum",
        _fwd_bwd(
            lambda: fusion.weighted_linear_cross_entropy_sum(h, head, labels, mask, kernels=kernels),
            [h, head],
        ),
        rows,
    )
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except ImportError:
        print("liger-kernel not importable: its row is left out")
    else:
        _measure(
            "lm_head + CE: liger-kernel 'none'",
            _fwd_bwd(
                lambda: LigerFusedLinearCrossEntropyFunction.apply(
                    h, head, labels, None, None, -100, 0.0, 0.0, "none"
                )[0],
                [h, head],
                weights,
            ),
            rows,
        )


if __name__ == "__main__":
    main()
