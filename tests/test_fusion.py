"""The fused paths of relax_gdn.model.fusion against the plain formulas on CPU (forward and
gradients): torch's rms_norm (fp32 and bf16), the chunked output layer + cross-entropy (fp32,
chunks smaller than the micro-batch, any upstream gradient), the embedding's gradient added
straight into a Megatron-Core-style main grad (alone and inside the tiny model), and the whole
tiny model trained with fusion on and off. Tolerances (relative to the reference's norm): fp32 1e-5; bf16 2e-2 (the
fused norm rounds 1 + w to bf16 once, the plain path keeps it fp32)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from relax_gdn.model import fusion
from tests.helpers import as_ddp_parameter as _as_ddp_parameter
from tests.helpers import plain_rms_norm as _plain_rms_norm
from tests.helpers import relative_error as _rel
from tests.helpers import train_records_in_this_process as _train

FP32_TOL, BF16_TOL = 1e-5, 2e-2


@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_fused_rms_norm_matches_plain(zero_centered, dtype, tol):
    torch.manual_seed(0)
    x = (3 * torch.randn(37, 96)).to(dtype)
    w = (0.2 * torch.randn(96) + (0.0 if zero_centered else 1.0)).to(dtype)
    grad = torch.randn(37, 96).to(dtype)
    results = []
    for fn in (_plain_rms_norm, fusion.fused_rms_norm):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xi, wi, 1e-6, zero_centered)
        out.backward(grad)
        results.append((out, xi.grad, wi.grad))
    for got, want in zip(results[1], results[0]):
        assert got.dtype == want.dtype
        assert _rel(got, want) < tol


@pytest.mark.parametrize("chunk", [7, 64, None])
def test_linear_cross_entropy_matches_full_logits(chunk):
    torch.manual_seed(1)
    n, h, vocab = 20, 16, 50
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, h)).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    upstream = torch.rand(n) * (torch.rand(n) > 0.3)  # a loss mask over a token count

    want = F.cross_entropy(hidden @ weight.t(), labels, reduction="none")
    want_grads = torch.autograd.grad(want, (hidden, weight), upstream)
    got = fusion.linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    got_grads = torch.autograd.grad(got, (hidden, weight), upstream)
    assert got.shape == (n,) and got.dtype == torch.float32
    assert _rel(got, want) < FP32_TOL
    for g, w in zip(got_grads, want_grads):
        assert _rel(g, w) < FP32_TOL


@pytest.mark.parametrize("chunk", [7, 64, None])
def test_weighted_linear_cross_entropy_sum_matches_full_logits(chunk):
    """The training loss (masked sum, gradients formed in forward): value and gradients of the
    plain masked sum, scaled by an upstream factor; without grad mode it forms no gradients."""
    torch.manual_seed(1)
    n, h, vocab = 20, 16, 50
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, h)).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    mask = (torch.rand(n) > 0.3).float()
    upstream = torch.tensor(0.37)  # e.g. 1 / loss tokens of the global batch

    want = (F.cross_entropy(hidden @ weight.t(), labels, reduction="none") * mask).sum()
    want_grads = torch.autograd.grad(want, (hidden, weight), upstream)
    got = fusion.weighted_linear_cross_entropy_sum(hidden, weight, labels, mask, chunk_tokens=chunk)
    got_grads = torch.autograd.grad(got, (hidden, weight), upstream)
    assert got.shape == () and got.dtype == torch.float32
    assert _rel(got, want) < FP32_TOL
    for g, w in zip(got_grads, want_grads):
        assert _rel(g, w) < FP32_TOL
    with torch.no_grad():
        assert (
            _rel(
                fusion.weighted_linear_cross_entropy_sum(hidden, weight, labels, mask, chunk_tokens=chunk),
                want,
            )
            < FP32_TOL
        )


def test_out_of_memory_in_the_compiled_loss_is_no_failed_compile():
    """A chunk's compiled kernel that runs out of memory raises that error and stays compiled: the
    eager fallback (for a torch whose compiler fails) holds several fp32 copies of the chunk's logits
    at once, so falling back on an out-of-memory error would make every later step use more."""
    kernels = fusion.ChunkKernels()
    calls = []

    def chunk_kernel(logits):
        calls.append(logits.shape)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 972.00 MiB.")

    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 972.00 MiB"):
            kernels.call_compiled(chunk_kernel, torch.ones(4, 8))
        assert kernels.compiled(chunk_kernel)  # still the compiled form
    assert len(calls) >= 2


def test_a_failed_compile_turns_eager_for_its_model_only(caplog):
    """A compiled chunk kernel that fails (as a torch whose compiler is broken does) runs eager from
    then on, said once, in the model whose kernels it is; another model of the process keeps its
    compiled form (no process-wide switch)."""
    first, second = fusion.ChunkKernels(), fusion.ChunkKernels()
    calls = []

    def chunk_kernel(logits):
        calls.append(logits.shape)
        if len(calls) == 1:  # the compiled form's run fails; the eager one works
            raise RuntimeError("inductor: no working C++ compiler")
        return logits * 2

    with caplog.at_level(logging.WARNING, logger=fusion.logger.name):
        assert torch.equal(first.call_compiled(chunk_kernel, torch.ones(4, 8)), torch.full((4, 8), 2.0))
        assert torch.equal(first.call_compiled(chunk_kernel, torch.ones(4, 8)), torch.full((4, 8), 2.0))
    assert not first.compiled(chunk_kernel) and second.compiled(chunk_kernel)
    assert [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()] == [
        "torch.compile failed for the chunked cross-entropy (RuntimeError: inductor: no working C++ compiler); "
        "running it eager, with several fp32 copies of each chunk's logits more than the memory model counts"
    ]


def test_chunk_tokens_bound_the_logits():
    chunk = fusion.cross_entropy_chunk_tokens(248_320)
    assert chunk % 256 == 0 and chunk * 248_320 * 4 <= 2**31
    assert fusion.cross_entropy_chunk_tokens(10**9) == 256  # never below one block of tokens


def test_fusion_is_fixed_when_a_module_is_built():
    """A Fusion cannot change after a module holds it, and nothing process-wide stands in for it."""
    import dataclasses

    setting = fusion.Fusion(cross_entropy=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setting.norms = False
    assert setting == fusion.Fusion(norms=True, cross_entropy=False, embedding_grad_into_main_grad=True)
    assert not [
        n for n in dir(fusion) if n in ("_active", "active_fusion", "fusion_in_effect", "fusion_set_to")
    ]


def test_a_module_built_with_a_setting_keeps_it(monkeypatch):
    """Two norms built with different Fusions, called interleaved, each run their own form; a norm
    built without one runs the default (fused)."""
    from megatron.core.transformer import TransformerConfig

    from relax_gdn.model import norms
    from relax_gdn.model.norms import RMSNorm

    fused_calls = []
    real = norms.fused_rms_norm
    monkeypatch.setattr(norms, "fused_rms_norm", lambda *args: fused_calls.append(1) or real(*args))
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        normalization="RMSNorm",
        use_cpu_initialization=True,
    )
    own = RMSNorm(config, 8, fusion=fusion.Fusion(norms=False))
    default = RMSNorm(config, 8)
    assert default.fusion == fusion.Fusion()
    x = torch.randn(3, 8)
    own(x)
    assert fused_calls == []
    default(x)
    own(x)
    default(x)
    assert len(fused_calls) == 2


@pytest.mark.slow  # trains the tiny model (in this process)
def test_tiny_model_trains_the_same_with_fusion_on_and_off(runtime):
    """Loss of both steps (the second after an update) and the grad norms agree: the fused norms
    and the chunked loss compute the plain path's function and gradients inside the real model."""
    fused = _train(runtime, **{"model.fused_norms": True, "model.fused_cross_entropy": True})
    plain = _train(runtime, **{"model.fused_norms": False, "model.fused_cross_entropy": False})
    for f, p in zip(fused, plain):
        assert f["loss"] == pytest.approx(p["loss"], rel=FP32_TOL)
        assert f["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-4)


# ---------------------------------------------------------------------------------------------
# the embedding's gradient straight into Megatron-Core's main grad
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_adds_its_rows_into_main_grad(dtype):
    """Repeated ids sum; the rows no id touches stay as they were; the weight is marked as
    handed over and autograd gets a tensor of its shape (which DDP's hook drops)."""
    torch.manual_seed(2)
    vocab, h = 30, 8
    weight = _as_ddp_parameter(torch.randn(vocab, h, dtype=dtype).requires_grad_(), 0.5)
    ids = torch.tensor([[3, 7, 3, 29, 3, 0]])
    upstream = torch.randn(1, 6, h, dtype=dtype)
    want = torch.zeros(vocab, h, dtype=torch.float64).index_add_(0, ids[0], upstream[0].double())

    out = fusion.embedding_into_main_grad(ids, weight)
    assert torch.equal(out, F.embedding(ids, weight))
    out.backward(upstream)
    assert _rel(weight.main_grad - 0.5, want) < FP32_TOL  # summed in fp32, no bf16 rounding of the sum
    untouched = torch.ones(vocab, dtype=torch.bool)
    untouched[ids[0]] = False
    assert torch.equal(weight.main_grad[untouched], torch.full((int(untouched.sum()), h), 0.5))
    assert weight.grad_added_to_main_grad and weight.grad.shape == weight.shape


def _tiny_model_embedding_grad():
    import torch.distributed as dist

    from relax_gdn.model import qwen3_5_config, qwen3_5_preset
    from tests.gdn_harness import packed_params
    from tests.model_harness import CU
    from tests.model_harness import batch as _batch
    from tests.model_harness import build as _build

    torch.set_num_threads(1)
    single = dist.new_group([0])
    torch.manual_seed(0)
    model = _build(qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True), single, single, single)
    tokens, labels, positions = _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size)
    mask = (torch.arange(tokens.shape[1]) % 3 != 0).float()[None]  # some tokens carry no loss
    embedding, output = "embedding.word_embeddings.weight", "output_layer.weight"
    params = dict(model.named_parameters())
    plain_model = _build(
        qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True),
        single,
        single,
        single,
        fusion=fusion.Fusion(embedding_grad_into_main_grad=False),
    )
    plain_model.load_state_dict(model.state_dict())
    plain_params = dict(plain_model.named_parameters())
    for name in (embedding, output):
        _as_ddp_parameter(plain_params[name], 0.25)

    def run(model):
        params = dict(model.named_parameters())
        loss = model(
            tokens, positions, None, labels=labels, loss_mask=mask, packed_seq_params=packed_params(CU, "cpu")
        )
        (loss / 7.0).backward()  # the loop's 1 / loss tokens
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    for name in (embedding, output):  # what Megatron-Core's DDP gives its parameters
        _as_ddp_parameter(params[name], 0.25)
    fused_loss, fused = run(model)
    plain_loss, plain = run(plain_model)  # built to keep its gradient: main_grad stays untouched
    plain_untouched = all(bool((plain_params[n].main_grad == 0.25).all()) for n in (embedding, output))
    return {
        "embedding_class": type(model.embedding.word_embeddings).__name__,
        "loss_equal": torch.equal(fused_loss, plain_loss),
        "embedding": _rel(params[embedding].main_grad - 0.25, plain[embedding]),
        "handed_over": params[embedding].grad_added_to_main_grad,
        # the output layer keeps its own gradient (DDP's hook adds it): main_grad untouched here
        "output_untouched": bool((params[output].main_grad == 0.25).all())
        and not params[output].grad_added_to_main_grad,
        "others_equal": all(torch.equal(fused[n], plain[n]) for n in params if n != embedding),
        "plain_untouched": plain_untouched and not plain_params[embedding].grad_added_to_main_grad,
        "repeated_ids": int(tokens.numel() - tokens.unique().numel()),
    }


def test_tiny_model_embedding_gradient_lands_in_main_grad(gloo):
    """Inside the real model (TP 1): the embedding's gradient is added to its main grad and equals
    the plain path's; every other gradient and the loss are bit-identical."""
    (result,) = gloo(_tiny_model_embedding_grad, 1)
    assert result["embedding_class"] == "_VocabEmbeddingIntoMainGrad"
    assert result["repeated_ids"] > 0  # the batch repeats ids: their rows must sum
    assert (
        result["loss_equal"]
        and result["others_equal"]
        and result["handed_over"]
        and result["output_untouched"]
    )
    assert result["plain_untouched"]  # the model built without the fusion keeps its own gradient
    assert result["embedding"] < FP32_TOL
