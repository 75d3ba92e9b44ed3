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


def build(config, tp, cp, single, mode="chunkwise", contiguous_between_layers=True, **options):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import build_qwen3_5_preset_model

    pgs = ProcessGroupCollection(tp=tp, cp=cp, pp=single, embd=single)
    return build_qwen3_5_preset_model(
        "qwen3_5_tiny", config, pg_collection=pgs, gdn=GDNOptions(cp_mode=mode, kernel_backend="torch", **options),
        attention_backend="sdpa", contiguous_between_layers=contiguous_between_layers,
    )


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
