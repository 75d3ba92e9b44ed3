"""Pure-torch references for the three FLA kernels of a Gated DeltaNet layer, packed and CP-aware.

They run on any device (the CPU included) and serve twice: as the CPU kernel backend of the GDN
layer, so that every CP mode runs end to end on gloo, and as the ground truth the FLA GPU kernels
are tested against. They favour clarity over speed; autograd provides every backward.

Conventions (those of FLA 0.6, so the plain functions are drop-ins for
``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` and ``fla.modules.causal_conv1d``):

* Shapes: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``, conv input
  ``x [B, T, D]`` with ``weight [D, Wc]``. Packed (varlen) input has ``B == 1`` and boundaries
  ``cu_seqlens = [0, ..., T]`` (``N + 1`` entries for ``N`` sequences; repeated entries are empty
  sequences). Without ``cu_seqlens``, each of the ``B`` rows is one sequence.
* ``cu_seqlens`` is a HOST sequence of ints (list, tuple, numpy array or CPU tensor), so nothing
  here reads a device tensor back. ``cu_seqlens_cpu=`` is accepted as in FLA and wins when both
  are given.
* GVA: value head ``j`` reads key head ``j // (HV // H)``; ``HV`` must be a multiple of ``H``.
* Recurrence per sequence and value head (state ``S`` is ``K x V``, zero unless given)::

      S_t = exp(g_t) S_{t-1}
      S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T     # FLA's order of operations
      o_t = S_t^T (scale q_t)                          # scale=None means K ** -0.5

  i.e. ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``.

  ``g`` is the log decay (<= 0). With ``use_qk_l2norm_in_kernel`` q and k are first divided by
  ``sqrt(sum(x^2) + 1e-6)`` over the head dimension, as FLA's ``l2norm`` does.
* Precision: everything is computed in fp32, or fp64 for fp64 inputs. Outputs are cast back to
  the input dtype; states (initial, final, exchanged) stay in the compute dtype.

Their context-parallel forms, on one rank's slice of the packed stream:
:mod:`relax_gdn.gdn.cp_reference`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "gated_delta_rule_chunked", "gated_delta_rule_recurrent"]

HostCuSeqlens = Sequence[int] | torch.Tensor  # or a 1-D numpy integer array

L2NORM_EPS = 1e-6  # fla.modules.l2norm default
CONV_ACTIVATIONS = (None, "silu", "swish")


# ---------------------------------------------------------------------------------------------
# Input handling shared by all functions
# ---------------------------------------------------------------------------------------------


def host_bounds(cu_seqlens: HostCuSeqlens, total: int | None = None, what: str = "cu_seqlens") -> list[int]:
    """Validated sequence boundaries as Python ints; when ``total`` is given, the last must equal it."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type != "cpu":
        raise ValueError(
            f"{what} must be a host copy (list, numpy array or CPU tensor), got a tensor on "
            f"{cu_seqlens.device}: reading it would synchronise the device. Pass the host copy the "
            "data pipeline made (cu_seqlens_cpu=)"
        )
    raw = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    try:
        bounds = [operator.index(b) for b in raw]
    except TypeError:
        raise ValueError(f"{what} must be a 1-D sequence of integers, got {cu_seqlens!r}") from None
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"{what} must start at 0 and hold at least one sequence, got {bounds}")
    if any(b < a for a, b in pairwise(bounds)):
        raise ValueError(f"{what} must be non-decreasing, got {bounds}")
    if total is not None and bounds[-1] != total:
        raise ValueError(f"{what}[-1]={bounds[-1]} must equal the number of tokens T={total}")
    return bounds


def _resolve_bounds(
    batch: int, length: int, cu_seqlens: HostCuSeqlens | None, cu_seqlens_cpu: HostCuSeqlens | None
) -> list[int]:
    """Boundaries of the ``batch * length`` flattened rows: the given packed ones, else one per row."""
    cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    if cu is None:
        return [b * length for b in range(batch + 1)]
    if batch != 1:
        raise ValueError(
            f"packed input (cu_seqlens given) must have batch size 1, got B={batch}; "
            "flatten the batch into one row of tokens"
        )
    return host_bounds(cu, length)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_chunk_size(chunk_size: int) -> None:
    if not is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


class PreparedScan(NamedTuple):
    """Scan inputs flattened to rows ``[B*T, HV, ...]`` in the compute dtype, heads already expanded."""

    q: torch.Tensor  # [T, HV, K], l2-normalised if asked, then scaled
    k: torch.Tensor  # [T, HV, K], l2-normalised if asked
    v: torch.Tensor  # [T, HV, V]
    g: torch.Tensor  # [T, HV]
    beta: torch.Tensor  # [T, HV]
    h0: torch.Tensor | None  # [N, HV, K, V]
    bounds: list[int]  # N + 1 host boundaries


def prepare_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: HostCuSeqlens | None,
    cu_seqlens_cpu: HostCuSeqlens | None = None,
) -> PreparedScan:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got q {tuple(q.shape)} and k {tuple(k.shape)}")
    batch, length, key_heads, dk = q.shape
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with q's B={batch} and T={length}, got {tuple(v.shape)}")
    heads, dv = v.shape[2:]
    if heads % key_heads:
        raise ValueError(
            f"value heads HV={heads} must be a multiple of key heads H={key_heads} "
            "(GVA: value head j reads key head j // (HV // H))"
        )
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (batch, length, heads):
            raise ValueError(f"{name} must be [B, T, HV]={[batch, length, heads]}, got {list(t.shape)}")
    if batch * length == 0:
        raise ValueError(f"the scan needs at least one token, got B={batch}, T={length}")
    bounds = _resolve_bounds(batch, length, cu_seqlens, cu_seqlens_cpu)
    n_seqs = len(bounds) - 1
    if initial_state is not None and initial_state.shape != (n_seqs, heads, dk, dv):
        raise ValueError(
            f"initial_state must be [N, HV, K, V]={[n_seqs, heads, dk, dv]} (one state per sequence), "
            f"got {list(initial_state.shape)}"
        )

    dtype = _compute_dtype(v.dtype)

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch * length, *x.shape[2:]).to(dtype)

    q, k = rows(q), rows(k)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (dk**-0.5 if scale is None else scale)
    group = heads // key_heads
    return PreparedScan(
        q=q.repeat_interleave(group, dim=1),
        k=k.repeat_interleave(group, dim=1),
        v=rows(v),
        g=rows(g),
        beta=rows(beta),
        h0=None if initial_state is None else initial_state.to(dtype),
        bounds=bounds,
    )


# ---------------------------------------------------------------------------------------------
# Gated delta rule: token-by-token and chunked scans
# ---------------------------------------------------------------------------------------------


def _scan_recurrent(s: PreparedScan) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token; returns ``o [T, HV, V]`` and the final states ``[N, HV, K, V]``."""
    heads, dk, dv = s.k.shape[1], s.k.shape[2], s.v.shape[2]
    outputs, finals = [], []
    for n, (bos, eos) in enumerate(pairwise(s.bounds)):
        state = s.h0[n] if s.h0 is not None else s.k.new_zeros(heads, dk, dv)
        for t in range(bos, eos):
            state = state * s.g[t].exp()[:, None, None]
            # Delta rule: move what the state recalls for k_t towards v_t, with step size beta_t.
            recalled = torch.einsum("hk,hkv->hv", s.k[t], state)
            update = s.beta[t][:, None] * (s.v[t] - recalled)
            state = state + s.k[t][:, :, None] * update[:, None, :]
            outputs.append(torch.einsum("hk,hkv->hv", s.q[t], state))
        finals.append(state)
    return torch.stack(outputs), torch.stack(finals)


class _ChunkPlan(NamedTuple):
    """Where the rows of a packed stream go in its chunks (built on the host): chunks never straddle
    a sequence boundary, and a sequence's last chunk is padded with a zero row (g = beta = 0,
    k = v = 0: a step that leaves the state untouched)."""

    size: int  # tokens per chunk
    src: torch.Tensor  # [n_chunks * size] the row each chunk slot reads (T: the zero row)
    real_slots: list[int]  # the slots that hold a real row, in row order
    chunk_seq: list[int]  # the sequence of each chunk

    @classmethod
    def of(cls, bounds: list[int], size: int, total: int, device: torch.device) -> _ChunkPlan:
        src_rows: list[int] = []
        real_slots: list[int] = []
        chunk_seq: list[int] = []
        for n, (bos, eos) in enumerate(pairwise(bounds)):
            for start in range(bos, eos, size):
                stop = min(start + size, eos)
                real_slots.extend(range(len(src_rows), len(src_rows) + stop - start))
                src_rows.extend(range(start, stop))
                src_rows.extend([total] * (size - (stop - start)))
                chunk_seq.append(n)
        return cls(size, torch.tensor(src_rows, dtype=torch.long, device=device), real_slots, chunk_seq)

    def chunked(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, HV, ...]`` rows -> ``[n_chunks, HV, C, ...]``."""
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.src]
        return x.view(-1, self.size, *x.shape[1:]).transpose(1, 2).contiguous()


def scan_chunked(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor | None,
    bounds: list[int],
    chunk_size: int,
    q: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Chunked (WY / UT-transform) scan of prepared rows; ``o`` is None when ``q`` is None.

    Inside a chunk with entry state ``S0`` and ``G_i = g_1 + ... + g_i``, the per-token updates
    ``u_i = beta_i (v_i - (exp(g_i) S_{i-1})^T k_i)`` solve the unit lower-triangular system
    ``(I + A) U = beta V - (beta exp(G) K) S0`` with ``A_ij = beta_i exp(G_i - G_j) k_i . k_j``
    (``j < i``), so ``U = U_v - W S0`` where ``U_v`` and ``W`` need no state and are computed for
    all chunks at once. Then, per chunk in sequence order:

        o_i  = exp(G_i) q_i^T S0 + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) u_j^T
        S_C  = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T
    """
    total, heads, dk = k.shape
    dv = v.shape[-1]
    size = chunk_size
    plan = _ChunkPlan.of(bounds, size, total, k.device)
    kc, vc, gc, bc = plan.chunked(k), plan.chunked(v), plan.chunked(g), plan.chunked(beta)
    cum = gc.cumsum(-1)  # G_i
    causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above the diagonal; masking before exp keeps the upper triangle
    # from overflowing and its gradient at exactly zero.
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    a = (bc[..., None] * decay * (kc @ kc.transpose(-1, -2))).tril(-1)
    eye = torch.eye(size, dtype=k.dtype, device=k.device)
    rhs = bc[..., None] * torch.cat([vc, cum.exp()[..., None] * kc], dim=-1)
    u_v, w = torch.linalg.solve_triangular(a + eye, rhs, upper=False).split([dv, dk], dim=-1)
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]  # exp(G_C - G_j) k_j
    chunk_decay = cum[..., -1].exp()[..., None, None]  # exp(G_C), [n_chunks, HV, 1, 1]
    if q is not None:
        qc = plan.chunked(q)
        q_from_start = qc * cum.exp()[..., None]
        qk = (qc @ kc.transpose(-1, -2)) * decay

    start_states = list(h0.unbind(0)) if h0 is not None else [k.new_zeros(heads, dk, dv)] * (len(bounds) - 1)
    finals = list(start_states)  # an empty sequence keeps its initial state
    outputs = []
    for c, n in enumerate(plan.chunk_seq):
        if c == 0 or plan.chunk_seq[c - 1] != n:
            state = start_states[n]
        u = u_v[c] - w[c] @ state
        if q is not None:
            outputs.append(q_from_start[c] @ state + qk[c] @ u)
        state = chunk_decay[c] * state + k_to_end[c].transpose(-1, -2) @ u
        finals[n] = state

    o = None
    if q is not None:
        slots = torch.tensor(plan.real_slots, dtype=torch.long, device=k.device)
        o = torch.stack(outputs).transpose(1, 2).reshape(-1, heads, dv)[slots]
    return o, torch.stack(finals)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    cu_seqlens: HostCuSeqlens | None = None,
    cu_seqlens_cpu: HostCuSeqlens | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, one token at a time: the ground truth (slow; see the module docstring).

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, HV, V]``. g (log decay), beta: ``[B, T, HV]``.
        scale: query scale, ``None`` means ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``, one per sequence, or None for zeros.
        output_final_state: also return the final states ``[N, HV, K, V]`` (compute dtype).
        use_qk_l2norm_in_kernel: L2-normalise q and k over the head dimension first.
        cu_seqlens / cu_seqlens_cpu: host boundaries of packed input (``B == 1``).

    Returns:
        ``(o [B, T, HV, V] in v.dtype, final_state or None)``, like FLA's ``chunk_gated_delta_rule``.
    """
    s = prepare_scan(
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu
    )
    o, final = _scan_recurrent(s)
    return o.reshape(v.shape).to(v.dtype), final if output_final_state else None


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    cu_seqlens: HostCuSeqlens | None = None,
    cu_seqlens_cpu: HostCuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule in chunks of ``chunk_size`` tokens (WY / UT transform); same contract as
    :func:`gated_delta_rule_recurrent`, to which it is equal up to rounding.

    Chunks restart at every sequence start, so ``chunk_size`` may be any positive int (FLA allows
    16, 32 and 64). Differentiable with autograd; one Python iteration per chunk.
    """
    check_chunk_size(chunk_size)
    s = prepare_scan(
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu
    )
    o, final = scan_chunked(s.k, s.v, s.g, s.beta, s.h0, s.bounds, chunk_size, q=s.q)
    return o.reshape(v.shape).to(v.dtype), final if output_final_state else None


# ---------------------------------------------------------------------------------------------
# Depthwise causal conv1d
# ---------------------------------------------------------------------------------------------


def _check_conv_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    initial_tokens: torch.Tensor | None,
) -> None:
    """:func:`causal_conv1d`'s shape and option checks, each naming the value it refuses."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got {tuple(x.shape)}")
    batch, _, dim = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"weight must be [D, Wc] with D={dim}, got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (dim,):
        raise ValueError(f"bias must be [D]=[{dim}], got {list(bias.shape)}")
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    if initial_tokens is not None:
        halo_len = weight.shape[1] - 1
        if batch != 1:
            raise ValueError(f"initial_tokens needs batch size 1, got B={batch}")
        if initial_tokens.shape != (halo_len, dim):
            raise ValueError(
                f"initial_tokens must be [Wc - 1, D]={[halo_len, dim]}, got {list(initial_tokens.shape)}"
            )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    cu_seqlens: HostCuSeqlens | None = None,
    cu_seqlens_cpu: HostCuSeqlens | None = None,
    initial_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """Depthwise causal convolution that restarts at every sequence start.

    ``y_t = act(bias + sum_i weight[:, i] * x_{t - (Wc-1) + i})``, i.e. ``nn.Conv1d(groups=D)``
    with ``Wc - 1`` rows of left padding, where rows before the start of ``t``'s own sequence
    count as zeros: no document sees another.

    Args:
        x: ``[B, T, D]``. weight: ``[D, Wc]``. bias: ``[D]`` or None.
        activation: ``None`` (FLA's default), ``"silu"`` or ``"swish"``.
        cu_seqlens / cu_seqlens_cpu: host boundaries of packed input (``B == 1``).
        initial_tokens: ``[Wc - 1, D]`` raw input rows that precede the FIRST sequence (the CP
            halo; oldest first), or None for zeros. Only with ``B == 1``.

    Returns:
        ``(y [B, T, D] in x.dtype, None)``: the arity of FLA's ``causal_conv1d``, whose second
        value is the final conv state (not produced here).
    """
    _check_conv_inputs(x, weight, bias, activation, initial_tokens)
    batch, length, dim = x.shape
    width = weight.shape[1]
    halo_len = width - 1
    bounds = _resolve_bounds(batch, length, cu_seqlens, cu_seqlens_cpu)
    dtype = _compute_dtype(x.dtype)
    total = batch * length
    rows = x.reshape(total, dim).to(dtype)
    halo = initial_tokens.to(dtype) if initial_tokens is not None else rows.new_zeros(halo_len, dim)
    padded = torch.cat([halo, rows])  # padded[halo_len + t] = rows[t]
    w = weight.to(dtype)

    # A tap that reaches before the start of its row's sequence would read another document, so it
    # is masked; the first sequence instead reads the halo (zeros unless initial_tokens is given).
    starts = torch.tensor(bounds[:-1], device=x.device)
    lengths = torch.tensor([b - a for a, b in pairwise(bounds)], device=x.device)
    row = torch.arange(total, device=x.device)
    pos_in_seq = row - torch.repeat_interleave(starts, lengths, output_size=total)
    in_first_seq = row < bounds[1]

    y = rows.new_zeros(total, dim)
    for lag in range(width):
        tap = padded[halo_len - lag : halo_len - lag + total]  # row t - lag
        keep = (pos_in_seq >= lag) | in_first_seq
        y = y + torch.where(keep[:, None], tap, 0) * w[:, halo_len - lag]
    if bias is not None:
        y = y + bias.to(dtype)
    if activation is not None:
        y = F.silu(y)
    return y.reshape(batch, length, dim).to(x.dtype), None
