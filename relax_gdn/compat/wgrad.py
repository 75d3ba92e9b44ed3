"""Megatron-Core's gradient-accumulation fusion without apex, on CUDA.

With ``gradient_accumulation_fusion`` Megatron-Core's linear layers accumulate each weight
gradient straight into the fp32 ``main_grad`` buffer inside the wgrad GEMM (apex's
``fused_weight_gradient_mlp_cuda``); without it every linear writes a bf16 ``param.grad`` that
DDP's hook then adds into ``main_grad``: 10 bytes of memory traffic per parameter and
micro-batch, the largest elementwise kernel in a profiled step of the 9B (docs/benchmarks.md,
"Fused gradient accumulation, end to end").
``torch.addmm(main_grad, g.T, x, out_dtype=float32, out=main_grad)`` is that same fused GEMM
(cuBLAS, bf16 operands, fp32 accumulate into C), so this module supplies it under apex's name.
``enable_wgrad_accumulation_fusion`` checks it against the unfused product on the current GPU
first and leaves the fusion off where the installed torch lacks it; the undo it returns goes to
the :class:`relax_gdn.runtime.Runtime`, which takes the GEMM back when it closes.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def _wgrad_gemm_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_outputᵀ @ total_input`` with ``main_grad``'s dtype as the output dtype."""
    torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)


FUSED_WGRAD_MODULE = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=_wgrad_gemm_accum, wgrad_gemm_accum_fp16=_wgrad_gemm_accum
)


def _works_here() -> bool:
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(64, 48, device="cuda", generator=gen).to(torch.bfloat16)
        g = torch.randn(64, 32, device="cuda", generator=gen).to(torch.bfloat16)
        acc = torch.randn(32, 48, device="cuda", generator=gen)
        want = acc + g.float().t() @ x.float()
        _wgrad_gemm_accum(x, g, acc)
        return bool(torch.allclose(acc, want, rtol=1e-3, atol=1e-3))  # once at start: one sync
    except (RuntimeError, TypeError) as e:
        logger.warning(
            "gradient accumulation fusion unavailable (torch.addmm out_dtype: %s); using DDP's adds", e
        )
        return False


def enable_wgrad_accumulation_fusion() -> tuple[bool, Callable[[], None] | None]:
    """Give Megatron-Core's linear layers the fused wgrad GEMM (before the model is built), a
    process-wide change of Megatron-Core's module: returns (on, undo), ``undo`` taking it back
    (None when nothing was changed: apex's kernel is there, or the fusion is unavailable). The
    caller hands ``undo`` to the Runtime and sets ``gradient_accumulation_fusion=on`` in the config."""
    from megatron.core.tensor_parallel import layers

    assert hasattr(layers, "_grad_accum_fusion_available"), "Megatron-Core moved its wgrad fusion switch"
    if layers._grad_accum_fusion_available:  # apex is installed: its kernel stays
        return True, None
    if not torch.cuda.is_available() or not _works_here():
        return False, None
    missing = object()
    before = getattr(layers, "fused_weight_gradient_mlp_cuda", missing)
    layers.fused_weight_gradient_mlp_cuda = FUSED_WGRAD_MODULE
    layers._grad_accum_fusion_available = True

    def undo() -> None:
        layers._grad_accum_fusion_available = False
        if before is missing:
            del layers.fused_weight_gradient_mlp_cuda
        else:
            layers.fused_weight_gradient_mlp_cuda = before

    return True, undo


__all__ = ["enable_wgrad_accumulation_fusion"]
