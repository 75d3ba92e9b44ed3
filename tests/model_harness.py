"""The tiny Qwen3.5 on CPU process groups, for tests that compare a CP / TP run with TP = CP = 1 on
the same weights and packed batch: build, batch, gradients as Megatron-Core's DDP finalises them,
per-tensor errors and their tolerances."""

from __future__ import annotations

import torch

# 2*CP = 4 divides every document: short ones, an empty padding slot, and a long one that spans
# every rank's zigzag chunks (and several ranks' contiguous slices in chunkwise mode)
CU = [0, 12, 12, 16, 56, 64]
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)

# fp32, absolute, per token: ~1e-5 relative to losses of ~5.5 (measured <= 1.1e-5 in chunkwise,
# whose CP scan passes state between ranks; <= 6e-6 in the other modes)
LOSS_TOL = 5e-5
# fp32, relative to the tensor's max |g| (the GDN layer tests' bound). Measured: <= 3.1e-5 for every
# gradient but the GDN decay parameters (A_log, dt_bias), which reach ~1e-4 in chunkwise mode:
# their gradient is a sum of reverse cumulative sums over the sequence that largely cancel, so it
# amplifies rounding the most (reordering the documents of the pack alone moves it by ~1e-6).
GRAD_TOL, DECAY_GRAD_TOL = 1e-4, 3e-4


def tolerance(name: str) -> float:
    if name == "loss":
        return LOSS_TOL
    return DECAY_GRAD_TOL if name.endswith(("A_log", "dt_bias")) else GRAD_TOL


def batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = CU[-1]
    tokens = torch.randint(0, vocab, (1, total), generator=g)
    labels = torch.randint(0, vocab, (1, total), generator=g)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(CU, CU[1:])])[None]
    return tokens, labels, positions


def build(
    config,
    tp,
    cp,
    single,
    mode="chunkwise",
    contiguous_between_layers=True,
    fusion=None,
    fp8=None,
    lora=None,
    **options,
):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import build_qwen3_5_preset_model
    from relax_gdn.model.fusion import Fusion

    pgs = ProcessGroupCollection(tp=tp, cp=cp, pp=single, embd=single)
    return build_qwen3_5_preset_model(
        "qwen3_5_tiny",
        config,
        pg_collection=pgs,
        gdn=GDNOptions(cp_mode=mode, kernel_backend="torch", **options),
        attention_backend="sdpa",
        contiguous_between_layers=contiguous_between_layers,
        fusion=fusion or Fusion(),
        fp8=fp8,
        lora=lora,
    )


def loss_and_grads(model, tokens, labels, positions, cu, ids=None, cp_group=None):
    """Per-token loss and parameter gradients of ``sum(loss)`` on the rows ``ids`` of the batch
    (``cp_group``: a dynamic-CP group carried by the micro-batch)."""
    from tests.gdn_harness import packed_params

    if ids is not None:
        tokens, labels, positions = tokens[:, ids], labels[:, ids], positions[:, ids]
    dynamic = {} if cp_group is None else {"cp_group": cp_group, "local_cp_size": cp_group.size()}
    psp = packed_params(cu, "cpu", **dynamic)
    loss = model(tokens, positions, None, labels=labels, packed_seq_params=psp)
    loss.sum().backward()
    grads = {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }  # frozen: none
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def finalize_grads(model, grads, config, tp_group, cp_group):
    """What Megatron-Core's DDP + finalize_model_grads do: sum over CP (part of the data-parallel
    reduction), and over TP for norms whose gradient is partial there (sequence-parallel inputs,
    QK-norms over a TP share of the heads)."""
    import torch.distributed as dist

    for name, param in model.named_parameters():
        g = grads[name]
        if cp_group.size() > 1:
            dist.all_reduce(g, group=cp_group)
        partial_over_tp = (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
            "q_layernorm" in name or "k_layernorm" in name
        )
        if tp_group.size() > 1 and partial_over_tp:
            dist.all_reduce(g, group=tp_group)
    return grads


def errors(ref_loss, ref_grads, loss, grads, ids, shard=lambda n, g: g) -> dict[str, float]:
    """Per-token loss: max absolute error. Gradients: max absolute error over this rank's share,
    relative to the max |g| of the WHOLE tensor (a TP share may hold only heads whose gradient
    nearly cancels, which would inflate a share-relative error)."""
    errors = {"loss": (loss - ref_loss[:, ids]).abs().max().item()}
    for n, g in ref_grads.items():
        expect = shard(n, g)
        assert grads[n].shape == expect.shape, (n, grads[n].shape, expect.shape)
        errors[n] = (grads[n] - expect).abs().max().item() / max(g.abs().max().item(), 1e-12)
    return errors


def _max_difference(one: tuple, other: tuple) -> float:
    """Largest |difference| / max |value| over the loss and every gradient of two runs."""
    (loss, grads), (other_loss, other_grads) = one, other
    pairs = [(loss, other_loss)] + [(grads[n], other_grads[n]) for n in grads]
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in pairs)


def interleaved_options_case(
    preset: str, vocab: int, cu: list[int], dtype: torch.dtype, options: dict
) -> dict:
    """In a CP group of every rank (gloo: CPU, nccl: this rank's GPU): build one model per entry of
    ``options`` (name -> ``Qwen3_5Options`` fields; exactly two) with the same weights and full
    recompute, run each alone (forward + backward), then both interleaved. Returns per model the
    largest difference interleaved vs alone and how many times its first layer ran inside its
    backward (the recompute), and the largest difference between the two models alone."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model import build_qwen3_5_preset_model, qwen3_5_config
    from tests.gdn_harness import packed_params, self_group

    rank, world = dist.get_rank(), dist.group.WORLD
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.set_num_threads(1)
    if cuda:
        from megatron.core.tensor_parallel import random as mcore_random

        mcore_random.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    single = self_group()
    pgs = ProcessGroupCollection(tp=single, cp=world, pp=single, embd=single)
    config = qwen3_5_config(
        preset,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        **FULL_RECOMPUTE,
    )
    torch.manual_seed(0)  # the same weights on every rank
    models = {
        name: build_qwen3_5_preset_model(preset, config, pg_collection=pgs, vocab_size=vocab, **fields).to(
            device
        )
        for name, fields in options.items()
    }
    first, second = models.values()
    with torch.no_grad():  # zero-centred norms start at 0: perturb so every weight matters
        for p in first.parameters():
            p.add_(0.05 * torch.randn_like(p))
    second.load_state_dict(first.state_dict())

    g = torch.Generator().manual_seed(0)
    ids = thd_rank_indices(cu, dist.get_world_size(), rank, "zigzag")
    tokens, labels = (torch.randint(0, vocab, (1, cu[-1]), generator=g)[:, ids].to(device) for _ in range(2))
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None][:, ids].to(device)
    mask = (torch.arange(cu[-1]) % 3 != 0)[ids].float()[None].to(device)  # some tokens carry no loss

    def forward(model):
        return model(
            tokens,
            positions,
            None,
            labels=labels,
            loss_mask=mask,
            packed_seq_params=packed_params(cu, device),
        )

    def taken(model, loss) -> tuple:
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return loss.detach().float(), grads

    alone = {}
    for name, model in models.items():
        loss = forward(model)
        loss.backward()
        alone[name] = taken(model, loss)

    layer_calls = dict.fromkeys(models, 0)
    for name, model in models.items():
        model.decoder.layers[0].register_forward_pre_hook(
            lambda *_, name=name: layer_calls.__setitem__(name, layer_calls[name] + 1)
        )
    losses = {name: forward(model) for name, model in models.items()}  # a, then b
    in_forward = dict(layer_calls)
    interleaved = {}
    for name, model in models.items():  # a's backward recomputes a's forward after b's forward
        losses[name].backward()
        interleaved[name] = taken(model, losses[name])
    a, b = models
    return {
        "interleaved_vs_alone": {name: _max_difference(interleaved[name], alone[name]) for name in models},
        "recomputed_in_backward": {name: layer_calls[name] - in_forward[name] for name in models},
        "a_vs_b": _max_difference(alone[a], alone[b]),
    }


def tp_sections(name: str, config) -> list[int] | None:
    """Fused weights whose every section is split over TP separately (dim 0)."""
    qk = config.linear_num_key_heads * config.linear_key_head_dim
    v = config.linear_num_value_heads * config.linear_value_head_dim
    hv = config.linear_num_value_heads
    if name.endswith("self_attention.in_proj.weight"):
        return [qk, qk, v, v, hv, hv]
    if name.endswith("conv1d.weight"):
        return [qk, qk, v]
    if name.endswith("linear_fc1.weight"):
        return [config.ffn_hidden_size] * 2
    return None


def tp_shard(name, full, param, config, tp_size, tp_rank):
    """This TP rank's share of a TP = 1 tensor, laid out like ``param``."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    sections = tp_sections(name, config)
    if sections is not None:
        assert dim == 0
        return torch.cat([s.chunk(tp_size, 0)[tp_rank] for s in full.split(sections, 0)])
    return full.chunk(tp_size, dim)[tp_rank]
