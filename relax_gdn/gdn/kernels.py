"""Kernel backends for the GDN core: FLA's Triton kernels on CUDA, the pure-torch reference on CPU.

Both take the same :class:`ScanRows` description of the rows they get, so the layer is written
once. ``ScanRows.cp_group`` set means "these rows are this rank's CONTIGUOUS slice of the packed
batch described by the GLOBAL boundaries": the conv halo and the recurrent state then cross
rank boundaries (FLA's CP context on GPU, differentiable collectives in the reference).
``ScanRows.cp_layout="zigzag"`` (FLA only, ``GDNOptions.fla_zigzag_cp``) means FLA's own zigzag parts.

Which kernels run is fixed by the layer's :class:`~relax_gdn.gdn.options.GDNOptions`
(:func:`select_kernels`): one stateless instance per distinct choice, nothing process-wide.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from relax_gdn.choices import KERNEL_BACKENDS, choice_problem
from relax_gdn.gdn import cp_reference, fla_cp_summaries, reference
from relax_gdn.gdn.options import GDNOptions
from relax_gdn.layout.route import upload_rows

logger = logging.getLogger(__name__)


def fla_fp32_gradient_caveat(dtype: torch.dtype, capability: tuple[int, int]) -> str | None:
    """What is known to be wrong with FLA's gradients for activations of ``dtype`` on a GPU of
    compute ``capability``; None where nothing is.

    ``python -m relax_gdn.bench.gdn_precision`` on Hopper (numbers in docs/benchmarks.md): in fp32
    the gated delta rule's backward misses an fp64 reference in the gate gradients (``A_log``,
    ``dt_bias``) while the output is exact, and bf16 stays close. It is in FLA's scan backward
    (not the conv, not CP), survives exact fp32 products in every Triton kernel
    (``TRITON_F32_DEFAULT=ieee``) and does not depend on which ``chunk_bwd_dqkwg`` runs (TileLang,
    FLA 0.6's choice on Hopper, or Triton, ``--triton-dqkwg``). Other GPUs make no claim here.
    """
    if dtype != torch.float32 or capability[0] != 9:
        return None
    return (
        "FLA's fp32 gated-delta-rule backward on Hopper gives wrong gate gradients (A_log / dt_bias "
        "off by up to 46 % vs fp64, measured on H200 with `python -m relax_gdn.bench.gdn_precision`); "
        "bf16 is within 1 %. Train in bf16 (train.precision=bf16) or check fp32 numerics with "
        "gdn.kernel_backend=torch."
    )


@functools.cache
def _warn_fla_fp32_gradients(dtype: torch.dtype, capability: tuple[int, int]) -> None:
    message = fla_fp32_gradient_caveat(dtype, capability)
    if message:
        logger.warning(message)


@dataclass(eq=False)
class ScanRows:
    """Packed boundaries of the rows handed to the kernels (``None``: unpacked batch rows)."""

    cu_host: torch.Tensor | None  # int64, CPU
    cu_device: torch.Tensor | None  # int64, on the activations' device
    cp_group: dist.ProcessGroup | None = None  # chunkwise CP: rows are a contiguous slice
    conv_kernel_size: int = 4
    # with cp_group: "contiguous" (one slice of the global stream per rank) or "zigzag" (FLA's own
    # zigzag: global parts r and 2W-1-r of the stream cut in 2W; FLA kernels only, GDNOptions.fla_zigzag_cp)
    cp_layout: str = "contiguous"
    # FLA's CP context, one per summary-skipping choice: layers with different options may share
    # the micro-batch's rows, and the choice travels on the context into FLA's backward
    _fla_contexts: dict = field(default_factory=dict, repr=False)
    _fla_chunk_indices: torch.Tensor | None = field(default=None, repr=False)


@dataclass(eq=False)
class GateInputs:
    """The decay gate before its activation: ``g = -exp(a_log) * softplus(alpha + dt_bias)``.

    Handed to the kernels raw so that FLA can fuse the activation into its chunk cumsum (and its
    gradient into one backward kernel) instead of a dozen elementwise kernels around it.
    """

    alpha: torch.Tensor  # [B, S, HV], the in-projection's alpha section
    a_log: torch.Tensor  # [HV]
    dt_bias: torch.Tensor  # [HV]

    def log_decay(self) -> torch.Tensor:
        """``g`` in fp32, computed as Megatron-Core does."""
        return -self.a_log.float().exp() * F.softplus(self.alpha.float() + self.dt_bias.float())


class GDNKernels(Protocol):
    name: str
    zigzag_cp: bool  # scans one-document micro-batches on their zigzag rows (GDNOptions.fla_zigzag_cp)

    def conv(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: ScanRows
    ) -> torch.Tensor:
        """SiLU(depthwise causal conv) of ``x [B, S, D]`` with ``weight [D, Wc]``."""

    def scan(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gate: GateInputs,
        beta: torch.Tensor,
        rows: ScanRows,
        use_qk_l2norm: bool,
    ) -> torch.Tensor:
        """Gated delta rule output ``[B, S, HV, V]`` (q, k ``[B, S, H, K]``, GVA when HV > H)."""


class TorchKernels:
    """Pure-torch reference (CPU or any device): exact, slow, autograd-differentiable."""

    name = "torch"
    zigzag_cp = False  # the reference's CP scan takes contiguous slices only

    def conv(self, x, weight, bias, rows):
        if rows.cp_group is not None:
            y, _ = cp_reference.cp_causal_conv1d(
                x, weight, bias, cu_seqlens_global=rows.cu_host, group=rows.cp_group, activation="silu"
            )
        else:
            y, _ = reference.causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=rows.cu_host)
        return y

    def scan(self, q, k, v, gate, beta, rows, use_qk_l2norm):
        g = gate.log_decay()
        if rows.cp_group is not None:
            o, _ = cp_reference.cp_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                use_qk_l2norm_in_kernel=use_qk_l2norm,
                cu_seqlens_global=rows.cu_host,
                group=rows.cp_group,
            )
        else:
            o, _ = reference.gated_delta_rule_chunked(
                q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=rows.cu_host
            )
        return o


class FlaKernels:
    """FLA 0.6 Triton kernels; chunkwise CP through ``fla.ops.cp.build_cp_context``.

    Host copies of the boundaries are always passed (``cu_seqlens_cpu``) so FLA never copies
    them back from the device, and so is the chunk index both the conv and the scan need: FLA
    would build it from the host copy and copy it to the GPU from pageable memory, a host sync
    per new micro-batch; built here once per micro-batch and uploaded pinned + non_blocking.

    Args (the layer's ``GDNOptions.fla_*``):
        fused_gate: the gate's activation inside FLA's chunk cumsum, else ``g`` computed by torch.
        zigzag_cp: one-document micro-batches scanned on their zigzag rows.
        skip_unread_cp_summaries: FLA's CP pre-pass skips the transition summaries no rank reads
            (:mod:`relax_gdn.gdn.fla_cp_summaries`, whose patch the Runtime installs).
    """

    name = "fla"
    chunk_size = 64  # FLA's default for the gated delta rule and the causal conv alike

    def __init__(self, *, fused_gate: bool, zigzag_cp: bool, skip_unread_cp_summaries: bool) -> None:
        from fla.modules.convolution import causal_conv1d
        from fla.ops.cp import build_cp_context
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        self._conv, self._scan, self._build_cp_context = (
            causal_conv1d,
            chunk_gated_delta_rule,
            build_cp_context,
        )
        self.fused_gate, self.zigzag_cp = fused_gate, zigzag_cp
        self.skip_unread_cp_summaries = skip_unread_cp_summaries

    def _context(self, rows: ScanRows):
        context = rows._fla_contexts.get(self.skip_unread_cp_summaries)
        if context is None:  # once per micro-batch: ScanRows is cached per micro-batch
            context = self._build_cp_context(
                rows.cu_device,
                rows.cp_group,
                conv1d_kernel_size=rows.conv_kernel_size,
                cu_seqlens_cpu=rows.cu_host,
                layout=rows.cp_layout,
            )
            if self.skip_unread_cp_summaries:
                fla_cp_summaries.skip_unread_summaries_of(context)
            rows._fla_contexts[self.skip_unread_cp_summaries] = context
        return context

    def _chunk_indices(self, rows: ScanRows, cu_device: torch.Tensor, cu_host: torch.Tensor) -> torch.Tensor:
        if rows._fla_chunk_indices is None:  # once per micro-batch, like the context
            from fla.ops.utils import prepare_chunk_indices

            host = prepare_chunk_indices(cu_host, self.chunk_size)  # host in, host out: no device read
            rows._fla_chunk_indices = upload_rows(host.numpy(), cu_device.device, cu_device.dtype)
        return rows._fla_chunk_indices

    def _where(self, rows: ScanRows) -> dict:
        if rows.cp_group is not None:
            context = self._context(rows)  # the scan and conv run on its LOCAL boundaries
            return {
                "cp_context": context,
                "chunk_indices": self._chunk_indices(rows, context.cu_seqlens, context.cu_seqlens_cpu),
            }
        if rows.cu_device is None:
            return {}
        return {
            "cu_seqlens": rows.cu_device,
            "cu_seqlens_cpu": rows.cu_host,
            "chunk_indices": self._chunk_indices(rows, rows.cu_device, rows.cu_host),
        }

    def conv(self, x, weight, bias, rows):
        y, _ = self._conv(x=x, weight=weight, bias=bias, activation="silu", **self._where(rows))
        return y

    def scan(self, q, k, v, gate, beta, rows, use_qk_l2norm):
        if q.dtype == torch.float32 and torch.is_grad_enabled():  # once per process, see the caveat
            _warn_fla_fp32_gradients(q.dtype, torch.cuda.get_device_capability(q.device))
        if self.fused_gate:  # FLA computes g inside its chunk cumsum, and dA_log / ddt_bias
            g, fused = gate.alpha, {"use_gate_in_kernel": True, "A_log": gate.a_log, "dt_bias": gate.dt_bias}
        else:
            g, fused = gate.log_decay(), {}
        o, _ = self._scan(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
            **fused,
            **self._where(rows),
        )
        return o


def select_kernels(options: GDNOptions, device: torch.device) -> GDNKernels:
    """The kernels a layer told ``options`` runs for activations on ``device``: ``auto`` is FLA on
    CUDA, the torch reference elsewhere (one stateless instance per distinct choice)."""
    return _kernels(
        options.kernel_backend,
        device.type,
        options.fla_fused_gate,
        options.fla_zigzag_cp,
        options.fla_skip_unread_cp_summaries,
    )


@functools.cache
def _kernels(
    backend: str, device_type: str, fused_gate: bool, zigzag_cp: bool, skip_unread_cp_summaries: bool
) -> GDNKernels:  # noqa: D103 - see select_kernels
    problem = choice_problem("gdn.kernel_backend", backend, KERNEL_BACKENDS)
    if problem:
        raise ValueError(problem)
    if backend == "auto":
        backend = "fla" if device_type == "cuda" else "torch"
    if backend == "fla" and device_type != "cuda":
        raise ValueError(
            f"gdn.kernel_backend=fla needs CUDA activations, got {device_type}; use torch or auto"
        )
    if backend == "torch":
        return TorchKernels()
    return FlaKernels(
        fused_gate=fused_gate, zigzag_cp=zigzag_cp, skip_unread_cp_summaries=skip_unread_cp_summaries
    )
