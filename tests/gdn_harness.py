"""Shared set-up for GDN layer tests (CPU gloo and GPU NCCL): config, layer, packed batches, parity."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import build_module

from relax_gdn.gdn.layer import gdn_cp_layer_spec
from relax_gdn.gdn.options import GDNOptions
from relax_gdn.layout import attach_host_cu_seqlens, prebuild_routes, thd_rank_indices

# documents of different lengths (multiples of 8 = 2W for W <= 4), an empty padding slot,
# and one long document that spans several ranks in the contiguous layout
PACKED = [0, 24, 24, 88, 96, 160]


def tiny_config(**overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=1, hidden_size=32, num_attention_heads=4, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, normalization="RMSNorm", use_cpu_initialization=True,
        activation_func=F.silu, recompute_granularity="full", recompute_method="uniform",
        recompute_num_layers=1, hidden_dropout=0.0, attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def self_group() -> dist.ProcessGroup:
    """A size-1 group per rank (every rank must create every group, in the same order)."""
    mine = None
    for r in range(dist.get_world_size()):
        g = dist.new_group([r])
        if r == dist.get_rank():
            mine = g
    return mine


def build_gdn(config, cp_group, tp_group, cp_mode="chunkwise", hidden_layout="zigzag", **options):
    spec = gdn_cp_layer_spec(GDNOptions(cp_mode=cp_mode, **options), hidden_layout=hidden_layout)
    pgs = ProcessGroupCollection(tp=tp_group, cp=cp_group)
    return build_module(spec, config=config, layer_number=1, pg_collection=pgs)


def packed_params(cu: list[int], device, cp_group=None, local_cp_size=None, host_copy=True) -> PackedSeqParams:
    t = torch.tensor(cu, dtype=torch.int32, device=device)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t, cu_seqlens_q_padded=t, cu_seqlens_kv_padded=t,
        max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])), max_seqlen_kv=max(b - a for a, b in zip(cu, cu[1:])),
        cp_group=cp_group, local_cp_size=local_cp_size,
    )
    if host_copy:
        attach_host_cu_seqlens(psp, t, cu)
    return psp


def reference_run(layer, x, weight, psp):
    """Output, input grad and param grads of the single-rank layer on the whole batch."""
    x = x.clone().requires_grad_(True)
    out, _ = layer(x, None, packed_seq_params=psp)
    (out * weight).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def cp_run(layer, x, weight, psp, cp_size, cp_rank, cp_group, cu=PACKED, prebuild=False):
    """The same on this rank's zigzag shard; param grads summed over the CP group."""
    ids = thd_rank_indices(cu, cp_size, cp_rank, "zigzag").to(x.device)
    if prebuild:
        prebuild_routes(psp, cp_group)
    x_local = x[ids].clone().requires_grad_(True)
    out, _ = layer(x_local, None, packed_seq_params=psp)
    (out * weight[ids]).sum().backward()
    grads = {}
    for n, p in layer.named_parameters():
        g = p.grad.clone()
        if cp_size > 1:
            dist.all_reduce(g, group=cp_group)
        grads[n] = g
    layer.zero_grad(set_to_none=True)
    return out.detach(), x_local.grad, grads, ids


def max_errors(ref, got, ids) -> dict[str, float]:
    ref_out, ref_dx, ref_grads = ref
    out, dx, grads, _ = got
    errors = {"out": (out - ref_out[ids]).abs().max().item(), "dx": (dx - ref_dx[ids]).abs().max().item()}
    for n, g in ref_grads.items():
        errors[n] = (grads[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-6)
    return errors
