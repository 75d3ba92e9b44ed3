"""Options, not globals: two Qwen3.5 models built with different options live in one process. Run
interleaved under full recompute (forward of one, forward of the other, then the backwards, so
each model's recomputed forward runs inside its backward, after the other model ran), each gives
exactly what it gives alone, and the two differ (the options do change the computation).

CPU here (CP 2 over gloo, torch kernels: the fused norms and loss against the plain ones, the
recomputed prefix against the passed state, contiguous GDN runs against per-layer swaps); the FLA
options on 2 GPUs are ``test_interleaved_fla_options_keep_their_own_results`` in
tests/test_gdn_layer_gpu.py, through :func:`interleaved_options_case` below.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

# 2 x CP = 4 divides every document; the one over [16, 56) crosses the CP-2 cut (32) with 16 tokens
# before it: model a recomputes that prefix on rank 1, model b passes the recurrent state
CPU_CU = [0, 12, 12, 16, 56, 64]
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _max_difference(one: tuple, other: tuple) -> float:
    """Largest |difference| / max |value| over the loss and every gradient of two runs."""
    (loss, grads), (other_loss, other_grads) = one, other
    pairs = [(loss, other_loss)] + [(grads[n], other_grads[n]) for n in grads]
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in pairs)


def interleaved_options_case(preset: str, vocab: int, cu: list[int], dtype: torch.dtype, options: dict) -> dict:
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
    config = qwen3_5_config(preset, use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                            **FULL_RECOMPUTE)
    torch.manual_seed(0)  # the same weights on every rank
    models = {name: build_qwen3_5_preset_model(preset, config, pg_collection=pgs, vocab_size=vocab, **fields).to(device)
              for name, fields in options.items()}
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
        return model(tokens, positions, None, labels=labels, loss_mask=mask, packed_seq_params=packed_params(cu, device))

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
        model.decoder.layers[0].register_forward_pre_hook(lambda *_, name=name: layer_calls.__setitem__(
            name, layer_calls[name] + 1))
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


def _cpu_case():
    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model.fusion import Fusion

    return interleaved_options_case("qwen3_5_tiny", 256, CPU_CU, torch.float32, {
        "defaults": dict(gdn=GDNOptions(kernel_backend="torch", max_cp_size=2)),
        "other options": dict(gdn=GDNOptions(kernel_backend="torch", max_cp_size=2, max_recomputed_prefix=0),
                              fusion=Fusion(norms=False, cross_entropy=False), contiguous_between_layers=False),
    })


@pytest.mark.slow
def test_interleaved_models_keep_their_own_options():
    for rank, result in enumerate(run_distributed(_cpu_case, 2)):
        # bit for bit what each model gives alone: nothing of one model's options reached the other
        assert result["interleaved_vs_alone"] == {"defaults": 0.0, "other options": 0.0}, (rank, result)
        # full recompute ran each model's first layer again inside its backward
        assert result["recomputed_in_backward"] == {"defaults": 1, "other options": 1}, (rank, result)
        assert result["a_vs_b"] > 0, (rank, result)  # the options change the computation
