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

The CP functions implement the contiguous layout of docs/design/LAYOUTS.md §1 (rank ``r`` holds global rows
``[r T/W, (r+1) T/W)`` of the packed stream, documents may span ranks) and return, for the rows a
rank holds, exactly what the plain function computes on the whole stream.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from relax_gdn.layout.collectives import all_gather_rows, all_gather_stacked

__all__ = [
    "ContiguousShard",
    "causal_conv1d",
    "contiguous_shard",
    "cp_causal_conv1d",
    "cp_gated_delta_rule",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "RecomputedPrefix",
    "recomputed_prefix",
]

HostCuSeqlens = Sequence[int] | torch.Tensor  # or a 1-D numpy integer array

L2NORM_EPS = 1e-6  # fla.modules.l2norm default
CONV_ACTIVATIONS = (None, "silu", "swish")


# ---------------------------------------------------------------------------------------------
# Input handling shared by all functions
# ---------------------------------------------------------------------------------------------


def _host_bounds(cu_seqlens: HostCuSeqlens, total: int | None = None, what: str = "cu_seqlens") -> list[int]:
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
    return _host_bounds(cu, length)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_chunk_size(chunk_size: int) -> None:
    if not _is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


class _Scan(NamedTuple):
    """Scan inputs flattened to rows ``[B*T, HV, ...]`` in the compute dtype, heads already expanded."""

    q: torch.Tensor  # [T, HV, K], l2-normalised if asked, then scaled
    k: torch.Tensor  # [T, HV, K], l2-normalised if asked
    v: torch.Tensor  # [T, HV, V]
    g: torch.Tensor  # [T, HV]
    beta: torch.Tensor  # [T, HV]
    h0: torch.Tensor | None  # [N, HV, K, V]
    bounds: list[int]  # N + 1 host boundaries


def _prepare_scan(
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
) -> _Scan:
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
    return _Scan(
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


def _scan_recurrent(s: _Scan) -> tuple[torch.Tensor, torch.Tensor]:
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


def _scan_chunked(
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

    # Host-side chunk plan: chunks never straddle a sequence boundary, and a sequence's last chunk
    # is padded with a zero row (g = beta = 0, k = v = 0: a step that leaves the state untouched).
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
    src = torch.tensor(src_rows, dtype=torch.long, device=k.device)

    def chunked(x: torch.Tensor) -> torch.Tensor:
        """``[T, HV, ...]`` rows -> ``[n_chunks, HV, C, ...]``."""
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[src]
        return x.view(-1, size, *x.shape[1:]).transpose(1, 2).contiguous()

    kc, vc, gc, bc = chunked(k), chunked(v), chunked(g), chunked(beta)
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
        qc = chunked(q)
        q_from_start = qc * cum.exp()[..., None]
        qk = (qc @ kc.transpose(-1, -2)) * decay

    start_states = list(h0.unbind(0)) if h0 is not None else [k.new_zeros(heads, dk, dv)] * (len(bounds) - 1)
    finals = list(start_states)  # an empty sequence keeps its initial state
    outputs = []
    for c, n in enumerate(chunk_seq):
        if c == 0 or chunk_seq[c - 1] != n:
            state = start_states[n]
        u = u_v[c] - w[c] @ state
        if q is not None:
            outputs.append(q_from_start[c] @ state + qk[c] @ u)
        state = chunk_decay[c] * state + k_to_end[c].transpose(-1, -2) @ u
        finals[n] = state

    o = None
    if q is not None:
        slots = torch.tensor(real_slots, dtype=torch.long, device=k.device)
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
    s = _prepare_scan(
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
    _check_chunk_size(chunk_size)
    s = _prepare_scan(
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu
    )
    o, final = _scan_chunked(s.k, s.v, s.g, s.beta, s.h0, s.bounds, chunk_size, q=s.q)
    return o.reshape(v.shape).to(v.dtype), final if output_final_state else None


# ---------------------------------------------------------------------------------------------
# Depthwise causal conv1d
# ---------------------------------------------------------------------------------------------


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
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got {tuple(x.shape)}")
    batch, length, dim = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"weight must be [D, Wc] with D={dim}, got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (dim,):
        raise ValueError(f"bias must be [D]=[{dim}], got {list(bias.shape)}")
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    width = weight.shape[1]
    halo_len = width - 1
    bounds = _resolve_bounds(batch, length, cu_seqlens, cu_seqlens_cpu)
    if initial_tokens is not None:
        if batch != 1:
            raise ValueError(f"initial_tokens needs batch size 1, got B={batch}")
        if initial_tokens.shape != (halo_len, dim):
            raise ValueError(
                f"initial_tokens must be [Wc - 1, D]={[halo_len, dim]}, got {list(initial_tokens.shape)}"
            )

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


# ---------------------------------------------------------------------------------------------
# Chunkwise context parallelism (contiguous layout)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContiguousShard:
    """What rank ``rank`` of ``world_size`` holds of a packed micro-batch in the contiguous layout."""

    world_size: int
    rank: int
    start: int  # first global row held
    stop: int  # one past the last global row held; stop - start = T / W
    cu_seqlens: tuple[int, ...]  # local host boundaries of the held rows (empty sequences dropped)
    pre_tokens: int  # tokens of the first local sequence held by earlier ranks
    pre_ranks: tuple[int, ...]  # earlier ranks holding some of them, in rank order; () iff pre_tokens == 0


def contiguous_shard(cu_seqlens_global: HostCuSeqlens, world_size: int, rank: int) -> ContiguousShard:
    """Rank ``rank``'s slice of the packed stream whose GLOBAL host boundaries are ``cu_seqlens_global``.

    Pure Python on the host. Requires ``T % world_size == 0`` (pad the packed micro-batch).
    """
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    bounds = _host_bounds(cu_seqlens_global, what="cu_seqlens_global")
    total = bounds[-1]
    if total == 0 or total % world_size:
        raise ValueError(
            f"the contiguous CP layout needs T > 0 and T % W == 0, got T={total}, W={world_size}; "
            "pad the packed micro-batch to a multiple of the CP size"
        )
    part = total // world_size
    start, stop = rank * part, (rank + 1) * part
    inner = sorted({b - start for b in bounds if start < b < stop})
    seq_start = max(b for b in bounds if b <= start)
    pre_tokens = start - seq_start
    return ContiguousShard(
        world_size=world_size,
        rank=rank,
        start=start,
        stop=stop,
        cu_seqlens=(0, *inner, part),
        pre_tokens=pre_tokens,
        pre_ranks=tuple(range(seq_start // part, rank)) if pre_tokens else (),
    )


@dataclass(frozen=True)
class RecomputedPrefix:
    """Chunkwise CP with no state or conv halo crossing ranks: each rank whose first sequence
    began on the previous rank receives that sequence's first ``recv`` tokens from it and scans
    them again in front of its own rows, so its slice starts at a sequence start.

    The recomputed rows' outputs are dropped; their gradients (through the state they hand on)
    go back to their owner, which adds them to its own. Worth it where the prefixes are short:
    the extra work is ``recv`` tokens per rank, against the CP kernels' collectives and the
    waits of every rank on the previous one.
    """

    recv: int  # rows prepended: the first local sequence's tokens on the previous rank
    send: int  # this rank's last rows that the next rank prepends (its ``recv``)
    cu_seqlens: tuple[int, ...]  # local boundaries of the extended slice (``recv`` + T/W rows)
    any_rank_has_one: bool  # some rank's recv > 0: the exchange is needed (the same on every rank)


def recomputed_prefix(
    cu_seqlens_global: HostCuSeqlens, world_size: int, rank: int, max_tokens: int
) -> RecomputedPrefix | None:
    """This rank's :class:`RecomputedPrefix` when EVERY rank's prefix has at most ``max_tokens``
    tokens and lies on its previous rank alone (fewer than T/W tokens), else None (the CP
    kernels pass the state). With every rank cut on a sequence boundary, ``recv == send == 0``:
    each slice is scanned alone; ``max_tokens=0`` asks for exactly that (None: some sequence
    spans two ranks). The same decision on every rank (it reads only the global boundaries)."""
    shards = [contiguous_shard(cu_seqlens_global, world_size, r) for r in range(world_size)]
    part = shards[0].stop - shards[0].start
    if any(s.pre_tokens > min(max_tokens, part - 1) for s in shards):
        return None
    mine = shards[rank]
    send = shards[rank + 1].pre_tokens if rank + 1 < world_size else 0
    extended = (0, *(b + mine.pre_tokens for b in mine.cu_seqlens[1:]))
    return RecomputedPrefix(
        recv=mine.pre_tokens,
        send=send,
        cu_seqlens=extended,
        any_rank_has_one=any(s.pre_tokens for s in shards),
    )


def _shard_of(group: dist.ProcessGroup | None, cu_seqlens_global: HostCuSeqlens) -> ContiguousShard:
    if group is None:
        return contiguous_shard(cu_seqlens_global, 1, 0)
    return contiguous_shard(cu_seqlens_global, dist.get_world_size(group), dist.get_rank(group))


def _check_local_rows(x: torch.Tensor, shard: ContiguousShard, name: str) -> None:
    part = shard.stop - shard.start
    if x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != part:
        raise ValueError(
            f"{name} must hold this rank's contiguous slice [1, T/W={part}, ...] "
            f"(T={part * shard.world_size}, W={shard.world_size}), got {tuple(x.shape)}"
        )


def cp_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cu_seqlens_global: HostCuSeqlens,
    group: dist.ProcessGroup | None,
    activation: str | None = None,
) -> tuple[torch.Tensor, None]:
    """:func:`causal_conv1d` of this rank's contiguous slice ``x [1, T/W, D]`` of the packed stream.

    The first local sequence needs the ``Wc - 1`` raw rows before the slice (the halo), masked to
    the ones of its own document. Every rank all-gathers its last ``min(T/W, Wc - 1)`` rows; when
    a slice is shorter than the halo, the halo is assembled from several earlier ranks. Gradients
    of the halo flow back to their owners through the all-gather's reduce-scatter; ``weight`` and
    ``bias`` get this rank's partial gradient, to be summed over the CP group like any parameter
    replicated across CP ranks. ``group=None`` or a group of one: no collective.
    """
    shard = _shard_of(group, cu_seqlens_global)
    _check_local_rows(x, shard, "x")
    halo_len = weight.shape[-1] - 1
    if shard.world_size == 1 or halo_len == 0:
        return causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=shard.cu_seqlens)

    part = shard.stop - shard.start
    tail = min(part, halo_len)
    tails = all_gather_rows(x[0, part - tail :], group)  # [W * tail, D]
    # Rank j's tail sits at padded[halo_len + j*tail:]; the halo_len rows before rank r's own tail
    # are the last halo_len global rows before this slice (zeros before the stream start). Slicing
    # rather than branching keeps every rank in the autograd graph of the all-gather, whose
    # backward is a collective all ranks must enter.
    padded = torch.cat([tails.new_zeros(halo_len, tails.shape[1]), tails])
    halo = padded[shard.rank * tail : shard.rank * tail + halo_len]
    same_doc = torch.arange(halo_len, device=x.device) >= halo_len - min(halo_len, shard.pre_tokens)
    halo = torch.where(same_doc[:, None], halo, 0)
    return causal_conv1d(
        x, weight, bias, activation=activation, cu_seqlens=shard.cu_seqlens, initial_tokens=halo
    )


def cp_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    cu_seqlens_global: HostCuSeqlens,
    group: dist.ProcessGroup | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, None]:
    """:func:`gated_delta_rule_chunked` of this rank's contiguous slice (``[1, T/W, ...]`` inputs).

    State passing is LASP-2 generalised to the delta rule, as in FLA's chunkwise CP: the scan over
    a rank's LAST local sequence is affine in its entry state, ``S_out = M S_in + S_loc`` with
    ``M = prod_t exp(g_t) (I - beta_t k_t k_t^T)`` (``K x K`` per value head) and ``S_loc`` the
    state reached from zero. Every rank all-gathers ``[S_loc | M]`` (compute dtype), then folds
    ``S <- M_j S + S_loc_j`` over the earlier ranks that share its first sequence, in rank order,
    and starts its first local sequence from ``S``. Autograd differentiates the whole exchange
    (the all-gather's backward is a reduce-scatter SUM), so all ranks must run backward together.

    No initial or final state, as with FLA's ``cp_context``. ``group=None`` or a group of one: the
    plain chunked scan, no collective. Returns ``(o [1, T/W, HV, V] in v.dtype, None)``.
    """
    _check_chunk_size(chunk_size)
    shard = _shard_of(group, cu_seqlens_global)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_local_rows(t, shard, name)
    if shard.world_size == 1:
        return gated_delta_rule_chunked(
            q, k, v, g, beta, scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=shard.cu_seqlens, chunk_size=chunk_size,
        )  # fmt: skip

    s = _prepare_scan(q, k, v, g, beta, scale, None, use_qk_l2norm_in_kernel, shard.cu_seqlens)
    heads, dk, dv = s.k.shape[1], s.k.shape[2], s.v.shape[2]

    # 1. Summary of the last local sequence. The scan is linear in its state and updates every
    # state column on its own, so one run over [v | 0] from [0 | I] ends in [S_loc | M]. Every rank
    # sends one, even if no later rank reads it, so that all ranks run the same collectives.
    bos = shard.cu_seqlens[-2]
    last, last_len = slice(bos, None), len(s.v) - bos
    eye = torch.eye(dk, dtype=s.k.dtype, device=s.k.device).expand(heads, dk, dk)
    v_ext = torch.cat([s.v[last], s.v.new_zeros(last_len, heads, dk)], dim=-1)
    h_ext = torch.cat([s.v.new_zeros(heads, dk, dv), eye], dim=-1)[None]
    _, summary = _scan_chunked(s.k[last], v_ext, s.g[last], s.beta[last], h_ext, [0, last_len], chunk_size)

    # 2. Exchange and fold. The fold starts from a zero that is still a function of the gathered
    # tensor: a rank whose first sequence starts on its own boundary uses nothing gathered, yet
    # must reach the all-gather's backward, which is a collective.
    s_loc, m = all_gather_stacked(summary[0], group).split([dv, dk], dim=-1)
    state = s_loc[shard.rank] * 0
    for j in shard.pre_ranks:
        state = m[j] @ state + s_loc[j]

    # 3. Local scan, the first local sequence starting from the folded state.
    h0 = torch.cat([state[None], state.new_zeros(len(s.bounds) - 2, heads, dk, dv)])
    o, _ = _scan_chunked(s.k, s.v, s.g, s.beta, h0, s.bounds, chunk_size, q=s.q)
    return o.reshape(v.shape).to(v.dtype), None
