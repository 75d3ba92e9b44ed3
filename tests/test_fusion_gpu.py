"""The fused paths on one GPU against the plain formulas (forward and gradients), with no host
syncs: torch's fused rms_norm kernel, FLA's gated-norm Triton kernel, the chunked output layer +
cross-entropy, the embedding's gradient added into DDP's main grad; then the tiny and
the reduced 9B trained with fusion on vs off and selective recompute vs none.

Tolerances, relative to the reference's norm: fp32 1e-4 (Triton's fp32 reductions order sums
differently); bf16 2e-2 (one bf16 rounding of 1 + w, of the logits chunk's gradient, of the
output); model losses 1e-3 and grad norms 2e-2 (bf16 end to end)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relax_gdn.bench.timing import count_host_syncs
from relax_gdn.model import fusion
from tests.helpers import plain_rms_norm as _plain_rms_norm
from tests.helpers import relative_error as _rel
from tests.helpers import train_reduced_9b_on_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _run(fn, tensors, grad):
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(grad)
    return [out] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_cuda(dtype):
    torch.manual_seed(0)
    x = (2 * torch.randn(4096, 4096, device="cuda")).to(dtype)
    w = (0.1 * torch.randn(4096, device="cuda")).to(dtype)
    grad = torch.randn_like(x)
    want = _run(lambda a, b: _plain_rms_norm(a, b, 1e-6, True), (x, w), grad)
    got = _run(lambda a, b: fusion.fused_rms_norm(a, b, 1e-6, True), (x, w), grad)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and _rel(g, r) < TOL[dtype]
    assert (
        count_host_syncs(lambda: _run(lambda a, b: fusion.fused_rms_norm(a, b, 1e-6, True), (x, w), grad))
        == 0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gated_rms_norm_cuda(dtype):
    torch.manual_seed(1)
    o = torch.randn(8192 * 4, 128, device="cuda").to(dtype)
    z = torch.randn_like(o)
    w = (1 + 0.1 * torch.randn(128, device="cuda")).to(dtype)
    grad = torch.randn_like(o)

    def plain(a, g, b):
        return (_plain_rms_norm(a, b, 1e-6, False).float() * F.silu(g.float())).to(a.dtype)

    want = _run(plain, (o, z, w), grad)
    got = _run(lambda a, g, b: fusion.fused_gated_rms_norm(a, g, b, 1e-6), (o, z, w), grad)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and _rel(g, r) < TOL[dtype]
    assert (
        count_host_syncs(
            lambda: _run(lambda a, g, b: fusion.fused_gated_rms_norm(a, g, b, 1e-6), (o, z, w), grad)
        )
        == 0
    )


def test_chunked_cross_entropy_cuda_bf16():
    torch.manual_seed(2)
    n, h, vocab = 3000, 1024, 50_000  # 3 chunks of 1024 tokens, the last one short
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    weight = (0.05 * torch.randn(vocab, h, device="cuda")).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    upstream = torch.rand(n, device="cuda") * (torch.rand(n, device="cuda") > 0.3)

    def plain(a, b):
        return F.cross_entropy((a @ b.t()).float(), labels, reduction="none")

    def chunked(a, b):
        return fusion.linear_cross_entropy(a, b, labels, chunk_tokens=1024)

    want = _run(plain, (hidden, weight), upstream)
    got = _run(chunked, (hidden, weight), upstream)
    assert _rel(got[0], want[0]) < 1e-3  # the same bf16 logits, fp32 log-sum-exp
    for g, r in zip(got[1:], want[1:]):
        assert g.dtype == torch.bfloat16 and _rel(g, r) < TOL[torch.bfloat16]
    assert count_host_syncs(lambda: _run(chunked, (hidden, weight), upstream)) == 0

    # the training loss: the masked sum, its gradients formed in forward (one logits GEMM per chunk)
    mask = (upstream > 0).float()
    scale = torch.tensor(1 / 3000, device="cuda")

    def masked_sum(a, b):
        return fusion.weighted_linear_cross_entropy_sum(a, b, labels, mask, chunk_tokens=1024)

    want = _run(lambda a, b: (plain(a, b) * mask).sum(), (hidden, weight), scale)
    got = _run(masked_sum, (hidden, weight), scale)
    assert got[0].dtype == torch.float32 and _rel(got[0], want[0]) < 1e-3
    for g, r in zip(got[1:], want[1:]):
        assert g.dtype == torch.bfloat16 and _rel(g, r) < TOL[torch.bfloat16]
    assert count_host_syncs(lambda: _run(masked_sum, (hidden, weight), scale)) == 0


def test_fused_swiglu_cuda_bf16():
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    torch.manual_seed(3)
    y = torch.randn(4096, 2 * 12288, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(4096, 12288, device="cuda", dtype=torch.bfloat16)

    def plain(t):
        a, b = torch.chunk(t.float(), 2, dim=-1)
        return (F.silu(a) * b).to(t.dtype)

    want = _run(plain, (y,), grad)
    got = _run(lambda t: bias_swiglu_impl(t, None), (y,), grad)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and _rel(g, r) < TOL[torch.bfloat16]


def test_wgrad_accumulation_fusion_cuda():
    from relax_gdn.compat.wgrad import FUSED_WGRAD_MODULE

    torch.manual_seed(4)
    x = torch.randn(3000, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(3000, 768, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.randn(768, 1024, device="cuda")
    want = main_grad + (g.t() @ x).float()  # the unfused path: bf16 grad, then DDP's fp32 add
    FUSED_WGRAD_MODULE.wgrad_gemm_accum_fp32(x, g, main_grad)
    assert _rel(main_grad, want) < 1e-2


def test_embedding_gradient_into_main_grad_cuda_bf16():
    """A bf16 embedding with Megatron-Core DDP's fp32 main grad: the micro-batch's rows are added
    (repeated ids summed in fp32); no host syncs."""
    from tests.helpers import as_ddp_parameter as _as_ddp_parameter

    torch.manual_seed(5)
    vocab, h, n = 50_000, 1024, 3000
    ids = torch.randint(0, 500, (1, n), device="cuda")  # a small id range: many repeats
    upstream = torch.randn(1, n, h, device="cuda", dtype=torch.bfloat16)
    embedding = (0.05 * torch.randn(vocab, h, device="cuda")).to(torch.bfloat16).requires_grad_()
    _as_ddp_parameter(embedding, 0.5)
    embedding.main_grad = embedding.main_grad.cuda()
    want = torch.zeros(vocab, h, device="cuda", dtype=torch.float64).index_add_(
        0, ids[0], upstream[0].double()
    )

    def embed():
        fusion.embedding_into_main_grad(ids, embedding).backward(upstream)

    embed()
    assert _rel(embedding.main_grad - 0.5, want) < 1e-5 and embedding.grad_added_to_main_grad
    assert count_host_syncs(embed) == 0


def _train_reduced(runtime, **overrides):
    return train_reduced_9b_on_gpu(runtime, **overrides).records


def test_tiny_model_embedding_gradient_through_ddp(runtime):
    """Megatron-Core's DDP and distributed optimizer on one GPU, the tiny model: with the embedding's
    gradient added into its main grad (and the fused wgrad GEMMs) the first step's grad norm and
    the losses after two Adam updates match DDP's own adds (a lost or doubled add shows)."""
    plain = _train_reduced(
        runtime,
        **{
            "model.preset": "qwen3_5_tiny",
            "model.fused_grad_accumulation": False,
            "optim.lr": 1e-3,
            "train.steps": 3,
        },
    )
    fused = _train_reduced(runtime, **{"model.preset": "qwen3_5_tiny", "optim.lr": 1e-3, "train.steps": 3})
    assert fused[0]["grad_norm"] == pytest.approx(plain[0]["grad_norm"], rel=5e-3)
    for got, want in zip(fused, plain):
        assert got["loss"] == pytest.approx(want["loss"], rel=5e-3)
    assert fused[-1]["host_syncs"] == 0


def test_reduced_9b_fused_and_selective_match_plain(runtime):
    plain = _train_reduced(
        runtime,
        **{
            "model.fused_norms": False,
            "model.fused_cross_entropy": False,
            "model.fused_swiglu": False,
            "model.fused_grad_accumulation": False,
        },
    )
    fused = _train_reduced(runtime)
    selective = _train_reduced(runtime, **{"recompute.granularity": "selective"})
    full = _train_reduced(
        runtime, **{"recompute.granularity": "full"}
    )  # skip_unused: last layer kept, fc2 GEMM skipped
    for runs in (fused, selective, full):
        for got, want in zip(runs, plain):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-3)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-2)
        assert runs[-1]["host_syncs"] == 0  # the first step autotunes kernels (Triton may sync there)
