"""THD layouts of a packed micro-batch across CP ranks, and the all-to-all that converts them.

Knows nothing of GDN (docs/design/ARCHITECTURE.md): partitions, interval routes, the autograd swap, and
the per-micro-batch caches for routes and cu_seqlens checks.
"""

from relax_gdn.layout.cache import (
    CP_LAYOUT_PAIR,
    ROUTE_STRATEGIES,
    ResolvedCuSeqlens,
    attach_host_cu_seqlens,
    cached_gathered_zigzag_order,
    get_route,
    host_cu_seqlens,
    packed_cu_seqlens,
    per_micro_batch,
    prebuild_routes,
    resolve_cu_seqlens,
)
from relax_gdn.layout.partition import LAYOUTS, thd_rank_indices, validated_boundaries
from relax_gdn.layout.route import GatheredOrder, Route, build_route, gathered_zigzag_order, rows_as_tensor
from relax_gdn.layout.swap import SWAP_TRANSPORTS, swap_layout

__all__ = [
    "CP_LAYOUT_PAIR",
    "LAYOUTS",
    "ROUTE_STRATEGIES",
    "SWAP_TRANSPORTS",
    "ResolvedCuSeqlens",
    "GatheredOrder",
    "Route",
    "attach_host_cu_seqlens",
    "cached_gathered_zigzag_order",
    "build_route",
    "gathered_zigzag_order",
    "get_route",
    "host_cu_seqlens",
    "packed_cu_seqlens",
    "per_micro_batch",
    "prebuild_routes",
    "resolve_cu_seqlens",
    "rows_as_tensor",
    "swap_layout",
    "thd_rank_indices",
    "validated_boundaries",
]
