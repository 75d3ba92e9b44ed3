"""Fused forms of the model's memory-bound pieces, each behind one switch for A/B.

* ``norms`` (``model.fused_norms``): the zero-centred RMSNorm ``x̂ · (1 + w)`` and the plain one as
  ONE ``torch.nn.functional.rms_norm`` call (one kernel forward, one backward on CUDA) instead of
  the fp32 pow/mean/rsqrt/mul chain; the GDN output's gated norm ``rmsnorm(o) · w · silu(z)`` as
  FLA's Triton ``rms_norm_gated`` (CUDA only; elsewhere the plain formula).
* ``cross_entropy`` (``model.fused_cross_entropy``): the output layer and the cross-entropy over
  the vocabulary (248,320 for Qwen3.5) in token chunks: the fp32 logits of the whole micro-batch
  (≈ 8 GB at 8k tokens, plus the softmax saved for backward) are never materialised. Given the
  loss mask (what training passes), the model returns the masked loss sum and each chunk's
  logits are formed once, the gradients with them (:func:`weighted_linear_cross_entropy_sum`);
  without it, per-token losses as before, each chunk's logits formed again in backward
  (:func:`linear_cross_entropy`). Tensor parallelism > 1 (vocabulary split over TP) keeps
  Megatron-Core's vocab-parallel path.
* ``embedding_grad_into_main_grad`` (``model.fused_grad_accumulation``, with Megatron-Core's fused
  wgrad GEMMs of the linear layers): at TP 1 the embedding adds its micro-batch's gradient rows
  straight into Megatron-Core DDP's fp32 ``main_grad`` (``index_put_`` with ``accumulate``: sorted,
  deterministic; the protocol of its fused linears, ``grad_added_to_main_grad``). The plain path
  zero-fills a dense bf16 gradient of all 248k rows, scatters into it, and DDP's hook then adds
  all of it: memory traffic over the whole vocabulary for the few thousand rows a micro-batch
  touches (docs/benchmarks.md, "The embedding's gradient into the main grad").

Numerics against the plain path (tests/test_fusion.py, tests/test_fusion_gpu.py): fp32 equal to
rounding (rel. 1e-5); bf16 within bf16 rounding (rel. 2e-2 of the output norm), because the fused
norm multiplies by ``1 + w`` rounded to the activation dtype (the plain path keeps it fp32) and the
chunked cross-entropy accumulates the output layer's weight gradient in the weight's dtype chunk by
chunk.

SwiGLU (``model.fused_swiglu``) is Megatron-Core's own fused form (``bias_activation_fusion``: a
compiled ``SwiGLUFunction`` that saves only its input), switched on CUDA by the training loop;
FLA's ``swiglu`` is not used: it was no faster than the plain form (docs/benchmarks.md, "Figures
behind code comments").

The setting travels with the model, like the GDN options: the training loop builds the model with
``Fusion(norms=model.fused_norms, cross_entropy=model.fused_cross_entropy,
embedding_grad_into_main_grad=model.fused_grad_accumulation)`` and every norm, the embedding and the
model keep it. An A/B builds one model per setting; nothing process-wide decides it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fusion:
    """Which fused forms a model runs, fixed when it is built (passed builder -> spec -> module).

    Args:
        norms: the RMSNorms as one ``F.rms_norm`` call, the GDN gated norm as FLA's kernel on
            CUDA (``model.fused_norms``).
        cross_entropy: the output layer and the loss in token chunks, no full-vocabulary logits
            (``model.fused_cross_entropy``; TP 1).
        embedding_grad_into_main_grad: at TP 1 the embedding adds its gradient rows straight into
            Megatron-Core DDP's fp32 ``main_grad`` (``model.fused_grad_accumulation``).
    """

    norms: bool = True
    cross_entropy: bool = True
    embedding_grad_into_main_grad: bool = True


# ---------------------------------------------------------------------------------------------
# norms
# ---------------------------------------------------------------------------------------------


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """``x / rms(x) · (1 + w)`` (or ``· w``) as one ``F.rms_norm`` call. Its fused CUDA kernel needs
    the scale in the input's dtype (a mixed-dtype call falls back to the composite), so ``1 + w``
    is formed in fp32 (fp64 for an fp64 weight) and rounded once to ``x.dtype``."""
    scale = weight.to(torch.promote_types(weight.dtype, torch.float32)) + 1.0 if zero_centered else weight
    return F.rms_norm(x, (x.shape[-1],), scale.to(x.dtype), eps)


def gated_rms_norm_applies(x: torch.Tensor, fusion: Fusion) -> bool:
    """Whether :func:`fused_gated_rms_norm` runs for ``x`` in a module built with ``fusion`` (CUDA,
    fused norms on)."""
    return fusion.norms and x.is_cuda


def fused_gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``rmsnorm(x) · w · silu(gate)`` over the last dimension in one Triton kernel per direction
    (FLA's ``rms_norm_gated``); ``x``, ``gate`` ``[N, D]``; output in ``x.dtype``."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(x.contiguous(), gate.contiguous(), weight, None, activation="swish", eps=eps)


# ---------------------------------------------------------------------------------------------
# weight gradients straight into Megatron-Core's main grads
# ---------------------------------------------------------------------------------------------


def takes_main_grad(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a parameter of a Megatron-Core DDP model (an fp32 ``main_grad`` whose
    hook honours ``grad_added_to_main_grad``): its gradient can be added there directly."""
    return getattr(weight, "main_grad", None) is not None and hasattr(weight, "grad_added_to_main_grad")


def main_grad_is_empty(weight: torch.Tensor) -> bool:
    """Whether ``weight.main_grad`` holds no gradient of this step yet, so a weight gradient may be
    written there instead of added: Megatron-Core DDP's ``zero_grad_buffer`` zeroes the buffers and
    clears ``grad_added_to_main_grad`` at each step's start, and every path that adds into
    ``main_grad`` during the step sets it (:func:`handed_to_main_grad`). A parameter whose gradient
    reaches ``main_grad`` through DDP's hook instead (no fused path) never takes this branch: its
    layers pass no ``main_grad``. No device value is read (no host sync)."""
    return takes_main_grad(weight) and weight.grad_added_to_main_grad is False


def handed_to_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """Mark ``weight``'s gradient as added to ``main_grad`` and return what autograd gets instead,
    as Megatron-Core's fused linears do: an uninitialised tensor of the weight's shape, which DDP's
    hook neither reads nor keeps (None would skip the hook, which DDP's bookkeeping counts on);
    zeros where the parameter asks for them (``zero_out_wgrad``: the hook then adds it)."""
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight, memory_format=torch.contiguous_format)
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward adds the micro-batch's gradient rows into
    ``weight.main_grad`` (fp32), summing repeated ids in sorted order (``index_put_`` with
    ``accumulate``: deterministic), instead of forming the dense vocabulary x hidden gradient."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight  # the Parameter itself: its main_grad is what backward writes
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        del ctx.weight
        main_grad = weight.main_grad
        main_grad.index_put_(
            (ids.reshape(-1),), grad.reshape(-1, grad.shape[-1]).to(main_grad.dtype), accumulate=True
        )
        return None, handed_to_main_grad(weight)


def embedding_into_main_grad(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)`` with its weight gradient added to ``weight.main_grad`` (a
    Megatron-Core DDP parameter, :func:`takes_main_grad`; see :class:`_EmbeddingIntoMainGrad`)."""
    return _EmbeddingIntoMainGrad.apply(ids, weight)


# ---------------------------------------------------------------------------------------------
# output layer + cross-entropy
# ---------------------------------------------------------------------------------------------

_LOGITS_CHUNK_BYTES = 2**31  # fp32 logits of one chunk: 2 GiB (2048 tokens at 248,320 words)


def cross_entropy_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk: as many as keep one chunk's fp32 logits within 2 GiB, a multiple of 256."""
    tokens = _LOGITS_CHUNK_BYTES // (4 * vocab_size)
    return max(256, tokens // 256 * 256)


def _chunk_lse(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-sum-exp of each row of one chunk's (bf16) logits."""
    return torch.logsumexp(logits.float(), dim=-1)


def _chunk_grad(
    logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, grad_loss: torch.Tensor
) -> torch.Tensor:
    """``(softmax(logits) - onehot(labels)) · grad_loss`` per row, in the logits' dtype."""
    probs = (logits.float() - lse[:, None]).exp()
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None, :] == labels[:, None]
    return ((probs - onehot.float()) * grad_loss[:, None]).to(logits.dtype)


def _chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """One chunk's ``Σ weight · cross-entropy`` (fp32) and its gradient with respect to the
    logits, ``(softmax - onehot) · weight`` per row, in the logits' dtype."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    onehot = torch.arange(x.shape[-1], device=x.device)[None, :] == labels[:, None]
    picked = torch.where(onehot, x, 0.0).sum(dim=-1)
    grad = ((x - lse[:, None]).exp() - onehot.float()) * weights[:, None]
    return ((lse - picked) * weights).sum(), grad.to(logits.dtype)


class ChunkKernels:
    """The element-wise functions of one model's chunked loss, each compiled into one fused kernel
    per chunk on CUDA (one pass over the chunk's logits instead of several eager fp32 ones) on first
    use, or eager for good once compiling it failed (logged once). The fallback belongs to the model
    that owns this object (:class:`~relax_gdn.model.qwen3_5.Qwen3_5Model`): another model in the
    process keeps its compiled forms. Running out of memory is no failed compile: it propagates and
    the compiled form stays. Else one micro-batch too large for the GPU would switch every later step
    to the eager path, whose fp32 temporaries hold several more copies of the chunk's logits at once
    (docs/benchmarks.md, "Figures behind code comments")."""

    def __init__(self) -> None:
        self._forms: dict = {}  # fn -> its compiled form, or fn itself once compiling it failed

    def compiled(self, fn) -> bool:
        """Whether ``fn`` runs (or will run, before its first call) through a compiled form."""
        return self._forms.get(fn) is not fn

    def __call__(self, fn, *args):
        """``fn(*args)``: compiled on CUDA tensors, eager elsewhere."""
        if not args[0].is_cuda:
            return fn(*args)
        return self.call_compiled(fn, *args)

    def call_compiled(self, fn, *args):
        """``fn(*args)`` through its compiled form (made on first use), or eager once compiling failed."""
        compiled = self._forms.get(fn)
        if compiled is None:
            compiled = self._forms[fn] = torch.compile(fn, dynamic=True)
        if compiled is fn:
            return fn(*args)
        try:
            return compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - a torch without a working inductor still trains
            logger.warning(
                "torch.compile failed for the chunked cross-entropy (%s: %s); running it eager, "
                "with several fp32 copies of each chunk's logits more than the memory model counts",
                type(e).__name__,
                e,
            )
            self._forms[fn] = fn
            return fn(*args)


def _chunk_token_loss(
    kernels: ChunkKernels, logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's fp32 log-sum-exp per row and per-token cross-entropy ``lse - logit[label]``."""
    lse = kernels(_chunk_lse, logits)
    return lse, lse - logits.gather(1, labels[:, None]).squeeze(1).float()


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token ``logsumexp(h Wᵀ) - (h Wᵀ)[label]`` in token chunks. Forward keeps only the
    per-token log-sum-exp; backward recomputes each chunk's logits (one GEMM more than the plain
    path) because the per-token upstream gradient (loss mask / loss tokens) is known only then.
    The element-wise work on a chunk is one compiled kernel each way. No host syncs."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, kernels: ChunkKernels):
        n = hidden.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(loss)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = hidden[start:end] @ weight.t()
            lse[start:end], loss[start:end] = _chunk_token_loss(kernels, logits, labels[start:end])
            del logits
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.kernels = chunk, kernels
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        grad_loss = grad_loss.float()
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end]
            logits = h @ weight.t()
            grad_logits = ctx.kernels(
                _chunk_grad, logits, lse[start:end], labels[start:end], grad_loss[start:end]
            )
            del logits
            if want_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if want_weight:
                grad_weight.addmm_(grad_logits.t(), h)
        return grad_hidden, grad_weight, None, None, None


class _WeightedLinearCrossEntropySum(torch.autograd.Function):
    """``Σ weight · (logsumexp(h Wᵀ) - (h Wᵀ)[label])`` over the tokens (an fp32 scalar) in token
    chunks, with the gradients formed in forward while each chunk's logits exist: the output is a
    scalar, so its upstream gradient is one number and backward only scales them. One logits GEMM
    per chunk instead of the two of :class:`_LinearCrossEntropy` (forward, then again in
    backward); in exchange the output layer's weight gradient is held from forward to backward.
    No host syncs."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        labels,
        weights,
        chunk: int,
        want_hidden: bool,
        want_weight: bool,
        kernels: ChunkKernels,
    ):
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        weights = weights.float()
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h = hidden[start:end]
            logits = h @ weight.t()
            if not (want_hidden or want_weight):
                total += (_chunk_token_loss(kernels, logits, labels[start:end])[1] * weights[start:end]).sum()
                continue
            loss_sum, grad_logits = kernels(
                _chunk_loss_and_grad, logits, labels[start:end], weights[start:end]
            )
            total += loss_sum
            del logits
            if want_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if want_weight:
                grad_weight.addmm_(grad_logits.t(), h)
        ctx.grads = (grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.grads
        del ctx.grads
        scale = grad_total.to(grad_hidden.dtype if grad_hidden is not None else grad_weight.dtype)
        if grad_hidden is not None:
            grad_hidden.mul_(scale)
        if grad_weight is not None:
            grad_weight.mul_(scale)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def weighted_linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor,
    chunk_tokens: int | None = None,
    kernels: ChunkKernels | None = None,
) -> torch.Tensor:
    """``Σ token_weights · cross-entropy`` of ``hidden [N, H] @ weight [V, H]ᵀ`` against ``labels [N]``
    (an fp32 scalar: the loop's masked loss sum), never holding more than one chunk's logits and
    forming each chunk's logits once (:class:`_WeightedLinearCrossEntropySum`). Same value as
    ``(F.cross_entropy((hidden @ weight.T).float(), labels, reduction="none") * token_weights).sum()``.
    ``kernels``: the model's compiled chunk functions (:class:`ChunkKernels`; None: this call's own)."""
    chunk = chunk_tokens or cross_entropy_chunk_tokens(weight.shape[0])
    grad = torch.is_grad_enabled()
    return _WeightedLinearCrossEntropySum.apply(
        hidden,
        weight,
        labels.long(),
        token_weights,
        chunk,
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        kernels or ChunkKernels(),
    )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
    kernels: ChunkKernels | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden [N, H] @ weight [V, H]ᵀ`` against ``labels [N]`` (fp32
    ``[N]``), never holding more than one chunk's logits. Same value as
    ``F.cross_entropy((hidden @ weight.T).float(), labels, reduction="none")``. ``kernels``: as for
    :func:`weighted_linear_cross_entropy_sum`."""
    chunk = chunk_tokens or cross_entropy_chunk_tokens(weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, labels.long(), chunk, kernels or ChunkKernels())


def fused_output_loss(
    *,
    hidden_states,
    output_layer,
    output_weight,
    labels,
    loss_mask=None,
    kernels: ChunkKernels | None = None,
    **unused,
) -> torch.Tensor:
    """A Megatron-Core ``GPTModel`` ``output_processor``: the output layer and the loss in one
    chunked pass (``hidden_states [s, b, h]``, ``labels [b, s]``). Returns ``Σ loss · loss_mask``
    (an fp32 scalar, :func:`weighted_linear_cross_entropy_sum`) when given ``loss_mask [b, s]``,
    else the per-token loss ``[b, s]`` like ``compute_language_model_loss``. ``kernels``: the
    model's compiled chunk functions (:class:`ChunkKernels`)."""
    weight = output_weight if output_weight is not None else output_layer.weight
    s, b, h = hidden_states.shape
    hidden, flat_labels = hidden_states.reshape(s * b, h), labels.t().reshape(s * b)
    if loss_mask is not None:
        return weighted_linear_cross_entropy_sum(
            hidden, weight, flat_labels, loss_mask.t().reshape(s * b), kernels=kernels
        )
    loss = linear_cross_entropy(hidden, weight, flat_labels, kernels=kernels)
    return loss.view(s, b).t()


__all__ = [
    "ChunkKernels",
    "Fusion",
    "cross_entropy_chunk_tokens",
    "embedding_into_main_grad",
    "fused_gated_rms_norm",
    "fused_output_loss",
    "fused_rms_norm",
    "gated_rms_norm_applies",
    "handed_to_main_grad",
    "linear_cross_entropy",
    "takes_main_grad",
    "weighted_linear_cross_entropy_sum",
]
