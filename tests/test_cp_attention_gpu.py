"""relax_gdn.model.attention on CUDA: the varlen (flash) kernel, and flex / fa4 where they run,
equal the dense SDPA reference on every rank of simulated CP groups (fwd and bwd, bf16/fp16),
``auto`` picks fa4 where it can run, the reduced 9B trains one step alike with fa4 and varlen,
fp32 falls back to SDPA, the varlen causal mask is bottom-right aligned, no host syncs once the
plan is cached, and (2 GPUs) the module on NCCL equals the single-GPU result."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from tests.distributed import job_runtime, run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (W, global boundaries): every length a multiple of 2W; empty slots; a long document
PACKINGS = [
    (1, [0, 1000, 1000, 1512, 1528, 4096]),
    (2, [0, 2048, 2048, 2052, 2560, 4096]),
    (4, [0, 4096, 4096 + 8, 4096 + 8 + 1024]),
    (8, [0, 16, 16, 3216, 3216 + 880]),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against the reference ``b``."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _case(cu, heads, groups, dim, seed, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = cu[-1]
    q = torch.randn(total, heads, dim, generator=g).to(device)
    k = torch.randn(total, groups, dim, generator=g).to(device)
    v = torch.randn(total, groups, dim, generator=g).to(device)
    grad = torch.randn(total, heads, dim, generator=g).to(device)
    return q, k, v, grad


def _rank_run(q, k, v, grad, cu, w, r, dtype, backend, scale):
    """Rank r's core on hand-gathered K/V: (out, dq, dk_all, dv_all), all in fp32."""
    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model.attention import attend_zigzag_shard, build_zigzag_attention_plan

    ids = thd_rank_indices(cu, w, r, "zigzag").to(q.device)
    gathered = torch.cat([thd_rank_indices(cu, w, j, "zigzag") for j in range(w)]).to(q.device)
    ql = q[ids].to(dtype).requires_grad_(True)
    ka = k[gathered].to(dtype).requires_grad_(True)
    va = v[gathered].to(dtype).requires_grad_(True)
    plan = build_zigzag_attention_plan(cu, w, r, q.device)
    out = attend_zigzag_shard(ql, ka, va, plan, softmax_scale=scale, backend=backend)
    out.backward(grad[ids].to(dtype))
    return [t.float() for t in (out.detach(), ql.grad, ka.grad, va.grad)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,groups,dim", [(4, 4, 64), (8, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("w,cu", PACKINGS)
def test_varlen_equals_sdpa_on_every_rank(w, cu, heads, groups, dim, dtype):
    from relax_gdn.model.attention import varlen_unsupported_reason

    q, k, v, grad = _case(cu, heads, groups, dim, seed=w)
    if (reason := varlen_unsupported_reason(q.to(dtype))) is not None:
        pytest.skip(reason)
    scale = 1 / math.sqrt(dim)
    for r in range(w):
        ref = _rank_run(q, k, v, grad, cu, w, r, torch.float32, "sdpa", scale)
        low = _rank_run(q, k, v, grad, cu, w, r, dtype, "sdpa", scale)  # the dtype's own rounding
        got = _rank_run(q, k, v, grad, cu, w, r, dtype, "varlen", scale)
        for name, g, lo, ref_t in zip(("out", "dq", "dk", "dv"), got, low, ref):
            # the flash kernel must be about as close to fp32 as SDPA in the same dtype is
            bound = max(2.5 * _rel(lo, ref_t), 2e-2 if dtype == torch.bfloat16 else 4e-3)
            assert _rel(g, ref_t) < bound, (w, r, name, _rel(g, ref_t), _rel(lo, ref_t))


# the other kernels on the packings and CP sizes they serve
OTHER_KERNEL_CASES = [
    ("flex", 1, PACKINGS[0][1]),
    ("flex", 2, PACKINGS[1][1]),
    ("flex", 4, PACKINGS[2][1]),
    ("fa4", 1, PACKINGS[0][1]),
    ("fa4", 2, PACKINGS[1][1]),
    ("fa4", 8, PACKINGS[3][1]),
]


@pytest.mark.parametrize("heads,groups,dim", [(8, 2, 128), (16, 4, 256)])
@pytest.mark.parametrize("backend,w,cu", OTHER_KERNEL_CASES)
def test_kernel_equals_sdpa_on_every_rank(backend, w, cu, heads, groups, dim):
    """flex and fa4 (bf16, fwd + bwd, GQA, head dim up to 256) against fp32 SDPA on every rank, as
    close as SDPA in bf16 is; skipped with the reason where a kernel cannot run here."""
    from relax_gdn.model.attention_kernels import unsupported_reason

    q, k, v, grad = _case(cu, heads, groups, dim, seed=w + dim)
    reason = unsupported_reason(backend, q.bfloat16())
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    scale = 1 / math.sqrt(dim)
    for r in range(w):
        ref = _rank_run(q, k, v, grad, cu, w, r, torch.float32, "sdpa", scale)
        low = _rank_run(q, k, v, grad, cu, w, r, torch.bfloat16, "sdpa", scale)
        got = _rank_run(q, k, v, grad, cu, w, r, torch.bfloat16, backend, scale)
        for name, g, lo, ref_t in zip(("out", "dq", "dk", "dv"), got, low, ref):
            bound = max(2.5 * _rel(lo, ref_t), 2e-2)
            assert _rel(g, ref_t) < bound, (backend, w, r, name, _rel(g, ref_t), _rel(lo, ref_t))


@pytest.mark.parametrize("w,cu", PACKINGS[1:3])
def test_fp32_falls_back_to_sdpa_and_matches_cpu(w, cu):
    q, k, v, grad = _case(cu, 4, 2, 64, seed=11)
    for r in range(w):
        gpu = _rank_run(q, k, v, grad, cu, w, r, torch.float32, "auto", 0.125)
        cpu = _rank_run(q.cpu(), k.cpu(), v.cpu(), grad.cpu(), cu, w, r, torch.float32, "sdpa", 0.125)
        for g, c in zip(gpu, cpu):
            torch.testing.assert_close(g.cpu(), c, atol=2e-5, rtol=1e-4)


def test_varlen_refuses_fp32():
    from relax_gdn.model.attention import attend_zigzag_shard, build_zigzag_attention_plan

    q = torch.randn(8, 2, 64, device="cuda")
    plan = build_zigzag_attention_plan([0, 8], 1, 0, "cuda")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        attend_zigzag_shard(q, q, q, plan, softmax_scale=0.1, backend="varlen")


def test_auto_runs_fa4_where_it_can_else_varlen():
    """``auto`` on CUDA: FlashAttention-4 where it can run (it imports, SM 9.x-11.x, bf16/fp16, head
    dim <= 256), else FlashAttention-2 (``varlen``); fp32 and head dims FA4 refuses fall through."""
    from relax_gdn.model.attention_kernels import choose_backend, fa4_import_error, unsupported_reason

    q = torch.randn(8, 4, 256, device="cuda", dtype=torch.bfloat16)
    fa4_here = unsupported_reason("fa4", q) is None
    assert choose_backend("auto", q) == ("fa4" if fa4_here else "varlen"), fa4_import_error()
    assert choose_backend("auto", q.half()) == ("fa4" if fa4_here else "varlen")
    assert choose_backend("auto", q.float()) == "sdpa"  # neither flash kernel takes fp32
    assert choose_backend("auto", torch.randn(8, 4, 320, device="cuda", dtype=torch.bfloat16)) == "sdpa"


def test_varlen_causal_mask_is_bottom_right_aligned():
    """The varlen kernel's contract this module relies on: with fewer queries than keys, the last
    query sees every key (bottom-right), not only the first ones (top-left)."""
    from torch.nn.attention.varlen import varlen_attn

    from relax_gdn.model.attention import varlen_unsupported_reason

    q = torch.randn(2, 1, 64, device="cuda", dtype=torch.bfloat16)
    if (reason := varlen_unsupported_reason(q)) is not None:
        pytest.skip(reason)
    k = torch.randn(5, 1, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(5, 1, 64, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 5], dtype=torch.int32, device="cuda")
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    out = varlen_attn(q, k, v, cu_q, cu_k, 2, 5, **causal)
    out = out[0] if isinstance(out, tuple) else out
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / 8
    visible = torch.ones(2, 5, dtype=torch.bool, device="cuda").tril(3)  # bottom-right
    expect = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -math.inf).softmax(-1), v.float())
    assert _rel(out, expect) < 2e-2


def _module_and_batch(cu, cp_group, dtype, backend="auto"):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from relax_gdn.layout import attach_host_cu_seqlens
    from relax_gdn.model.attention import CPDotProductAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8 * 128,
        num_attention_heads=8,
        num_query_groups=2,
        kv_channels=128,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    module = CPDotProductAttention(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        pg_collection=ProcessGroupCollection(tp=None, cp=cp_group),
        backend=backend,
    )
    t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=t,
        cu_seqlens_kv=t,
        cu_seqlens_q_padded=t,
        cu_seqlens_kv_padded=t,
    )
    attach_host_cu_seqlens(psp, t, cu)
    return module, psp


def _module_step(module, psp, q, k, v, grad):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = module(q, k, v, None, packed_seq_params=psp)
    out.backward(grad.flatten(1))
    return out, q, k, v


def test_module_forward_backward_without_host_syncs():
    """After the first micro-batch step builds the cached plan, a forward + backward on the same
    micro-batch (every other layer, recompute) issues no device->host sync."""
    from relax_gdn.model.attention_kernels import unsupported_reason

    cu = [0, 1000, 1000, 1512, 1528, 4096]
    q, k, v, grad = (x.bfloat16() for x in _case(cu, 8, 2, 128, seed=3))
    ran = []
    for backend in ("varlen", "sdpa", "flex", "fa4"):
        if unsupported_reason(backend, q) is not None:
            continue
        ran.append(backend)
        module, psp = _module_and_batch(cu, None, torch.bfloat16, backend)
        _module_step(module, psp, q, k, v, grad)  # builds the plan
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, *_ = _module_step(module, psp, q, k, v, grad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert out.shape == (cu[-1], 8 * 128)
    assert ran[:2] == ["varlen", "sdpa"], ran


def _nccl_cases():
    import torch.distributed as dist

    from relax_gdn.layout import thd_rank_indices

    rank, world = dist.get_rank(), dist.group.WORLD
    results = []
    for cu in ([0, 4096], [0, 1000, 1000, 1512, 1528, 4096]):
        q, k, v, grad = (x.bfloat16() for x in _case(cu, 8, 2, 128, seed=5))
        ids = thd_rank_indices(cu, 2, rank, "zigzag").cuda()
        ref_module, ref_psp = _module_and_batch(cu, None, torch.float32, "sdpa")
        ref = _module_step(ref_module, ref_psp, q.float(), k.float(), v.float(), grad.float())
        one_module, one_psp = _module_and_batch(cu, None, torch.bfloat16)  # one GPU, same dtype
        one = _module_step(one_module, one_psp, q, k, v, grad)
        module, psp = _module_and_batch(cu, world, torch.bfloat16)
        _module_step(module, psp, q[ids], k[ids], v[ids], grad[ids])  # builds the plan
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = _module_step(module, psp, q[ids], k[ids], v[ids], grad[ids])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for i, (g, o, r) in enumerate(zip(got, one, ref)):
            g, o, r = (t if i == 0 else t.grad for t in (g, o, r))
            # CP in bf16 must be about as close to fp32 as one GPU in bf16 is
            results.append((_rel(g, r[ids]), max(2.5 * _rel(o[ids], r[ids]), 1e-2)))
    return results


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_module_on_nccl_equals_single_gpu():
    for rank_results in run_distributed(_nccl_cases, 2, backend="nccl"):
        for err, bound in rank_results:
            assert err < bound, rank_results


# bf16, relative, one step of the reduced 9B from the same weights and batches: the kernels differ
# in summation order only (the same bounds as dynamic against static CP, tests/test_train_gpu.py)
FA4_LOSS_TOL, FA4_GRAD_NORM_TOL = 1e-3, 1e-2


def _reduced_9b_first_step(backend: str) -> dict:
    from relax_gdn.config import RunConfig
    from relax_gdn.train import run_training

    cfg = RunConfig().with_overrides(
        {
            "model.preset": "qwen3_5_9b_reduced",
            "model.attention_backend": backend,
            "train.device": "cuda",
            "train.precision": "bf16",
            "train.steps": 1,
            "train.global_batch_size": 8,
            "train.max_tokens_per_gpu": 8192,
            "data.max_sample_tokens": 8192,
            "data.num_samples": 64,
            "optim.warmup_steps": 1,
            "optim.lr": 1e-5,
            "optim.min_lr": 1e-6,
            "logging.console": False,
            "logging.jsonl": False,
        }
    )
    return run_training(cfg, None, runtime=job_runtime()).records[0]


def _fa4_and_varlen_steps() -> dict:
    return {backend: _reduced_9b_first_step(backend) for backend in ("varlen", "fa4")}


def test_reduced_9b_step_with_fa4_matches_varlen():
    """The whole model, not only the kernel: one training step of the reduced 9B (one 3:1 block at
    full width, head dim 256, CP 1, bf16, Adam) with ``model.attention_backend=fa4`` against
    ``varlen`` from the same weights and batches: the step's loss (the forward) and gradient norm
    (the backward) agree within bf16 summation-order differences."""
    from relax_gdn.model.attention_kernels import unsupported_reason

    reason = unsupported_reason("fa4", torch.empty(1, 16, 256, device="cuda", dtype=torch.bfloat16))
    if reason is not None:
        pytest.skip(f"fa4: {reason}")
    (steps,) = run_distributed(_fa4_and_varlen_steps, 1, backend="nccl")
    varlen, fa4 = steps["varlen"], steps["fa4"]
    assert fa4["tokens"] == varlen["tokens"] and fa4["loss_tokens"] == varlen["loss_tokens"]
    assert math.isfinite(fa4["loss"]) and math.isfinite(fa4["grad_norm"])
    assert abs(fa4["loss"] - varlen["loss"]) <= FA4_LOSS_TOL * abs(varlen["loss"]), (
        fa4["loss"],
        varlen["loss"],
    )
    assert abs(fa4["grad_norm"] - varlen["grad_norm"]) <= FA4_GRAD_NORM_TOL * varlen["grad_norm"], (
        fa4["grad_norm"],
        varlen["grad_norm"],
    )
