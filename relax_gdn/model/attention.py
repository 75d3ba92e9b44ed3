"""Core attention for packed (THD) micro-batches sharded zigzag across CP ranks, without Transformer
Engine: a drop-in for ``SelfAttentionSubmodules.core_attention``.

Megatron-Core's local ``DotProductAttention`` refuses CP and packed input. Here every rank holds
chunks ``r`` and ``2W-1-r`` of every document (docs/design/LAYOUTS.md §1), so:

1. All-gather K and V over the CP group (one collective; its backward is a reduce-scatter SUM).
2. Each local query attends to the keys of its own document up to its own GLOBAL position.

Step 2 runs one of several kernels (:mod:`relax_gdn.model.attention_kernels` says what each is and
needs): ``sdpa`` (dense masked ``scaled_dot_product_attention``, the reference on any device),
``varlen`` (torch's FlashAttention-2), ``flex`` (FlexAttention with a block mask), ``fa4``
(FlashAttention-4); ``auto`` picks one. The flash kernels run
``varlen`` segments: each (document, local chunk) is one query segment whose keys are the
document's gathered keys from its start to the END of that chunk. Flash attention aligns the
causal mask bottom-right when a segment has fewer queries than keys, so query ``i`` of a chunk of
``c`` tokens sees ``k_len - c + i + 1`` keys: exactly the document prefix up to its own global
position. Queries and outputs stay in local storage order; only keys/values are copied into
segments.

Everything the kernels need (gather order, positions, segment boundaries) is host integer work on
the global boundaries, done once per micro-batch and cached on its ``PackedSeqParams`` with the
same provenance rule as the layout routes (``relax_gdn.layout.per_micro_batch``); with the data
side's host copy of ``cu_seqlens`` attached, a forward issues no device->host sync.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from relax_gdn.choices import ATTENTION_BACKENDS
from relax_gdn.layout import (
    GatheredOrder,
    cached_gathered_zigzag_order,
    gathered_zigzag_order,
    per_micro_batch,
    resolve_cu_seqlens,
    validated_boundaries,
)
from relax_gdn.layout.collectives import all_gather_rows
from relax_gdn.layout.partition import CuSeqlens
from relax_gdn.layout.route import expand_runs, upload_rows
from relax_gdn.model.attention_kernels import (
    KERNELS,
    DenseIndex,
    VarlenSegments,
    build_flex_block_mask,
    choose_backend,
    varlen_unsupported_reason,
)
from relax_gdn.parallel import resolve_cp_group

# ATTENTION_BACKENDS (relax_gdn.choices): ``auto`` is attention_kernels.AUTO_ATTENTION_BACKEND where it
# applies, else ``varlen`` where it applies (CUDA, fp16/bf16, head dim <= 256), else ``sdpa``.

_PLAN_CACHE_NAME = "zigzag_attention_plan"
_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


# ---------------------------------------------------------------------------------------------
# The per-micro-batch plan (host integer work, uploaded once)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ZigzagAttentionPlan:
    """Index tensors for one rank's zigzag shard of one packed micro-batch.

    Built from host boundaries; each kernel's part is uploaded to ``device`` on first use and then
    kept, so a cached plan serves every attention layer and recompute of the micro-batch.
    """

    cu_seqlens: np.ndarray  # validated global boundaries (host)
    cp_size: int
    cp_rank: int
    device: torch.device
    order: GatheredOrder  # rank-major <-> natural row maps of the gathered batch (device)

    @property
    def total_rows(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def local_rows(self) -> int:
        return self.total_rows // self.cp_size

    def documents(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, length) of every non-empty document (repeated boundaries are empty slots)."""
        lengths = np.diff(self.cu_seqlens)
        keep = lengths > 0
        return self.cu_seqlens[:-1][keep], lengths[keep]

    @functools.cached_property
    def dense_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host copies of :attr:`dense`'s ``(q_pos, q_start, k_pos)``."""
        starts, lengths = self.documents()
        # A rank holds L/W rows of every document, stored document by document.
        q_start = np.repeat(starts, lengths // self.cp_size)
        k_pos = self.order.rank_major_host
        if k_pos is None:  # an order built elsewhere without its host copy: rebuild it on the host
            k_pos = gathered_zigzag_order(self.cu_seqlens, self.cp_size, "cpu").rank_major_host
        q_pos = k_pos[self.cp_rank * self.local_rows : (self.cp_rank + 1) * self.local_rows]
        return q_pos, q_start, k_pos

    @functools.cached_property
    def dense(self) -> DenseIndex:
        return DenseIndex(
            q_pos=self.order.own_rows(self.cp_rank),
            q_start=upload_rows(self.dense_host[1], self.device, torch.long),
            k_pos=self.order.rank_major_rows,
        )

    @functools.cached_property
    def flex_block_mask(self):
        """FlexAttention's ``BlockMask`` for this rank (tiles classified on the host)."""
        return build_flex_block_mask(*self.dense_host, self.dense, self.device)

    @functools.cached_property
    def varlen(self) -> VarlenSegments:
        world, rank = self.cp_size, self.cp_rank
        starts, lengths = self.documents()
        if world == 1:  # one segment per document; the keys are the local keys as they are
            q_lens = k_lens = lengths
            key_rows = None
        else:
            chunk = lengths // (2 * world)
            # Local chunk 0 is global chunk r, local chunk 1 is global chunk 2W-1-r; each sees the
            # document's keys from its start to the end of that chunk.
            q_lens = np.stack([chunk, chunk], axis=1).reshape(-1)
            k_lens = np.stack([(rank + 1) * chunk, (2 * world - rank) * chunk], axis=1).reshape(-1)
            key_ids = upload_rows(expand_runs(np.repeat(starts, 2), k_lens), self.device, torch.long)
            key_rows = self.order.natural_rows.index_select(0, key_ids)  # natural -> rank-major row
        zero = np.zeros(1, dtype=np.int64)
        return VarlenSegments(
            cu_q=upload_rows(np.concatenate([zero, np.cumsum(q_lens)]), self.device, torch.int32),
            cu_k=upload_rows(np.concatenate([zero, np.cumsum(k_lens)]), self.device, torch.int32),
            key_rows=key_rows,
            max_q=int(q_lens.max()) if q_lens.size else 0,
            max_k=int(k_lens.max()) if k_lens.size else 0,
        )


def build_zigzag_attention_plan(
    cu_seqlens: CuSeqlens,
    cp_size: int,
    cp_rank: int,
    device: torch.device | str | None = None,
    *,
    order: GatheredOrder | None = None,
) -> ZigzagAttentionPlan:
    """Plan for rank ``cp_rank`` of ``cp_size`` on global boundaries ``cu_seqlens`` (pass a HOST
    copy to avoid a sync). ``order``: the batch's ``gathered_zigzag_order`` if already built.
    Raises ``ValueError`` on boundaries the zigzag layout cannot split."""
    cu = validated_boundaries(cu_seqlens, cp_size, cp_rank, "zigzag")
    if device is None:
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # compare equal to the tensors' device
        device = torch.device("cuda", torch.cuda.current_device())
    if order is None:
        order = gathered_zigzag_order(cu, cp_size, device)
    return ZigzagAttentionPlan(cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_rank, device=device, order=order)


def zigzag_attention_plan(
    packed_seq_params: PackedSeqParams, local_rows: int, cp_size: int, cp_rank: int, device: torch.device
) -> ZigzagAttentionPlan:
    """The plan for this micro-batch, built once and cached on ``packed_seq_params``.

    Boundaries are the padded ones if set, else the actual ones, checked (q == kv, last boundary ==
    ``local_rows * cp_size``, 2W divisibility) by the same once-per-micro-batch resolver as GDN.
    The gathered order is cached under the name and key the GDN layer uses, so both share it.
    """
    psp = packed_seq_params
    resolved = resolve_cu_seqlens(psp, local_rows * cp_size, cp_size)
    depends_on = (resolved.cu_seqlens,)

    def build() -> ZigzagAttentionPlan:
        order = cached_gathered_zigzag_order(psp, resolved, cp_size, device)
        return build_zigzag_attention_plan(resolved.host, cp_size, cp_rank, device, order=order)

    return per_micro_batch(psp, _PLAN_CACHE_NAME, (cp_size, cp_rank, str(device)), depends_on, build)


# ---------------------------------------------------------------------------------------------
# The per-rank kernels
# ---------------------------------------------------------------------------------------------


def attend_zigzag_shard(
    query: torch.Tensor,
    key_all: torch.Tensor,
    value_all: torch.Tensor,
    plan: ZigzagAttentionPlan,
    *,
    softmax_scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-rank core: this rank's zigzag queries ``[T/W, Hq, D]`` against EVERY rank's keys and
    values, rank-major ``[T, Hkv, D]`` (what :func:`all_gather_rows` returns). Returns
    ``[T/W, Hq, D]`` in local order. ``backend``: one of :data:`ATTENTION_BACKENDS`."""
    if query.dim() != 3 or key_all.dim() != 3 or value_all.shape[:2] != key_all.shape[:2]:
        raise ValueError(
            "attend_zigzag_shard expects query [T/W, Hq, D] and key/value [T, Hkv, D], got "
            f"{tuple(query.shape)}, {tuple(key_all.shape)}, {tuple(value_all.shape)}"
        )
    if query.shape[0] != plan.local_rows or key_all.shape[0] != plan.total_rows:
        raise ValueError(
            f"the plan (cu_seqlens[-1]={plan.total_rows}, cp_size={plan.cp_size}) expects "
            f"{plan.local_rows} local query rows and {plan.total_rows} gathered key rows, got "
            f"{query.shape[0]} and {key_all.shape[0]}; was it built for this micro-batch?"
        )
    if query.shape[1] % key_all.shape[1]:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key_all.shape[1]})"
        )
    if query.device != plan.device:
        raise ValueError(f"query is on {query.device} but the plan's index tensors are on {plan.device}")
    backend = choose_backend(backend, query)
    if plan.total_rows == 0:
        return query.clone()
    return KERNELS[backend](query, key_all, value_all, plan, softmax_scale)


def zigzag_cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: ZigzagAttentionPlan,
    cp_group: dist.ProcessGroup | None,
    *,
    softmax_scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of this rank's zigzag shard ``[T/W, H, D]`` (q, k, v) within documents,
    by global position: all-gather K/V over ``cp_group``, then :func:`attend_zigzag_shard`."""
    world = 1 if cp_group is None else cp_group.size()
    if world != plan.cp_size:
        raise ValueError(f"the plan is for cp_size={plan.cp_size} but the CP group has {world} ranks")
    if plan.cp_size == 1 or plan.total_rows == 0:  # every rank agrees: no collective at all
        return attend_zigzag_shard(query, key, value, plan, softmax_scale=softmax_scale, backend=backend)
    if key.shape == value.shape:  # one collective for both
        kv = all_gather_rows(torch.stack((key, value), dim=1), cp_group)
        key_all, value_all = kv[:, 0], kv[:, 1]
    else:
        key_all, value_all = all_gather_rows(key, cp_group), all_gather_rows(value, cp_group)
    return attend_zigzag_shard(query, key_all, value_all, plan, softmax_scale=softmax_scale, backend=backend)


# ---------------------------------------------------------------------------------------------
# The Megatron-Core module
# ---------------------------------------------------------------------------------------------


class CPDotProductAttention(MegatronModule):
    """``core_attention`` for ``SelfAttention`` that handles packed THD input sharded zigzag over
    CP (any CP size, including dynamic CP through ``PackedSeqParams.cp_group``), and plain causal
    ``sbhd`` input without CP. Same constructor and forward as Megatron-Core's
    ``DotProductAttention``, plus ``backend`` (one of :data:`ATTENTION_BACKENDS`).

    ``cp_comm_type`` is accepted and ignored: K/V always travel by one all-gather. The output gate
    (``attention_output_gate``), projections and RoPE stay in ``SelfAttention``.

    In a spec::

        SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=CPDotProductAttention,  # or, pinning the kernel:
            # ModuleSpec(module=CPDotProductAttention, params={"backend": "sdpa"}),
            linear_proj=RowParallelLinear,
            ...
        )
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        backend: str = "auto",
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}: use one of {ATTENTION_BACKENDS}")
        self.backend = backend
        if attention_type != "self":
            raise ValueError(
                f"CPDotProductAttention does self-attention only, got attention_type={attention_type!r}"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"CPDotProductAttention has no attention dropout (got {dropout}); "
                "set TransformerConfig.attention_dropout=0.0"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"CPDotProductAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError(
                f"CPDotProductAttention has no sliding-window attention (window_size={config.window_size})"
            )

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = getattr(pg_collection, "tp", None)
        tp_size = 1 if self.tp_group is None else self.tp_group.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        # apply_query_key_layer_scaling divides the scale by layer_number and the fused softmax
        # multiplies it back (an fp16 overflow guard), so the effective scale is this one.
        if softmax_scale is None:  # SelfAttention passes config.softmax_scale; direct callers may not
            softmax_scale = config.softmax_scale
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """THD: q ``[t, np, hn]``, k/v ``[t, ng, hn]`` -> ``[t, np*hn]``.
        SBHD: q ``[s, b, np, hn]``, k/v ``[s, b, ng, hn]`` -> ``[s, b, np*hn]``."""
        if attention_bias is not None:
            raise ValueError("CPDotProductAttention does not take attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        cp = resolve_cp_group(packed_seq_params, getattr(self.pg_collection, "cp", None))
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if mask_type not in _CAUSAL_TYPES:
                raise ValueError(
                    f"packed (thd) attention is causal within documents; got attn_mask_type={mask_type}"
                )
            if query.dim() != 3:
                raise ValueError(
                    f"packed (thd) query must be [t, heads, dim], got shape {tuple(query.shape)}"
                )
            plan = zigzag_attention_plan(packed_seq_params, query.shape[0], cp.size, cp.rank, query.device)
            out = zigzag_cp_attention(
                query, key, value, plan, cp.group, softmax_scale=self.softmax_scale, backend=self.backend
            )
            return out.flatten(1)  # [t, np * hn]
        if cp.size != 1:
            raise ValueError(
                "CPDotProductAttention needs packed (thd) input for context parallelism "
                f"(cp_size={cp.size}); "
                "pass PackedSeqParams(qkv_format='thd', cu_seqlens_q=...) or use CP = 1"
            )
        return self._sbhd_attention(query, key, value, attention_mask, mask_type)

    def _sbhd_attention(self, query, key, value, attention_mask, mask_type) -> torch.Tensor:
        if query.dim() != 4:
            raise ValueError(f"sbhd query must be [s, b, heads, dim], got shape {tuple(query.shape)}")
        causal = mask_type in _CAUSAL_TYPES
        mask = None
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError(
                    f"attention_mask must be boolean (True = masked out), got {attention_mask.dtype}"
                )
            mask = ~attention_mask  # Megatron: True = masked out; SDPA: True = attend
            if causal:
                sq, sk = query.shape[0], key.shape[0]
                mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril()
                causal = False
        out = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3),  # [b, np, s, hn]
            key.permute(1, 2, 0, 3),
            value.permute(1, 2, 0, 3),
            attn_mask=mask,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=query.shape[2] != key.shape[2],
        )
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


__all__ = [
    "ATTENTION_BACKENDS",
    "CPDotProductAttention",
    "DenseIndex",
    "VarlenSegments",
    "ZigzagAttentionPlan",
    "all_gather_rows",
    "attend_zigzag_shard",
    "build_zigzag_attention_plan",
    "varlen_unsupported_reason",
    "zigzag_attention_plan",
    "zigzag_cp_attention",
]
