"""Context-parallel forms of the pure-torch references (:mod:`relax_gdn.gdn.reference`): the conv and
the chunked scan of one rank's slice of the packed stream, with the conv halo and the recurrent state
passed between ranks by differentiable collectives, and the plans of which rows a rank holds.

They implement the contiguous layout of docs/design/LAYOUTS.md §1 (rank ``r`` holds global rows
``[r T/W, (r+1) T/W)`` of the packed stream, documents may span ranks) and return, for the rows a
rank holds, exactly what the plain function computes on the whole stream. The conventions (shapes,
host ``cu_seqlens``, precision) are the plain functions'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from relax_gdn.gdn.reference import (
    HostCuSeqlens,
    PreparedScan,
    causal_conv1d,
    check_chunk_size,
    gated_delta_rule_chunked,
    host_bounds,
    is_int,
    prepare_scan,
    scan_chunked,
)
from relax_gdn.layout.collectives import all_gather_rows, all_gather_stacked

__all__ = [
    "ContiguousShard",
    "RecomputedPrefix",
    "contiguous_shard",
    "cp_causal_conv1d",
    "cp_gated_delta_rule",
    "recomputed_prefix",
]


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
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    bounds = host_bounds(cu_seqlens_global, what="cu_seqlens_global")
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


def _last_sequence_summary(s: PreparedScan, bos: int, chunk_size: int) -> torch.Tensor:
    """``[1, HV, K, V + K]``: ``[S_loc | M]`` of the prepared rows ``s`` from row ``bos`` on (the last
    local sequence). The scan is linear in its state and updates every state column on its own, so
    one run over ``[v | 0]`` from ``[0 | I]`` ends in ``[S_loc | M]``."""
    heads, dk, dv = s.k.shape[1], s.k.shape[2], s.v.shape[2]
    last, last_len = slice(bos, None), len(s.v) - bos
    eye = torch.eye(dk, dtype=s.k.dtype, device=s.k.device).expand(heads, dk, dk)
    v_ext = torch.cat([s.v[last], s.v.new_zeros(last_len, heads, dk)], dim=-1)
    h_ext = torch.cat([s.v.new_zeros(heads, dk, dv), eye], dim=-1)[None]
    _, summary = scan_chunked(s.k[last], v_ext, s.g[last], s.beta[last], h_ext, [0, last_len], chunk_size)
    return summary


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
    check_chunk_size(chunk_size)
    shard = _shard_of(group, cu_seqlens_global)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_local_rows(t, shard, name)
    if shard.world_size == 1:
        return gated_delta_rule_chunked(
            q, k, v, g, beta, scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=shard.cu_seqlens, chunk_size=chunk_size,
        )  # fmt: skip

    s = prepare_scan(q, k, v, g, beta, scale, None, use_qk_l2norm_in_kernel, shard.cu_seqlens)
    heads, dk, dv = s.k.shape[1], s.k.shape[2], s.v.shape[2]
    # 1. Summary of the last local sequence: every rank sends one, even if no later rank reads it,
    # so that all ranks run the same collectives.
    summary = _last_sequence_summary(s, shard.cu_seqlens[-2], chunk_size)

    # 2. Exchange and fold. The fold starts from a zero that is still a function of the gathered
    # tensor: a rank whose first sequence starts on its own boundary uses nothing gathered, yet
    # must reach the all-gather's backward, which is a collective.
    s_loc, m = all_gather_stacked(summary[0], group).split([dv, dk], dim=-1)
    state = s_loc[shard.rank] * 0
    for j in shard.pre_ranks:
        state = m[j] @ state + s_loc[j]

    # 3. Local scan, the first local sequence starting from the folded state.
    h0 = torch.cat([state[None], state.new_zeros(len(s.bounds) - 2, heads, dk, dv)])
    o, _ = scan_chunked(s.k, s.v, s.g, s.beta, h0, s.bounds, chunk_size, q=s.q)
    return o.reshape(v.shape).to(v.dtype), None
