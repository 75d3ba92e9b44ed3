"""relax_gdn.model.attention on CPU: zigzag CP attention on real gloo groups equals W = 1 (outputs
and q/k/v gradients), W = 1 equals a naive per-document reference, the varlen segments are exact
(emulated on CPU), no leakage across documents, GQA, the plan cache, and clear errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from relax_gdn.choices import ATTENTION_BACKENDS
from relax_gdn.layout import attach_host_cu_seqlens, thd_rank_indices
from relax_gdn.model.attention import (
    CPDotProductAttention,
    attend_zigzag_shard,
    build_zigzag_attention_plan,
    zigzag_attention_plan,
)

HEADS, GROUPS, DIM = 4, 2, 8  # GQA: two query heads per key/value head
TOL = 2e-5  # fp32


def packings(world: int) -> list[list[int]]:
    """Global boundaries (every length a multiple of 2W): a long document spanning every rank's
    chunks, short ones, empty padding slots (also last), and a single document."""
    unit = 2 * world
    cases = []
    for lengths in ([10, 0, 3, 1, 6, 0], [7]):
        cases.append(np.concatenate([[0], np.cumsum(np.array(lengths) * unit)]).tolist())
    return cases


def config(**overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def core(cp_group=None, **kwargs) -> CPDotProductAttention:
    return CPDotProductAttention(
        config=kwargs.pop("config", None) or config(),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        pg_collection=ProcessGroupCollection(tp=None, cp=cp_group),
        **kwargs,
    )


def packed(cu: list[int], cp_group=None, local_cp_size=None, host_copy=True) -> PackedSeqParams:
    t = torch.tensor(cu, dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=t,
        cu_seqlens_kv=t,
        cu_seqlens_q_padded=t,
        cu_seqlens_kv_padded=t,
        cp_group=cp_group,
        local_cp_size=local_cp_size,
    )
    if host_copy:
        attach_host_cu_seqlens(psp, t, cu)
    return psp


def global_tensors(total: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HEADS, DIM, generator=g)
    k = torch.randn(total, GROUPS, DIM, generator=g)
    v = torch.randn(total, GROUPS, DIM, generator=g)
    weight = torch.randn(total, HEADS * DIM, generator=g)
    return q, k, v, weight


def run(module, q, k, v, weight, psp):
    """Output and q/k/v gradients of ``sum(module(q, k, v) * weight)``."""
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = module(q, k, v, None, packed_seq_params=psp)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def naive(q, k, v, cu, scale):
    """Per-document causal softmax attention in float64, written out."""
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float64)
    groups = q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1], cu[1:]):
        if e == s:
            continue
        qq, kk, vv = q[s:e].double(), k[s:e].double(), v[s:e].double()
        kk, vv = kk.repeat_interleave(groups, 1), vv.repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        future = torch.ones(e - s, e - s, dtype=torch.bool).triu(1)
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.masked_fill(future, -math.inf).softmax(-1), vv)
    return out.reshape(q.shape[0], -1)


# ---------------------------------------------------------------------------------------------
# Real process groups: W = 4 on the world, W = 2 on pairs (dynamic CP through PackedSeqParams)
# ---------------------------------------------------------------------------------------------


def _self_attention(tp_group, cp_group):
    """Megatron-Core's SelfAttention with Qwen3.5's output gate and this core (local linears)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    spec = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=ModuleSpec(module=CPDotProductAttention, params={"backend": "sdpa"}),
            linear_proj=RowParallelLinear,
        ),
    )
    cfg = config(attention_output_gate=True, use_cpu_initialization=True, add_bias_linear=False)
    pgs = ProcessGroupCollection(tp=tp_group, cp=cp_group)
    return build_module(spec, config=cfg, layer_number=1, pg_collection=pgs)


def _layer_run(layer, x, weight, psp, grad_group=None):
    """Output, input grad and parameter grads (summed over ``grad_group``) of the layer."""
    import torch.distributed as dist

    x = x.clone().requires_grad_(True)
    out, _ = layer(x, None, packed_seq_params=psp)
    (out * weight).sum().backward()
    grads = []
    for p in layer.parameters():
        if grad_group is not None:
            dist.all_reduce(p.grad, group=grad_group)
        grads.append(p.grad)
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def _cp_cases():
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    world = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([j]) for j in range(dist.get_world_size())]
    my_pair, single = pairs[rank // 2], singles[rank]
    torch.manual_seed(0)
    ref_layer = _self_attention(single, single)
    errors = {}
    for w, group in ((4, None), (2, my_pair)):
        r = rank if group is None else group.rank()
        for i, cu in enumerate(packings(w)):
            q, k, v, weight = global_tensors(cu[-1], seed=i)
            ref = run(core(), q, k, v, weight, packed(cu))  # W = 1 on the whole batch
            ids = thd_rank_indices(cu, w, r, "zigzag")
            # the module's static group is the world; a pair arrives on PackedSeqParams (dynamic CP)
            psp = packed(cu, group, w if group is not None else None, host_copy=i == 0)
            got = run(core(world), q[ids], k[ids], v[ids], weight[ids], psp)
            errors[(w, i)] = max((g - x[ids]).abs().max().item() for g, x in zip(got, ref))
            with torch.no_grad():  # torch has no FlexAttention backward on CPU
                flex = core(world, backend="flex")(q[ids], k[ids], v[ids], None, packed_seq_params=psp)
            errors[(w, i, "flex")] = (flex - ref[0][ids]).abs().max().item()

        # the whole Megatron-Core attention layer (projections, output gate) around this core
        cu = packings(w)[0]
        x = torch.randn(cu[-1], 1, HEADS * DIM)
        weight = torch.randn(cu[-1], 1, HEADS * DIM)
        ref_out, ref_dx, ref_grads = _layer_run(ref_layer, x, weight, packed(cu))
        layer = _self_attention(single, world)
        layer.load_state_dict(ref_layer.state_dict())
        ids = thd_rank_indices(cu, w, r, "zigzag")
        psp = packed(cu, group, w if group is not None else None)
        out, dx, grads = _layer_run(layer, x[ids], weight[ids], psp, group or world)
        errors[(w, "self_attention")] = max(
            [(out - ref_out[ids]).abs().max().item(), (dx - ref_dx[ids]).abs().max().item()]
            + [((g - rg).abs().max() / rg.abs().max()).item() for g, rg in zip(grads, ref_grads)]
        )
    return errors


def test_cp_equals_single_rank_on_gloo(gloo):
    """W = 4 on the world and W = 2 on pairs, in one spawn: outputs and q/k/v gradients of the
    core, FlexAttention's outputs (it has no CPU backward), and the whole SelfAttention layer
    around the core, equal W = 1 on the full packed batch."""
    per_rank = gloo(_cp_cases, 4)
    for rank, errors in enumerate(per_rank):
        assert len(errors) == 10
        for case, err in errors.items():
            assert err < TOL, (rank, case, err)


# ---------------------------------------------------------------------------------------------
# Single process
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cu", packings(1) + [[0, 1, 1, 5, 12]])
def test_single_rank_equals_naive_reference(cu):
    q, k, v, _ = global_tensors(cu[-1], seed=3)
    out = core()(q, k, v, None, packed_seq_params=packed(cu))
    torch.testing.assert_close(out.double(), naive(q, k, v, cu, 1 / math.sqrt(DIM)), atol=TOL, rtol=0)


def test_packed_equals_documents_alone():
    cu = packings(2)[0]
    q, k, v, weight = global_tensors(cu[-1], seed=4)
    whole = run(core(), q, k, v, weight, packed(cu))
    for s, e in zip(cu[:-1], cu[1:]):
        alone = run(core(), q[s:e], k[s:e], v[s:e], weight[s:e], packed([0, e - s]))
        if e == s:  # an empty slot alone is an empty batch: nothing to attend, k/v unused
            assert alone[0].shape == (0, HEADS * DIM)
            continue
        for a, b in zip(alone, whole):
            torch.testing.assert_close(a, b[s:e], atol=TOL, rtol=0)


def _emulated_varlen(q, k_all, v_all, plan, scale):
    """What varlen_attn computes on ``plan.varlen`` (bottom-right causal per segment), on CPU."""
    seg = plan.varlen
    keys = k_all if seg.key_rows is None else k_all[seg.key_rows]
    values = v_all if seg.key_rows is None else v_all[seg.key_rows]
    outs = []
    for qa, qb, ka, kb in zip(seg.cu_q[:-1], seg.cu_q[1:], seg.cu_k[:-1], seg.cu_k[1:]):
        nq, nk = int(qb - qa), int(kb - ka)
        assert 0 < nq <= nk <= seg.max_k and nq <= seg.max_q
        visible = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)  # bottom-right aligned
        outs.append(
            F.scaled_dot_product_attention(
                q[qa:qb].transpose(0, 1),
                keys[ka:kb].transpose(0, 1),
                values[ka:kb].transpose(0, 1),
                attn_mask=visible,
                scale=scale,
                enable_gqa=True,
            ).transpose(0, 1)
        )
    return torch.cat(outs)


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_every_rank_of_a_simulated_group(w):
    """The per-rank core on hand-gathered K/V (no processes): the dense kernel, the varlen
    segments (emulated) and FlexAttention (eager, with its block mask) give the single-rank answer
    on every rank, W up to 8."""
    scale = 0.3
    for cu in packings(w):
        q, k, v, _ = global_tensors(cu[-1], seed=5)
        ref = naive(q, k, v, cu, scale).float().view_as(q)
        gathered = torch.cat([thd_rank_indices(cu, w, j, "zigzag") for j in range(w)])
        for r in range(w):
            ids = thd_rank_indices(cu, w, r, "zigzag")
            plan = build_zigzag_attention_plan(cu, w, r)
            dense = attend_zigzag_shard(
                q[ids], k[gathered], v[gathered], plan, softmax_scale=scale, backend="sdpa"
            )
            torch.testing.assert_close(dense, ref[ids], atol=TOL, rtol=0)
            emulated = _emulated_varlen(q[ids], k[gathered], v[gathered], plan, scale)
            torch.testing.assert_close(emulated, ref[ids], atol=TOL, rtol=0)
            flex = attend_zigzag_shard(
                q[ids], k[gathered], v[gathered], plan, softmax_scale=scale, backend="flex"
            )
            torch.testing.assert_close(flex, ref[ids], atol=TOL, rtol=0)


@pytest.mark.parametrize("w,block", [(1, 4), (1, 8), (2, 4), (4, 8)])
def test_flex_block_mask_covers_exactly_the_visible_pairs(w, block):
    """FlexAttention's tiles (built from per-block position ranges): every visible (query, key)
    pair lies in a visited tile, every tile marked full is visible throughout, and tiles are
    skipped (across documents, above the diagonal), so the mask is sparse."""
    from relax_gdn.model.attention_kernels import flex_block_classes

    unit = 2 * w
    for lengths in ([10, 0, 3, 1, 6, 0], [7], [2, 2, 2, 2, 8]):
        cu = np.concatenate([[0], np.cumsum(np.array(lengths) * unit * 2)]).tolist()
        for r in range(w):
            q_pos, q_start, k_pos = build_zigzag_attention_plan(cu, w, r).dense_host
            visible = (k_pos[None, :] >= q_start[:, None]) & (k_pos[None, :] <= q_pos[:, None])
            partial, full = flex_block_classes(q_pos, q_start, k_pos, block)
            assert not (partial & full).any()
            nq, nk = partial.shape
            tiles = np.zeros((nq, nk, 2), dtype=bool)  # (any visible pair, every pair visible)
            for i in range(nq):
                for j in range(nk):
                    tile = visible[i * block : (i + 1) * block, j * block : (j + 1) * block]
                    tiles[i, j] = tile.any(), tile.all()
            assert not (tiles[..., 0] & ~(partial | full)).any(), "a visible pair in a skipped tile"
            assert not (full & ~tiles[..., 1]).any(), "a tile marked full has a hidden pair"
            if w == 1 and len(lengths) > 1:
                assert full.any() and (~(partial | full)).any(), (lengths, r)


def test_backends_on_cpu():
    """flex runs forward on CPU (eager) and refuses training there; fa4 refuses with the reason;
    ``auto`` stays ``sdpa`` on CPU whatever kernel wins on CUDA (fa4, the measured winner, included);
    cuDNN's attention is no choice at all (it corrupted the CUDA context at head dim 256)."""
    from relax_gdn.model import attention_kernels

    cu = packings(1)[0]
    q, k, v, _ = global_tensors(cu[-1], seed=12)
    sdpa = core(backend="sdpa")(q, k, v, None, packed_seq_params=packed(cu))
    flex = core(backend="flex")(q, k, v, None, packed_seq_params=packed(cu))
    torch.testing.assert_close(flex, sdpa, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="'flex' cannot run here: FlexAttention has no backward on CPU"):
        core(backend="flex")(q.requires_grad_(True), k, v, None, packed_seq_params=packed(cu))
    q = q.detach()
    with pytest.raises(ValueError, match="'fa4' cannot run here: it needs CUDA tensors"):
        core(backend="fa4")(q, k, v, None, packed_seq_params=packed(cu))
    assert attention_kernels.AUTO_ATTENTION_BACKEND == "fa4"
    assert attention_kernels.choose_backend("auto", q) == "sdpa"
    for winner in ("flex", "varlen"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention_kernels, "AUTO_ATTENTION_BACKEND", winner)
            assert attention_kernels.choose_backend("auto", q) == "sdpa"
    assert "cudnn" not in ATTENTION_BACKENDS and "cudnn" not in attention_kernels.KERNELS
    with pytest.raises(ValueError, match="unknown attention backend 'cudnn'"):
        attention_kernels.choose_backend("cudnn", q)


def test_auto_backend_on_cpu_is_sdpa_and_varlen_refuses():
    cu = packings(1)[0]
    q, k, v, _ = global_tensors(cu[-1], seed=6)
    auto = core()(q, k, v, None, packed_seq_params=packed(cu))
    sdpa = core(backend="sdpa")(q, k, v, None, packed_seq_params=packed(cu))
    assert torch.equal(auto, sdpa)
    with pytest.raises(ValueError, match="'varlen' cannot run here"):
        core(backend="varlen")(q, k, v, None, packed_seq_params=packed(cu))


def test_sbhd_without_cp_is_plain_causal_attention():
    s, b = 12, 2
    g = torch.Generator().manual_seed(7)
    q = torch.randn(s, b, HEADS, DIM, generator=g)
    k, v = torch.randn(s, b, GROUPS, DIM, generator=g), torch.randn(s, b, GROUPS, DIM, generator=g)
    out = core()(q, k, v, None)
    assert out.shape == (s, b, HEADS * DIM)
    for i in range(b):
        expect = naive(q[:, i], k[:, i], v[:, i], [0, s], 1 / math.sqrt(DIM)).float()
        torch.testing.assert_close(out[:, i], expect, atol=TOL, rtol=0)
    # Megatron's boolean mask (True = masked out) on top of causal: hide the first two keys
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    mask[..., 2:, :2] = True
    masked = core()(q, k, v, mask)
    torch.testing.assert_close(masked[:2], out[:2])
    expect = naive(q[2:, 0], k[2:, 0], v[2:, 0], [0, s - 2], 1 / math.sqrt(DIM)).float()
    torch.testing.assert_close(masked[2:, 0], expect, atol=TOL, rtol=0)


def test_softmax_scale_follows_config():
    cu = [0, 8]
    q, k, v, _ = global_tensors(8, seed=8)
    out = core(config=config(softmax_scale=0.05))(q, k, v, None, packed_seq_params=packed(cu))
    torch.testing.assert_close(out.double(), naive(q, k, v, cu, 0.05), atol=TOL, rtol=0)
    assert core(softmax_scale=0.2).softmax_scale == 0.2


def test_plan_is_built_once_per_micro_batch():
    cu = packings(2)[0]
    psp = packed(cu)
    cu_tensor = psp.cu_seqlens_q_padded
    first = zigzag_attention_plan(psp, cu[-1] // 2, 2, 1, torch.device("cpu"))
    assert zigzag_attention_plan(psp, cu[-1] // 2, 2, 1, torch.device("cpu")) is first
    other_rank = zigzag_attention_plan(psp, cu[-1] // 2, 2, 0, torch.device("cpu"))
    assert other_rank is not first and other_rank.order is first.order  # one order per batch
    cu_tensor.add_(0)  # an in-place refill: same object, new _version
    attach_host_cu_seqlens(psp, cu_tensor, cu)
    assert zigzag_attention_plan(psp, cu[-1] // 2, 2, 1, torch.device("cpu")) is not first
    # a new micro-batch never sees the old one's plan
    assert zigzag_attention_plan(packed(cu), cu[-1] // 2, 2, 1, torch.device("cpu")) is not first


class _FakeGroup:
    """Enough of a ProcessGroup for code that must fail before any collective."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_bad_input_raises_value_error():
    q, k, v, _ = global_tensors(16, seed=9)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size"):
        zigzag_attention_plan(packed([0, 6, 16]), 8, 2, 0, cpu)
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size"):
        core(_FakeGroup(2))(q[:8], k[:8], v[:8], None, packed_seq_params=packed([0, 6, 16]))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        core()(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match="does not match"):
        core()(q, k, v, None, packed_seq_params=packed([0, 8, 12]))
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        psp = packed([0, 8, 16])
        psp.cu_seqlens_kv_padded = torch.tensor([0, 4, 16], dtype=torch.int32)
        core()(q, k, v, None, packed_seq_params=psp)
    with pytest.raises(ValueError, match="local_cp_size"):
        core()(q, k, v, None, packed_seq_params=packed([0, 16], _FakeGroup(2), local_cp_size=4))
    with pytest.raises(ValueError, match="needs packed \\(thd\\) input"):
        sbhd = (q.view(16, 1, HEADS, DIM), k.view(16, 1, GROUPS, DIM), v.view(16, 1, GROUPS, DIM))
        core(_FakeGroup(2))(*sbhd, None)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        core()(q[:, :3], k, v, None, packed_seq_params=packed([0, 16]))
    with pytest.raises(ValueError, match="\\[t, heads, dim\\]"):
        core()(q.unsqueeze(1), k, v, None, packed_seq_params=packed([0, 16]))
    with pytest.raises(ValueError, match="attn_mask_type"):
        core()(q, k, v, None, attn_mask_type=AttnMaskType.no_mask, packed_seq_params=packed([0, 16]))
    with pytest.raises(ValueError, match="attention_bias"):
        core()(q, k, v, None, attention_bias=torch.zeros(1), packed_seq_params=packed([0, 16]))
    with pytest.raises(ValueError, match="unknown attention backend"):
        core(backend="flash")
    with pytest.raises(ValueError, match="attention_dropout=0.0"):
        core(config=config(attention_dropout=0.1))
    with pytest.raises(ValueError, match="self-attention"):
        pgs = ProcessGroupCollection(tp=None, cp=None)
        CPDotProductAttention(config(), 1, AttnMaskType.causal, "cross", pg_collection=pgs)
