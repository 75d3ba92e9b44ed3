"""Megatron-Core's ``GatedDeltaNet`` with a context-parallel mode chosen by configuration.

Same parameters and state_dict as ``megatron.core.ssm.gated_delta_net.GatedDeltaNet`` in every
mode (checkpoints move freely between modes); only ``forward`` differs. Per micro-batch:

* the CP group comes from ``relax_gdn.parallel.resolve_cp_group`` (static or dynamic CP);
* the packed boundaries are checked once (``resolve_cu_seqlens``), routes and row maps are built
  once (``get_route`` / ``per_micro_batch``), all from host copies: zero host syncs per layer;
* CP = 1 means no conversion and no collective in any mode.

Modes (docs/design/LAYOUTS.md §4):

``headwise``   all-to-all from the zigzag sequence split to a head split, every rank scans the
               whole sequence for 1/W of the heads, all-to-all back (Megatron-Core's scheme).
``chunkwise``  zigzag -> contiguous swap, conv + scan of the contiguous slice with ALL heads,
               recurrent state and conv halo passed between ranks (none when every rank cut
               falls on a sequence boundary: then each slice is scanned alone; none either,
               when enabled, if every crossing sequence has a short prefix before the cut:
               the next rank receives and recomputes it), contiguous -> zigzag swap.
               Without sequence parallelism the swap moves the hidden states BEFORE in_proj
               (4096 wide for Qwen3.5) instead of its 12352-wide output. Built with
               ``hidden_layout="contiguous"`` the layer takes and returns contiguous rows and
               swaps nothing: the model keeps its residual stream contiguous through a run of
               GDN layers and converts it with :meth:`CPGatedDeltaNet.convert_hidden_layout`
               (``relax_gdn.model.gdn_runs``). With ``GDNOptions.fla_zigzag_cp`` (an A/B) a
               micro-batch of ONE document is scanned on its zigzag rows by FLA's native
               zigzag CP, without swaps.
``all_gather`` every rank gathers the whole sequence and recomputes conv + scan for it, keeping
               its own rows (needs whole-layer recompute when training: memory grows with T).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.utils.checkpoint
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.gated_delta_net.common import (
    GatedDeltaNetSubmodules,
    _build_head_perm_for_split_sections,
    tensor_a2a_cp2hp,
    tensor_a2a_hp2cp,
)
from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from relax_gdn.gdn.kernels import GateInputs, ScanRows, select_kernels
from relax_gdn.gdn.options import GDNOptions, all_gather_recompute_problem, gdn_cp_problems
from relax_gdn.gdn.row_plans import GDNRowPlans, with_recomputed_prefix
from relax_gdn.layout import (
    LAYOUTS,
    cached_gathered_zigzag_order,
    resolve_cu_seqlens,
    swap_layout,
)
from relax_gdn.layout.collectives import all_gather_rows
from relax_gdn.parallel import CPGroup, resolve_cp_group


def check_gdn_cp_config(
    config: TransformerConfig, options: GDNOptions, tp_size: int, max_cp_size: int
) -> None:
    """Refuse impossible combinations before anything is built (``gdn_cp_problems``, the rules the
    run configuration is validated with); the message names the setting to fix."""
    problems = gdn_cp_problems(
        options,
        key_heads=config.linear_num_key_heads,
        value_heads=config.linear_num_value_heads,
        tp_size=tp_size,
        max_cp_size=max_cp_size,
        deterministic=config.deterministic_mode,
        recompute_granularity=config.recompute_granularity,
    )
    if problems:
        raise ValueError("; ".join(problems))


def _head_share(param: torch.Tensor, sections: list[int], parts: int, part: int) -> torch.Tensor:
    """Rows of ``param`` (dim 0) for head group ``part`` of ``parts`` in each section."""
    if parts == 1:
        return param
    return torch.cat([s.chunk(parts)[part] for s in param.split(sections)])


class CPGatedDeltaNet(GatedDeltaNet):
    """``GatedDeltaNet`` whose context parallelism is ``cp_mode`` (see the module docstring); every
    choice it makes is in the ``options`` it is built with."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GatedDeltaNetSubmodules,
        *args,
        options: GDNOptions = GDNOptions(),
        hidden_layout: str = "zigzag",
        **kwargs,
    ):
        super().__init__(config, submodules, *args, **kwargs)
        check_gdn_cp_config(config, options, self.tp_size, options.max_cp_size or self.cp_size)
        if hidden_layout not in LAYOUTS:
            raise ValueError(f"unknown GDN hidden_layout {hidden_layout!r}: use one of {LAYOUTS}")
        if hidden_layout == "contiguous" and (options.cp_mode != "chunkwise" or self.sp_size > 1):
            raise ValueError(
                "GDN hidden_layout='contiguous' needs gdn.cp_mode=chunkwise without sequence parallelism "
                f"(got cp_mode={options.cp_mode!r}, sequence-parallel size {self.sp_size}); build it with 'zigzag'"
            )
        self.options = options
        self.cp_mode = options.cp_mode
        # the routes and the kernels' row boundaries, built once per micro-batch
        self.row_plans = GDNRowPlans(self.conv_kernel_dim, options.route, options.max_recomputed_prefix)
        # Selective recompute of the cheap, activation-heavy middle (conv -> gates -> scan -> gated
        # norm): only the in_proj output is kept; q/k/v, the gate copy and the norm's input are
        # recomputed in backward (recompute.modules: gdn_core).
        self.recompute_core = options.recompute_core
        # The layout of this rank's rows of ``hidden_states`` in and out of ``forward`` when CP > 1:
        # "zigzag" (what attention uses; chunkwise swaps around its scan) or "contiguous" (the
        # caller keeps the residual stream in the scan's layout; no swap here).
        self.hidden_layout = hidden_layout

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        inference_context=None,
        packed_seq_params: PackedSeqParams | None = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("GDN inference is not supported (same as Megatron-Core 0.19.2)")
        cp = resolve_cp_group(packed_seq_params, self.pg_collection.cp)
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if not packed:
            if cp.size > 1:
                raise ValueError(
                    f"GDN with CP={cp.size} needs packed (thd) micro-batches; pack the data "
                    "(data.packing) or run with parallel.cp=1"
                )
            return self._forward_local(hidden_states, None)
        if hidden_states.shape[1] != 1:
            raise ValueError(
                f"packed (thd) input must have batch 1, got hidden_states {tuple(hidden_states.shape)}"
            )
        seq_len = hidden_states.shape[0] * self.sp_size * cp.size
        resolved = resolve_cu_seqlens(packed_seq_params, seq_len, cp.size)
        if cp.size == 1:
            return self._forward_local(hidden_states, self.row_plans.rows(packed_seq_params, resolved, None))
        if self.cp_mode == "chunkwise":
            return self._forward_chunkwise(hidden_states, packed_seq_params, resolved, cp)
        if self.cp_mode == "headwise":
            return self._forward_headwise(hidden_states, packed_seq_params, resolved, cp)
        if torch.is_grad_enabled() and (
            problem := all_gather_recompute_problem(self.config.recompute_granularity)
        ):
            raise ValueError(problem)
        return self._forward_all_gather(hidden_states, packed_seq_params, resolved, cp)

    def convert_hidden_layout(
        self, hidden_states: torch.Tensor, packed_seq_params: PackedSeqParams | None, source: str, target: str
    ) -> torch.Tensor:
        """``hidden_states`` (this rank's rows of the micro-batch, ``[s, b, h]``) moved from layout
        ``source`` to ``target`` with the micro-batch's cached route (autograd-aware; zero host
        syncs). Returns the input itself when the micro-batch runs at CP = 1 or is not packed."""
        cp = resolve_cp_group(packed_seq_params, self.pg_collection.cp)
        if cp.size == 1 or packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return hidden_states  # (unpacked input at CP > 1 is refused by forward)
        resolved = resolve_cu_seqlens(
            packed_seq_params, hidden_states.shape[0] * self.sp_size * cp.size, cp.size
        )
        route = self.row_plans.route(packed_seq_params, resolved, cp, hidden_states.device, source, target)
        return swap_layout(hidden_states, route, cp.group, 0, self.options.swap_transport)

    def _forward_local(self, hidden_states, rows: ScanRows | None):
        qkvzba, _ = self.in_proj(hidden_states)
        return self.out_proj(self._core(qkvzba, rows, parts=1, part=0))

    def _forward_chunkwise(self, hidden_states, psp, resolved, cp: CPGroup):
        if self.hidden_layout == "zigzag" and self._scans_zigzag_rows(resolved, hidden_states.device):
            return self._forward_zigzag_scan(hidden_states, psp, resolved, cp)
        rows, prefix = self.row_plans.contiguous_rows(psp, resolved, cp)
        route = (
            None
            if self.hidden_layout == "contiguous"
            else self.row_plans.route(psp, resolved, cp, hidden_states.device)
        )
        transport = self.options.swap_transport
        if route is None:  # the rows already are this rank's contiguous slice
            qkvzba, _ = self.in_proj(with_recomputed_prefix(hidden_states, prefix, cp))
        elif self.sp_size == 1:  # projections are per token: swap the narrower input instead
            qkvzba, _ = self.in_proj(
                with_recomputed_prefix(swap_layout(hidden_states, route, cp.group, 0, transport), prefix, cp)
            )
        else:
            qkvzba, _ = self.in_proj(hidden_states)
            qkvzba = with_recomputed_prefix(swap_layout(qkvzba, route, cp.group, 0, transport), prefix, cp)
        core = self._core(qkvzba, rows, parts=1, part=0)
        if prefix is not None and prefix.recv:
            core = core[prefix.recv :]  # the recomputed rows belong to the previous rank
        if route is None:
            return self.out_proj(core)
        return self.out_proj(swap_layout(core, route.reverse(), cp.group, 0, transport))

    def _scans_zigzag_rows(self, resolved, device: torch.device) -> bool:
        """FLA's native zigzag CP (``GDNOptions.fla_zigzag_cp``, an A/B) on a micro-batch of one
        document: only then are its zigzag parts of the whole stream the data's zigzag rows."""
        return select_kernels(self.options, device).zigzag_cp and one_document(resolved.host)

    def _forward_zigzag_scan(self, hidden_states, psp, resolved, cp: CPGroup):
        """Conv + scan of this rank's zigzag rows of a one-document micro-batch, no swap: FLA
        passes the state along its chain of 2W parts (rank fronts ascending, backs descending)."""
        rows = self.row_plans.zigzag_rows(psp, resolved, cp)
        qkvzba, _ = self.in_proj(hidden_states)
        return self.out_proj(self._core(qkvzba, rows, parts=1, part=0))

    def _forward_headwise(self, hidden_states, psp, resolved, cp: CPGroup):
        qkvzba, _ = self.in_proj(hidden_states)
        # Group each section's heads by destination rank so ONE all-to-all does every section.
        head_perm = _build_head_perm_for_split_sections(
            tuple(self.in_proj_split_sections), cp.size, qkvzba.device
        )
        qkvzba = tensor_a2a_cp2hp(
            qkvzba.index_select(-1, head_perm),
            seq_dim=0,
            head_dim=-1,
            cp_group=cp.group,
            undo_attention_load_balancing=False,
        )
        order = cached_gathered_zigzag_order(psp, resolved, cp.size, resolved.cu_seqlens.device)
        qkvzba = qkvzba.index_select(0, order.natural_rows)
        core = self._core(qkvzba, self.row_plans.rows(psp, resolved, None), parts=cp.size, part=cp.rank)
        core = core.index_select(0, order.rank_major_rows)
        norm_out = tensor_a2a_hp2cp(
            core, seq_dim=0, head_dim=-1, cp_group=cp.group, redo_attention_load_balancing=False
        )
        return self.out_proj(norm_out)

    def _forward_all_gather(self, hidden_states, psp, resolved, cp: CPGroup):
        qkvzba, _ = self.in_proj(hidden_states)
        order = cached_gathered_zigzag_order(psp, resolved, cp.size, resolved.cu_seqlens.device)
        gathered = all_gather_rows(qkvzba, cp.group)  # rank-major [T, 1, D]
        core = self._core(
            gathered.index_select(0, order.natural_rows), self.row_plans.rows(psp, resolved, None), 1, 0
        )
        return self.out_proj(core.index_select(0, order.own_rows(cp.rank)))

    # ------------------------------------------------------------------ the math, any split

    def _apply_gated_norm(self, x, gate):
        # The out_norm's one-kernel gated form where it has one (relax_gdn's RMSNorm on CUDA),
        # else Megatron-Core's norm-then-gate.
        forward_gated = getattr(self.out_norm, "forward_gated", None)
        if forward_gated is not None and self.act_fn is torch.nn.functional.silu:
            fused = forward_gated(x.reshape(-1, x.shape[-1]), gate.reshape(-1, gate.shape[-1]))
            if fused is not None:
                return fused
        return super()._apply_gated_norm(x, gate)

    def _core(self, qkvzba: torch.Tensor, rows: ScanRows | None, parts: int, part: int) -> torch.Tensor:
        # never inside a whole-layer recompute (full, or a full layer of mixed): nothing to save there
        if self.recompute_core and torch.is_grad_enabled() and not is_checkpointing():
            return torch.utils.checkpoint.checkpoint(
                self._core_body, qkvzba, rows, parts, part, use_reentrant=False
            )
        return self._core_body(qkvzba, rows, parts, part)

    def _core_body(self, qkvzba: torch.Tensor, rows: ScanRows | None, parts: int, part: int) -> torch.Tensor:
        """conv -> gated delta rule -> gated norm for the heads of share ``part`` of ``parts``.

        ``qkvzba [S, B, D/parts]`` (sections q, k, v, z, beta, alpha, each 1/parts of this TP
        rank's heads); returns ``[S, B, v_dim/(tp*parts)]``.
        """
        seq, batch, _ = qkvzba.shape
        qk, v_dim, hv = (
            self.qk_dim_local_tp // parts,
            self.v_dim_local_tp // parts,
            self.num_v_heads_local_tp // parts,
        )
        x = qkvzba.transpose(0, 1)  # [B, S, D]
        query, key, value, gate, beta, alpha = torch.split(x, [qk, qk, v_dim, v_dim, hv, hv], dim=-1)

        conv_sections = [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp]
        weight = _head_share(self.conv1d.weight, conv_sections, parts, part).squeeze(1)
        bias = _head_share(self.conv1d.bias, conv_sections, parts, part) if self.conv_bias else None
        kernels = select_kernels(self.options, qkvzba.device)
        rows = rows or ScanRows(None, None)
        # The depthwise conv once per section, on the strided views of the in_proj output: each
        # output is the contiguous tensor the scan takes: no copy of a joint qkv, none of q, k, v
        # out of it, no concatenation of their gradients (per q/k/v value and token: 8 bytes of
        # memory traffic less in forward, 4 in backward).
        sections = [qk, qk, v_dim]
        weights = weight.split(sections)
        biases = bias.split(sections) if bias is not None else (None,) * 3
        query, key, value = (
            kernels.conv(t, w, b, rows) for t, w, b in zip((query, key, value), weights, biases)
        )
        query = query.reshape(batch, seq, -1, self.key_head_dim)
        key = key.reshape(batch, seq, -1, self.key_head_dim)
        value = value.reshape(batch, seq, -1, self.value_head_dim)
        decay = GateInputs(
            alpha=alpha,
            a_log=_head_share(self.A_log, [self.A_log.shape[0]], parts, part),
            dt_bias=_head_share(self.dt_bias, [self.dt_bias.shape[0]], parts, part),
        )
        # GVA is native in both backends (value head j reads key head j // (HV/H)), and q/k are
        # L2-normalised inside the kernel: no repeat_interleave or separate l2norm pass.
        out = kernels.scan(query, key, value, decay, beta.sigmoid(), rows, self.use_qk_l2norm)
        norm = self._apply_gated_norm(out, gate.reshape(batch, seq, -1, self.value_head_dim))
        return with_standard_strides(norm.reshape(batch, seq, -1).transpose(0, 1))


def with_standard_strides(x: torch.Tensor) -> torch.Tensor:
    """``x`` laid out as a fresh tensor of its shape (a view where that needs no copy). The input of
    a projection must be: a ``[S, 1, D]`` transposed from ``[1, S, D]`` counts as contiguous (a
    size-1 dim's stride does not matter) but keeps the stride ``S*D`` there, and torch < 2.12's
    matmul then runs ``x @ W.t()`` of a weight that does not train (LoRA's frozen base) as S
    one-row GEMMs instead of one (pytorch#186148)."""
    return x.reshape(-1, x.shape[-1]).view(x.shape)


def one_document(cu_host: np.ndarray) -> bool:
    """Do the packed boundaries hold exactly one non-empty document (empty padding slots aside)?"""
    return int(np.count_nonzero(np.diff(cu_host))) == 1


def gdn_cp_layer_spec(
    options: GDNOptions,
    in_proj=None,
    out_norm=None,
    out_proj=None,
    hidden_layout: str = "zigzag",
) -> ModuleSpec:
    """A ModuleSpec for the CP-mode GDN told ``options`` (local Megatron-Core linears and norm
    unless given; ``hidden_layout``: see :class:`CPGatedDeltaNet`)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return ModuleSpec(
        module=CPGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=in_proj or ColumnParallelLinear,
            out_norm=out_norm or WrappedTorchNorm,
            out_proj=out_proj or RowParallelLinear,
        ),
        params={"options": options, "hidden_layout": hidden_layout},
    )
