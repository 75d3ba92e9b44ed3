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
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        activation_func=F.silu,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
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


def packed_params(
    cu: list[int], device, cp_group=None, local_cp_size=None, host_copy=True
) -> PackedSeqParams:
    t = torch.tensor(cu, dtype=torch.int32, device=device)
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=t,
        cu_seqlens_kv=t,
        cu_seqlens_q_padded=t,
        cu_seqlens_kv_padded=t,
        max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
        max_seqlen_kv=max(b - a for a, b in zip(cu, cu[1:])),
        cp_group=cp_group,
        local_cp_size=local_cp_size,
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


# ---------------------------------------------------------------------------------------------
# GPU (NCCL, FLA kernels): Qwen3.5-9B head shapes
# ---------------------------------------------------------------------------------------------

# max error / max |reference| vs the fp32 torch reference. fp32 is not exact either: FLA's
# kernels multiply fp32 operands in TF32 (10-bit mantissa), and its CP merges in TF32x3.
TOLERANCE = {torch.bfloat16: 5e-2, torch.float32: 5e-2}
# Every mode against all_gather (FLA on the whole sequence): the CP machinery itself.
CP_TOLERANCE = {torch.bfloat16: 5e-2, torch.float32: 1e-3}
# Measured on 2 x H200 (2026-11-30): with fp32 inputs FLA's gate gradients miss the torch
# reference by 46 % (A_log) and 23 % (dt_bias) of their largest value, identically in every
# mode (to 2e-6), while out, dx and the other gradients stay within 3.7 % (bf16: 1 %). The fp32
# reference is right (3e-5 off an fp64 one); the error is in FLA's scan backward, not its conv
# and not CP, and survives exact fp32 Triton products: see relax_gdn.gdn.kernels.
# fla_fp32_gradient_caveat and relax_gdn.bench.gdn_precision. In fp32 they are checked across
# modes only.
FP32_GATE_PARAMS = ("A_log", "dt_bias")
HIDDEN = 256


def paired(got, other) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, this run's tensor, the other run's) for the output, the input grad and every
    parameter grad of two ``cp_run`` results."""
    return [("out", got[0], other[0]), ("dx", got[1], other[1])] + [
        (k, got[2][k], other[2][k]) for k in other[2]
    ]


def as_fp32(run):
    """A ``cp_run`` result with its output and gradients in fp32 (for comparisons)."""
    return run[0].float(), run[1].float(), {k: g.float() for k, g in run[2].items()}, run[3]


def vs_reference(ref, got, dtype: torch.dtype) -> dict[str, float]:
    """Max error per quantity relative to the reference's largest value (see FP32_GATE_PARAMS)."""
    errors = max_errors(ref, got, got[3])
    errors["out"] /= ref[0].abs().max().item()
    errors["dx"] /= ref[1].abs().max().item()
    if dtype == torch.float32:
        errors = {k: v for k, v in errors.items() if k not in FP32_GATE_PARAMS}
    return errors


def nine_b_heads(dtype: torch.dtype):
    """In a 2-GPU NCCL rank: this rank's device, its single-rank group, the fp32 torch-reference
    GDN layer at Qwen3.5-9B head shapes (weights perturbed so every one matters) and
    ``fla_layer(mode, **options)``, a CP-2 FLA layer with the reference's weights in ``dtype``
    (``options``: more GDNOptions fields). Seeds ``torch`` for the inputs that follow."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import random as mcore_random

    world = dist.group.WORLD
    device = torch.device("cuda", dist.get_rank())
    mcore_random.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    single = self_group()
    dims = dict(
        hidden_size=HIDDEN,
        num_attention_heads=16,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        use_cpu_initialization=False,
    )
    reference = build_gdn(tiny_config(**dims), single, single, kernel_backend="torch").to(device)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
    torch.manual_seed(0)
    config = tiny_config(**dims, params_dtype=dtype, bf16=dtype == torch.bfloat16)

    def fla_layer(mode: str = "chunkwise", **options):
        layer = build_gdn(config, world, single, mode, kernel_backend="fla", **options).to(device)
        layer.load_state_dict(
            {k: v.to(dtype) if torch.is_tensor(v) else v for k, v in reference.state_dict().items()}
        )
        return layer

    return device, single, reference, fla_layer
