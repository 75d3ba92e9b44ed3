"""Selective recompute gives the no-recompute gradients (tiny model, CPU, fp32), its module list is
checked, and the per-GPU memory model is right where it can be checked exactly (the parameter
count against the built model) and says what fits an H200."""

from __future__ import annotations

import pytest
import torch

from relax_gdn.model.recompute import SELECTIVE_MODULES, recompute_config_fields
from relax_gdn.train.flops import ModelShape
from relax_gdn.train.memory import GIB, estimate_memory, parameter_count
from tests.helpers import train_records_in_this_process as _train

H200_GIB = 139.8  # what torch reports as the card's total memory


def _shape(preset: str, vocab: int | None = None) -> ModelShape:
    from relax_gdn.model import qwen3_5_config, qwen3_5_preset

    return ModelShape.from_transformer_config(qwen3_5_config(preset), vocab or qwen3_5_preset(preset).vocab_size)


@pytest.mark.slow  # trains the tiny model (in this process)
def test_selective_recompute_matches_no_recompute():
    none = _train(**{"recompute.granularity": "none"})
    for modules in (list(SELECTIVE_MODULES), ["gdn_core"]):
        selective = _train(**{"recompute.granularity": "selective", "recompute.modules": modules})
        for s, n in zip(selective, none):
            assert s["loss"] == pytest.approx(n["loss"], rel=1e-6)
            assert s["grad_norm"] == pytest.approx(n["grad_norm"], rel=1e-5)


def test_recompute_fields_split_megatron_and_own_modules():
    assert recompute_config_fields("selective", ["core_attn", "mlp_act"]) == dict(
        recompute_granularity="selective", recompute_modules=["core_attn"])
    # none of Megatron-Core's modules: its selective machinery stays off, ours runs
    assert recompute_config_fields("selective", ["gdn_core"]) == dict(recompute_granularity=None)
    assert recompute_config_fields("full")["recompute_granularity"] == "full"
    with pytest.raises(ValueError, match="layernorm"):
        recompute_config_fields("selective", ["layernorm"])


def _built_tiny(**config_fields):
    from relax_gdn.model import build_qwen3_5_preset_model, qwen3_5_config

    skip = config_fields.pop("skip_unread_gemm", False)
    config = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True, **config_fields)
    return build_qwen3_5_preset_model("qwen3_5_tiny", config, recompute_skips_unread_gemm=skip)


def test_full_recompute_skipping_unused_work_gives_the_same_gradients():
    """``recompute.skip_unused``: the last layer kept, linear_fc2's GEMM skipped when a layer is
    recomputed; loss and every gradient equal plain full recompute and no recompute (fp32)."""
    from megatron.core import parallel_state

    from relax_gdn.compat.cpu import apply_cpu_shims
    from relax_gdn.model import qwen3_5_preset
    from relax_gdn.train.loop import init_distributed

    apply_cpu_shims()
    created = init_distributed(torch.device("cpu"))
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    try:
        layers = qwen3_5_preset("qwen3_5_tiny").config["num_layers"]
        trimmed = recompute_config_fields("full", skip_unused=True, num_layers=layers)
        assert trimmed == dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=layers - 1)
        models = {
            "none": _built_tiny(),
            "full": _built_tiny(**recompute_config_fields("full", skip_unused=False, num_layers=layers)),
            "full, skip_unused": _built_tiny(**trimmed, skip_unread_gemm=True),
        }
        for model in models.values():
            model.load_state_dict(models["none"].state_dict())
            model.train()
        fc2_outputs = []  # (layer, grad enabled, output all zero) of every linear_fc2 call
        for i, layer in enumerate(models["full, skip_unused"].decoder.layers):
            layer.mlp.linear_fc2.register_forward_hook(
                lambda m, args, out, i=i: fc2_outputs.append((i, torch.is_grad_enabled(), bool((out[0] == 0).all()))))
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (1, 48), generator=g)
        labels = torch.randint(0, 256, (1, 48), generator=g)
        positions = torch.arange(48)[None]
        results = {}
        for name, model in models.items():
            loss = model(tokens, positions, None, labels=labels)
            loss.sum().backward()
            results[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        for name in ("full", "full, skip_unused"):
            loss, grads = results[name]
            torch.testing.assert_close(loss, results["none"][0], rtol=1e-6, atol=0)
            for n, grad in grads.items():
                torch.testing.assert_close(grad, results["none"][1][n], rtol=1e-5, atol=1e-7, msg=f"{name}: {n}")
        last = layers - 1
        # forward: the first layers under no_grad (checkpointed), the last with grad (kept); in
        # backward each checkpointed layer is recomputed once, its linear_fc2 product skipped
        assert [(i, grad) for i, grad, _ in fc2_outputs[:layers]] == [(i, i == last) for i in range(layers)]
        assert not any(zero for _, _, zero in fc2_outputs[:layers])
        assert sorted(fc2_outputs[layers:]) == [(i, True, True) for i in range(last)]
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            torch.distributed.destroy_process_group()


def test_unknown_recompute_module_is_a_config_error():
    from relax_gdn.config import ConfigError, RunConfig, validate

    with pytest.raises(ConfigError, match="recompute.modules"):
        validate(RunConfig().with_overrides({"recompute.modules": ["core_attn", "everything"]}), 1)


def test_parameter_count_matches_the_built_model():
    from megatron.core import parallel_state

    from relax_gdn.compat.cpu import apply_cpu_shims
    from relax_gdn.model import build_qwen3_5_preset_model, qwen3_5_config
    from relax_gdn.train.loop import init_distributed

    apply_cpu_shims()
    created = init_distributed(torch.device("cpu"))
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    try:
        model = build_qwen3_5_preset_model("qwen3_5_tiny", qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True))
        assert parameter_count(_shape("qwen3_5_tiny")) == sum(p.numel() for p in model.parameters())
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            torch.distributed.destroy_process_group()


def test_nine_b_parameter_count():
    assert parameter_count(_shape("qwen3_5_9b")) == pytest.approx(8.95e9, rel=0.01)


def test_memory_model_on_one_and_two_h200():
    shape = _shape("qwen3_5_9b", 248_832)
    one_gpu_adam = estimate_memory(shape, tokens_per_gpu=8192, recompute="full", optimizer="adam")
    assert one_gpu_adam.optimizer / GIB == pytest.approx(12 * parameter_count(shape) / GIB)
    assert one_gpu_adam.total / GIB > H200_GIB  # Adam state of the 9B does not fit one GPU
    for recompute in ("full", "selective", "none"):
        fits = estimate_memory(shape, tokens_per_gpu=8192, recompute=recompute, optimizer="none")
        assert fits.total / GIB < H200_GIB
    # CP 2 on 2 GPUs shards the optimizer over DP x CP: selective fits, no recompute does not
    cp2 = dict(tokens_per_gpu=8192, cp=2, optimizer="adam")
    assert estimate_memory(shape, recompute="selective", **cp2).total / GIB < H200_GIB
    assert estimate_memory(shape, recompute="none", **cp2).total / GIB > H200_GIB
    # less kept per token: none > selective > full, and the plain loss's logits dwarf the chunked one's
    sizes = [estimate_memory(shape, tokens_per_gpu=8192, recompute=r).activations for r in ("none", "selective", "full")]
    assert sizes == sorted(sizes, reverse=True)
    plain = estimate_memory(shape, tokens_per_gpu=8192, fused_cross_entropy=False)
    assert plain.logits > 2 * estimate_memory(shape, tokens_per_gpu=8192).logits


def test_run_settings_reach_the_modules_through_the_specs():
    """recompute.* and model.fused_* travel builder -> spec -> module (no process-wide setting):
    the GDN options carry gdn_core, the MLP spec mlp_act, every relax_gdn norm spec the Fusion."""
    from relax_gdn.config import RunConfig
    from relax_gdn.model import qwen3_5_config
    from relax_gdn.model.fusion import Fusion
    from relax_gdn.model.qwen3_5 import qwen3_5_block_spec

    selective = RunConfig().with_overrides({"recompute.granularity": "selective", "recompute.modules": ["gdn_core"]})
    assert selective.gdn_options.recompute_core is True
    assert RunConfig().with_overrides({"recompute.granularity": "full"}).gdn_options.recompute_core is False

    own = Fusion(norms=False, cross_entropy=True)
    spec = qwen3_5_block_spec(qwen3_5_config("qwen3_5_tiny"), spec_provider="local", gdn=selective.gdn_options,
                              tp_group=object(), fusion=own, recompute_mlp_activation=True)
    assert spec.layer_norm.params["fusion"] is own
    for layer in spec.layer_specs:
        sub = layer.submodules
        assert sub.input_layernorm.params["fusion"] is own and sub.pre_mlp_layernorm.params["fusion"] is own
        assert sub.mlp.keywords["recompute_activation"] is True
        attn = sub.self_attention
        if "options" in attn.params:  # a GDN layer
            assert attn.params["options"].recompute_core is True
            assert attn.submodules.out_norm.params["fusion"] is own
        else:
            assert attn.submodules.q_layernorm.params["fusion"] is own
