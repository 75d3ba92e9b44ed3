"""What a GDN layer builds once per micro-batch from its host boundaries, cached on the micro-batch's
``PackedSeqParams`` (:func:`relax_gdn.layout.per_micro_batch`) so that no layer reads a device tensor
back: the layout routes and the kernels' row boundaries (:class:`~relax_gdn.gdn.kernels.ScanRows`),
and the exchange of a recomputed prefix (:class:`~relax_gdn.gdn.cp_reference.RecomputedPrefix`). The
cache keys name no layer: every GDN layer of a micro-batch uses the same ones."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from relax_gdn.gdn.cp_reference import RecomputedPrefix, recomputed_prefix
from relax_gdn.gdn.kernels import ScanRows
from relax_gdn.layout import CP_LAYOUT_PAIR, Route, get_route, per_micro_batch
from relax_gdn.layout.collectives import last_rows_to_next_rank
from relax_gdn.layout.route import upload_rows
from relax_gdn.parallel import CPGroup


@dataclass(frozen=True)
class GDNRowPlans:
    """The per-micro-batch plans of a GDN layer built with these settings."""

    conv_kernel_size: int  # the depthwise conv's width (its halo is one less)
    route_strategy: str  # gdn.route: when the zigzag <-> contiguous routes are built
    max_recomputed_prefix: int  # gdn.max_recomputed_prefix (chunkwise)

    def route(
        self,
        psp: PackedSeqParams,
        resolved,
        cp: CPGroup,
        device: torch.device,
        source: str = CP_LAYOUT_PAIR[0],
        target: str = CP_LAYOUT_PAIR[1],
    ) -> Route:
        """The micro-batch's cached ``source -> target`` route (``reverse()`` goes back)."""
        return get_route(
            psp,
            resolved.cu_seqlens,
            cp.size,
            cp.rank,
            source,
            target,
            strategy=self.route_strategy,
            device=device,
        )

    def scan_rows(
        self, host: np.ndarray, device: torch.device, cp_group=None, cp_layout="contiguous"
    ) -> ScanRows:
        """The kernels' view of host boundaries ``host``: both copies, and FLA's CP context with
        ``cp_group`` (None: the rows are scanned alone)."""
        return ScanRows(
            cu_host=torch.from_numpy(host),
            cu_device=upload_rows(host, device),
            cp_group=cp_group,
            conv_kernel_size=self.conv_kernel_size,
            cp_layout=cp_layout,
        )

    def rows(self, psp: PackedSeqParams, resolved, cp_group) -> ScanRows:
        """Kernel-side boundaries, built once per micro-batch (and FLA's CP context with them)."""
        device = resolved.cu_seqlens.device
        key = (id(cp_group), str(device))  # the group objects live as long as the run
        return per_micro_batch(
            psp,
            "gdn_scan_rows",
            key,
            (resolved.cu_seqlens,),
            lambda: self.scan_rows(resolved.host, device, cp_group),
        )

    def contiguous_rows(
        self, psp: PackedSeqParams, resolved, cp: CPGroup
    ) -> tuple[ScanRows, RecomputedPrefix | None]:
        """This rank's contiguous slice for conv + scan, and how it is extended. When every rank
        cut falls on a sequence boundary, or every sequence that crosses one has at most
        ``max_recomputed_prefix`` tokens before it (``RecomputedPrefix``), no state or conv halo
        crosses ranks: the slice (extended by that prefix) is scanned alone with local
        boundaries, without the CP machinery's collectives and the waits on the previous rank.
        Otherwise the rows carry the CP group and the kernels pass the state. Every rank reaches
        the same choice (it reads only the global boundaries)."""
        device = resolved.cu_seqlens.device

        def build() -> tuple[ScanRows, RecomputedPrefix] | None:
            prefix = recomputed_prefix(resolved.host, cp.size, cp.rank, self.max_recomputed_prefix)
            if prefix is None:
                return None
            return self.scan_rows(np.asarray(prefix.cu_seqlens, dtype=np.int64), device), prefix

        key = (cp.size, cp.rank, str(device), self.max_recomputed_prefix)
        alone = per_micro_batch(psp, "gdn_slice_scanned_alone", key, (resolved.cu_seqlens,), build)
        return alone if alone is not None else (self.rows(psp, resolved, cp.group), None)

    def zigzag_rows(self, psp: PackedSeqParams, resolved, cp: CPGroup) -> ScanRows:
        """The whole one-document stream for FLA's native zigzag CP (``GDNOptions.fla_zigzag_cp``):
        this rank's zigzag rows are its parts of it, FLA passes the state along the chain."""
        device = resolved.cu_seqlens.device
        whole = np.array([0, int(resolved.host[-1])], dtype=np.int64)  # empty padding slots dropped
        return per_micro_batch(
            psp,
            "gdn_zigzag_scan_rows",
            (id(cp.group), str(device)),
            (resolved.cu_seqlens,),
            lambda: self.scan_rows(whole, device, cp.group, cp_layout="zigzag"),
        )


def with_recomputed_prefix(x: torch.Tensor, prefix: RecomputedPrefix | None, cp: CPGroup) -> torch.Tensor:
    """This rank's contiguous rows ``x`` with the previous rank's part of their first sequence in
    front (one collective, skipped when no rank has a prefix: a fact every rank shares)."""
    if prefix is None or not prefix.any_rank_has_one:
        return x
    # Concatenated even where nothing came (recv == 0): that keeps the exchange in this rank's
    # graph, so its backward, a collective the other ranks join, runs here too.
    return torch.cat([last_rows_to_next_rank(x, prefix.send, prefix.recv, cp.group), x])


__all__ = ["GDNRowPlans", "with_recomputed_prefix"]
