"""Per-micro-batch caches on the ``PackedSeqParams`` object itself (docs/design/LAYOUTS.md §3).

A route and the cu_seqlens checks depend only on (cu_seqlens, W, r, layouts, device), which are
constant within a micro-batch: every GDN layer, both swap directions and every recompute replay
need the same answer. So the answer is stored on the micro-batch's own ``PackedSeqParams`` and
reused only after a provenance check; nothing is ever cached across micro-batches.

Host copies: the data pipeline already holds cu_seqlens on the host. ``attach_host_cu_seqlens``
records that copy next to the device tensor so nothing in a layer needs a device->host sync.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from relax_gdn.choices import ROUTE_STRATEGIES
from relax_gdn.layout.partition import host_boundaries, validated_boundaries
from relax_gdn.layout.route import GatheredOrder, Route, build_route, gathered_zigzag_order

if TYPE_CHECKING:  # the layout package needs only the fields, not Megatron-Core's import cost
    from megatron.core.packed_seq_params import PackedSeqParams

T = TypeVar("T")

CP_LAYOUT_PAIR = ("zigzag", "contiguous")  # the conversion chunkwise GDN performs

_HOST_ATTR = "_relax_gdn_host_cu_seqlens"  # list of (device tensor, its _version, host array)
_ROUTES_ATTR = "_relax_gdn_routes"  # {frozenset(layouts): Route}
_PER_MICRO_BATCH_ATTR = "_relax_gdn_per_micro_batch"  # {(name, key): (sources, value)}


def attach_host_cu_seqlens(
    packed_seq_params: PackedSeqParams, cu_seqlens: torch.Tensor, host: torch.Tensor | np.ndarray | list
) -> None:
    """Record that ``host`` holds the values of ``cu_seqlens`` (a tensor of this micro-batch).

    Values other than the ones attached before (or a first attach after something was already
    built from the tensor) drop every route and per-micro-batch answer built from ``cu_seqlens``:
    a write through ``.data`` or a numpy view changes the values without bumping ``_version``,
    so the provenance check alone would keep the old packing's routes."""
    values = host_boundaries(host)
    records = getattr(packed_seq_params, _HOST_ATTR, None)
    if records is None:
        records = []
        setattr(packed_seq_params, _HOST_ATTR, records)
    previous = next((rec[2] for rec in records if rec[0] is cu_seqlens), None)
    if previous is None or not np.array_equal(previous, values):
        _forget_built_from(packed_seq_params, cu_seqlens)
    records[:] = [rec for rec in records if rec[0] is not cu_seqlens]
    records.append((cu_seqlens, cu_seqlens._version, values))


def _forget_built_from(packed_seq_params: PackedSeqParams, cu_seqlens: torch.Tensor) -> None:
    routes = getattr(packed_seq_params, _ROUTES_ATTR, {})
    for key in [k for k, route in routes.items() if route.cu_seqlens is cu_seqlens]:
        del routes[key]
    answers = getattr(packed_seq_params, _PER_MICRO_BATCH_ATTR, {})
    for key in [k for k, (sources, _) in answers.items() if any(t is cu_seqlens for t, _ in sources)]:
        del answers[key]


def host_cu_seqlens(packed_seq_params: PackedSeqParams | None, cu_seqlens: torch.Tensor) -> np.ndarray:
    """Host values of ``cu_seqlens``: the attached copy if still valid, else one device->host copy."""
    for tensor, version, host in getattr(packed_seq_params, _HOST_ATTR, ()):
        if tensor is cu_seqlens and version == cu_seqlens._version:
            return host
    return host_boundaries(cu_seqlens)


def packed_cu_seqlens(packed_seq_params: PackedSeqParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The (q, kv) boundaries a packed layer works with: padded ones when given (they carry the
    CP padding that the zigzag split needs), else the actual ones. The one place that decides."""
    if packed_seq_params.cu_seqlens_q_padded is not None:
        return packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_kv_padded
    return packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv


def _check_strategy(strategy: str) -> None:
    if strategy not in ROUTE_STRATEGIES:
        raise ValueError(f"unknown route strategy {strategy!r}: use one of {ROUTE_STRATEGIES} (gdn.route)")


def _route_matches(
    route: Route,
    cu_seqlens: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    source: str,
    target: str,
    device: torch.device,
) -> bool:
    return (
        route.cu_seqlens is cu_seqlens
        and route.cu_seqlens_version == cu_seqlens._version  # in-place refills, also via views
        and route.cp_size == cp_size
        and route.cp_rank == cp_rank
        and route.serves(source, target)
        and route.device == device
    )


def _sources(tensors: tuple[torch.Tensor | None, ...]) -> tuple:
    return tuple((t, None if t is None else t._version) for t in tensors)


def _same_sources(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(ta is tb and va == vb for (ta, va), (tb, vb) in zip(a, b))


def per_micro_batch[T](
    packed_seq_params: PackedSeqParams,
    name: str,
    key: tuple,
    depends_on: tuple[torch.Tensor | None, ...],
    build: Callable[[], T],
) -> T:
    """``build()`` once per micro-batch: cached on ``packed_seq_params`` under ``(name, key)`` and
    reused while every tensor in ``depends_on`` is the same object at the same ``_version``
    (in-place refills, also through views, invalidate). ``key`` holds the plain values the answer
    depends on (CP size, rank, device, ...)."""
    cache = getattr(packed_seq_params, _PER_MICRO_BATCH_ATTR, None)
    if cache is None:
        cache = {}
        setattr(packed_seq_params, _PER_MICRO_BATCH_ATTR, cache)
    sources = _sources(depends_on)
    hit = cache.get((name, key))
    if hit is not None and _same_sources(hit[0], sources):
        return hit[1]
    value = build()
    cache[(name, key)] = (sources, value)
    return value


def get_route(
    packed_seq_params: PackedSeqParams,
    cu_seqlens: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    source: str,
    target: str,
    strategy: str = "lazy_cache",
    device: torch.device | str | None = None,
) -> Route:
    """The ``source -> target`` route for this micro-batch, reused when its provenance matches.

    ``lazy_cache``: the first caller builds and stores it on ``packed_seq_params``; later callers
    (other layers, the reverse direction, recompute) reuse it. ``prebuild``: the data side already
    stored it (``prebuild_routes``); a stored route that does not match the request is rebuilt,
    never used. Either way the answer is the same route; only who pays for building differs.
    """
    _check_strategy(strategy)
    device = torch.device(device) if device is not None else cu_seqlens.device
    routes = getattr(packed_seq_params, _ROUTES_ATTR, None)
    if routes is None:
        routes = {}
        setattr(packed_seq_params, _ROUTES_ATTR, routes)
    key = frozenset((source, target))
    cached = routes.get(key)
    if cached is not None and _route_matches(cached, cu_seqlens, cp_size, cp_rank, source, target, device):
        return cached.oriented(source, target)
    if strategy == "prebuild":  # no flag of ours: the default warning filter says each distinct one once
        warnings.warn(
            "gdn.route=prebuild but this micro-batch carries no matching prebuilt route "
            f"({source}->{target}, cp_size={cp_size}, cp_rank={cp_rank}); building it in the layer. "
            "Call relax_gdn.layout.prebuild_routes on the PackedSeqParams the model receives.",
            stacklevel=2,
        )
    route = build_route(
        host_cu_seqlens(packed_seq_params, cu_seqlens),
        cp_size,
        cp_rank,
        source,
        target,
        device=device,
        provenance=cu_seqlens,
    )
    routes[key] = route
    return route.oriented(source, target)


def prebuild_routes(
    packed_seq_params: PackedSeqParams | None,
    cp_group: dist.ProcessGroup | None,
    *,
    cp_size: int | None = None,
    cp_rank: int | None = None,
) -> None:
    """Data-side route building: attach the zigzag<->contiguous route (one object serves both
    directions) to ``packed_seq_params``. A no-op without packed (THD) input or with CP = 1."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return
    if cp_size is None:
        cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if cp_rank is None:
        cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    if cp_size == 1:
        return
    cu_seqlens, _ = packed_cu_seqlens(packed_seq_params)
    get_route(packed_seq_params, cu_seqlens, cp_size, cp_rank, *CP_LAYOUT_PAIR, strategy="lazy_cache")


@dataclass(frozen=True)
class ResolvedCuSeqlens:
    """The outcome of GDN's per-layer cu_seqlens checks, computed once per micro-batch."""

    cu_seqlens: torch.Tensor  # device boundaries the layer uses (padded if given)
    host: np.ndarray  # their host copy
    max_seqlen: int


def resolve_cu_seqlens(packed_seq_params: PackedSeqParams, seq_len: int, cp_size: int) -> ResolvedCuSeqlens:
    """GDN's checks on packed boundaries (q == kv, last boundary == global length, 2W divisibility,
    padded-vs-actual choice), run once per micro-batch and cached on ``packed_seq_params``.

    Keyed on the identities and versions of the four boundary tensors plus ``(seq_len, cp_size)``;
    the answer does not depend on the CP rank. With host copies attached it needs no sync at all.
    """
    p = packed_seq_params
    boundary_fields = (p.cu_seqlens_q, p.cu_seqlens_kv, p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded)
    return per_micro_batch(
        p,
        "resolved_cu_seqlens",
        (seq_len, cp_size),
        boundary_fields,
        lambda: _resolve(p, seq_len, cp_size),
    )


def _resolve(packed_seq_params: PackedSeqParams, seq_len: int, cp_size: int) -> ResolvedCuSeqlens:
    cu_q, cu_kv = packed_cu_seqlens(packed_seq_params)
    if cu_q is None:
        raise ValueError("packed (thd) input needs PackedSeqParams.cu_seqlens_q (or cu_seqlens_q_padded)")
    host_q = host_cu_seqlens(packed_seq_params, cu_q)
    if cu_kv is not None and cu_kv is not cu_q:
        host_kv = host_cu_seqlens(packed_seq_params, cu_kv)
        if not np.array_equal(host_q, host_kv):
            raise ValueError(
                "GDN needs identical query and key/value boundaries (self-attention packing): "
                f"cu_seqlens_q={host_q.tolist()} but cu_seqlens_kv={host_kv.tolist()}"
            )
    if int(host_q[-1]) != seq_len:
        raise ValueError(
            f"cu_seqlens[-1]={int(host_q[-1])} does not match the micro-batch's global length {seq_len} "
            "(local rows x CP size x SP size); the packed boundaries belong to another batch"
        )
    validated_boundaries(host_q, cp_size, 0, "zigzag")
    lengths = np.diff(host_q)
    return ResolvedCuSeqlens(
        cu_seqlens=cu_q, host=host_q, max_seqlen=int(lengths.max()) if lengths.size else 0
    )


def cached_gathered_zigzag_order(
    packed_seq_params: PackedSeqParams, resolved: ResolvedCuSeqlens, cp_size: int, device: torch.device
) -> GatheredOrder:
    """``gathered_zigzag_order`` once per micro-batch, shared by every layer that gathers the
    zigzag shards (GDN headwise / all_gather, CP attention)."""
    return per_micro_batch(
        packed_seq_params,
        "gathered_zigzag_order",
        (cp_size, str(device)),
        (resolved.cu_seqlens,),
        lambda: gathered_zigzag_order(resolved.host, cp_size, device),
    )
