"""relax_gdn.gdn.layer on CPU: every CP mode at W = 2 and 4 equals W = 1 (fwd and bwd), dynamic
CP across micro-batches, state_dict compatibility, configuration errors."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import value_error_message

TOL = 1e-4  # fp32: outputs/input grads absolute, parameter grads relative to their max
# every rank cut (T/W = 80 at W = 2; 40, 80, 120 at W = 4) on a document boundary, an empty slot
WHOLE_DOCUMENTS_PER_RANK = [0, 16, 40, 40, 80, 120, 160]
# documents cross the cuts with 32 tokens before 80 (W = 2); 24 before 40 and 32 before 80 (W = 4)
SHORT_PREFIXES = [0, 16, 48, 88, 120, 160]


def _parity_cases(world_size: int):
    import torch.distributed as dist

    from tests import gdn_harness as h

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.group.WORLD
    single = h.self_group()
    config = h.tiny_config()
    torch.manual_seed(0)
    reference = h.build_gdn(config, single, single)
    # nonzero A_log/dt_bias/conv so every parameter matters
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(h.PACKED[-1], 1, config.hidden_size)
    weight = torch.randn(h.PACKED[-1], 1, config.hidden_size)
    ref = h.reference_run(reference, x, weight, h.packed_params(h.PACKED, "cpu"))

    from relax_gdn.gdn import DEFAULT_MAX_RECOMPUTED_PREFIX

    # Chunkwise passes the recurrent state between ranks here (layers built with
    # max_recomputed_prefix=0), where the general path is tested; recomputed prefixes (the default
    # for short ones) are the cases further down.
    results = {}
    for mode in ("chunkwise", "headwise", "all_gather"):
        for strategy in ("lazy_cache", "prebuild"):
            layer = h.build_gdn(config, world, single, mode, route=strategy, max_recomputed_prefix=0)
            layer.load_state_dict(reference.state_dict())
            psp = h.packed_params(h.PACKED, "cpu")
            got = h.cp_run(layer, x, weight, psp, world_size, rank, world, prebuild=strategy == "prebuild")
            results[(mode, strategy)] = max(h.max_errors(ref, got, got[3]).values())

    # dynamic CP: one module sees W = 4 -> 2 -> 1 -> 4 (or 2 -> 1 -> 2) in consecutive micro-batches
    pairs = [dist.new_group(list(range(s, s + 2))) for s in range(0, world_size, 2)]
    my_pair = pairs[rank // 2]
    for mode in ("chunkwise", "headwise"):
        layer = h.build_gdn(config, world, single, mode, max_cp_size=world_size, max_recomputed_prefix=0)
        layer.load_state_dict(reference.state_dict())
        errs = []
        for size, group in ((world_size, None), (2, my_pair), (1, single), (world_size, None)):
            psp = h.packed_params(h.PACKED, "cpu", cp_group=group, local_cp_size=size if group else None)
            sub_rank = dist.get_rank(group) if group is not None else rank
            got = h.cp_run(layer, x, weight, psp, size, sub_rank, group or world)
            errs.append(max(h.max_errors(ref, got, got[3]).values()))
        results[(mode, "dynamic")] = max(errs)

    # every rank cut on a document boundary: each slice is scanned alone, no CP scan or conv
    from relax_gdn.gdn import cp_reference

    calls = {"cp": 0}
    real = {f: getattr(cp_reference, f) for f in ("cp_causal_conv1d", "cp_gated_delta_rule")}

    def counted(fn):
        def wrapper(*args, **kwargs):
            calls["cp"] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in real.items():
        setattr(cp_reference, name, counted(fn))
    try:
        cp_calls = {}
        for label, cu, recompute_up_to in (
            ("crossing", h.PACKED, 0),
            ("whole documents per rank", WHOLE_DOCUMENTS_PER_RANK, 0),
            ("short prefixes recomputed (the default limit)", SHORT_PREFIXES, DEFAULT_MAX_RECOMPUTED_PREFIX),
            ("prefixes over the limit", SHORT_PREFIXES, 8),
        ):
            x_cu, w_cu = (
                torch.randn(cu[-1], 1, config.hidden_size),
                torch.randn(cu[-1], 1, config.hidden_size),
            )
            ref_cu = h.reference_run(reference, x_cu, w_cu, h.packed_params(cu, "cpu"))
            layer = h.build_gdn(config, world, single, "chunkwise", max_recomputed_prefix=recompute_up_to)
            layer.load_state_dict(reference.state_dict())
            calls["cp"] = 0
            got = h.cp_run(layer, x_cu, w_cu, h.packed_params(cu, "cpu"), world_size, rank, world, cu=cu)
            cp_calls[label] = calls["cp"]
            results[("chunkwise", label)] = max(h.max_errors(ref_cu, got, got[3]).values())
    finally:
        for name, fn in real.items():
            setattr(cp_reference, name, fn)

    # a document whose length is not a multiple of 2W is refused before any communication
    layer = h.build_gdn(config, world, single, "chunkwise")
    bad = [0, 2 * world_size + 2, 8 * world_size]
    try:
        layer(
            torch.randn(bad[-1] // world_size, 1, config.hidden_size),
            None,
            packed_seq_params=h.packed_params(bad, "cpu"),
        )
        results["bad_lengths"] = "no error"
    except ValueError as e:
        results["bad_lengths"] = 0.0 if f"sequence 0 has length {2 * world_size + 2}" in str(e) else str(e)
    return results, cp_calls


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_mode_matches_single_rank(gloo, world_size):
    per_rank = gloo(_parity_cases, world_size, world_size)
    for rank, (results, cp_calls) in enumerate(per_rank):
        assert len(results) == 13
        bad = {k: v for k, v in results.items() if not v < TOL}
        assert not bad, f"rank {rank}: max errors {bad}"
        # the conv of q, k and v + the scan, fwd (the bwd runs inside their autograd): CP only
        # where a document crosses and its prefix is not recomputed by the next rank
        assert cp_calls == {
            "crossing": 4,
            "whole documents per rank": 0,
            "short prefixes recomputed (the default limit)": 0,
            "prefixes over the limit": 4,
        }, cp_calls


def _single_process_checks():
    """Everything that needs only a group of one: state_dict, errors, CP = 1 without collectives."""
    import torch.distributed as dist

    from tests import gdn_harness as h

    world = dist.group.WORLD
    config = h.tiny_config()
    outcome = {}
    torch.manual_seed(0)
    layers = {m: h.build_gdn(config, world, world, m) for m in ("headwise", "chunkwise", "all_gather")}
    for m in ("chunkwise", "all_gather"):  # checkpoints move freely between modes
        layers[m].load_state_dict(layers["headwise"].state_dict())
    shapes = {
        m: {k: getattr(v, "shape", v) for k, v in layer.state_dict().items()} for m, layer in layers.items()
    }
    outcome["same_state_dict"] = shapes["headwise"] == shapes["chunkwise"] == shapes["all_gather"]
    from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet

    stock = layers["chunkwise"].state_dict()
    outcome["stock_keys"] = isinstance(layers["chunkwise"], GatedDeltaNet) and "in_proj.weight" in stock

    # CP = 1 runs no collective in any mode: a group-less all-gather would raise
    x = torch.randn(h.PACKED[-1], 1, config.hidden_size)
    psp = h.packed_params(h.PACKED, "cpu")
    outs = [layers[m](x, None, packed_seq_params=psp)[0] for m in layers]
    outcome["cp1_modes_agree"] = all(torch.equal(outs[0], o) for o in outs[1:])

    # a layer keeps the prefix limit it was built with, the default when none is given; a bad one
    # is refused at build
    told, untold = (
        h.build_gdn(config, world, world, max_recomputed_prefix=0),
        h.build_gdn(config, world, world),
    )
    outcome["prefix_limits"] = (told.row_plans.max_recomputed_prefix, untold.row_plans.max_recomputed_prefix)
    outcome["bad_prefix_limit"] = value_error_message(
        lambda: h.build_gdn(config, world, world, max_recomputed_prefix=-1)
    )
    outcome["unknown_mode"] = value_error_message(lambda: h.build_gdn(config, world, world, "ringwise"))
    outcome["headwise_heads"] = value_error_message(
        lambda: h.build_gdn(
            h.tiny_config(linear_num_key_heads=2, linear_num_value_heads=6),
            world,
            world,
            "headwise",
            max_cp_size=4,
        )
    )
    outcome["chunkwise_deterministic"] = value_error_message(
        lambda: h.build_gdn(h.tiny_config(deterministic_mode=True), world, world, "chunkwise", max_cp_size=2)
    )
    outcome["all_gather_recompute"] = value_error_message(
        lambda: h.build_gdn(
            h.tiny_config(recompute_granularity=None, recompute_method=None, recompute_num_layers=None),
            world,
            world,
            "all_gather",
            max_cp_size=2,
        )
    )
    outcome["dynamic_incomplete"] = value_error_message(
        lambda: layers["chunkwise"](
            x, None, packed_seq_params=h.packed_params(h.PACKED, "cpu", local_cp_size=2)
        )
    )
    outcome["dynamic_mismatch"] = value_error_message(
        lambda: layers["chunkwise"](
            x, None, packed_seq_params=h.packed_params(h.PACKED, "cpu", cp_group=world, local_cp_size=2)
        )
    )
    outcome["wrong_total"] = value_error_message(
        lambda: layers["chunkwise"](x[:80], None, packed_seq_params=psp)
    )
    return outcome


def test_state_dict_cp1_and_errors(gloo):
    (outcome,) = gloo(_single_process_checks, 1)
    assert outcome["same_state_dict"] and outcome["stock_keys"] and outcome["cp1_modes_agree"]
    from relax_gdn.gdn import DEFAULT_MAX_RECOMPUTED_PREFIX

    assert outcome["prefix_limits"] == (0, DEFAULT_MAX_RECOMPUTED_PREFIX)
    assert "gdn.max_recomputed_prefix=-1" in outcome["bad_prefix_limit"]
    assert "gdn.cp_mode='ringwise'" in outcome["unknown_mode"]
    assert "linear_num_key_heads=2" in outcome["headwise_heads"] and "chunkwise" in outcome["headwise_heads"]
    assert "deterministic" in outcome["chunkwise_deterministic"]
    assert "recompute.granularity=full" in outcome["all_gather_recompute"]
    assert "local_cp_size=2" in outcome["dynamic_incomplete"]
    assert "local_cp_size=2" in outcome["dynamic_mismatch"] and "1 ranks" in outcome["dynamic_mismatch"]
    assert "cu_seqlens[-1]=160" in outcome["wrong_total"] and "80" in outcome["wrong_total"]


def test_fla_fp32_gradient_caveat_covers_fp32_on_hopper_only():
    # The measured problem (relax_gdn.bench.gdn_precision): FLA's fp32 backward on an H200.
    from relax_gdn.gdn.kernels import fla_fp32_gradient_caveat

    message = fla_fp32_gradient_caveat(torch.float32, (9, 0))
    assert message and "bf16" in message and "gdn.kernel_backend=torch" in message
    assert fla_fp32_gradient_caveat(torch.bfloat16, (9, 0)) is None  # bf16: within 1 % of fp64
    assert fla_fp32_gradient_caveat(torch.float32, (8, 0)) is None  # not measured: no claim
    assert fla_fp32_gradient_caveat(torch.float32, (10, 0)) is None


def test_fla_kernel_choices_are_each_layers_options():
    """The gate's place and FLA's zigzag CP come from the layer's GDNOptions: one kernel instance per
    distinct choice, none of them a setting of the process."""
    pytest.importorskip("fla.ops.cp")
    from relax_gdn.gdn import kernels
    from relax_gdn.gdn.options import GDNOptions

    cuda = torch.device("cuda")  # a device name only: building the FLA kernels touches no GPU
    plain = kernels.select_kernels(GDNOptions(kernel_backend="fla"), cuda)
    gate_outside = kernels.select_kernels(GDNOptions(kernel_backend="fla", fla_fused_gate=False), cuda)
    zigzag = kernels.select_kernels(GDNOptions(kernel_backend="fla", fla_zigzag_cp=True), cuda)
    assert (plain.fused_gate, plain.zigzag_cp, plain.skip_unread_cp_summaries) == (True, False, True)
    assert (gate_outside.fused_gate, gate_outside.zigzag_cp) == (False, False)
    assert (zigzag.fused_gate, zigzag.zigzag_cp) == (True, True)
    assert (
        kernels.select_kernels(GDNOptions(kernel_backend="fla", fla_fused_gate=False), cuda) is gate_outside
    )
    reference = kernels.select_kernels(GDNOptions(fla_zigzag_cp=True), torch.device("cpu"))
    assert reference.name == "torch" and not reference.zigzag_cp  # the reference scans contiguous slices only
    assert not [n for n in dir(kernels) if n in ("gate_outside_fla", "fla_zigzag_cp")]


def test_max_recomputed_prefix_and_swap_transport_are_checked_with_real_defaults():
    from relax_gdn.gdn import DEFAULT_MAX_RECOMPUTED_PREFIX, layer
    from relax_gdn.gdn.options import GDNOptions, gdn_option_problems

    assert GDNOptions().max_recomputed_prefix == DEFAULT_MAX_RECOMPUTED_PREFIX
    assert GDNOptions().swap_transport == "auto"
    assert (
        gdn_option_problems(GDNOptions()) == []
        and gdn_option_problems(GDNOptions(max_recomputed_prefix=0)) == []
    )
    for bad in (-1, 1.5, True, "1024", None):
        problems = gdn_option_problems(GDNOptions(max_recomputed_prefix=bad))
        assert len(problems) == 1 and "gdn.max_recomputed_prefix" in problems[0], (bad, problems)
    assert "gdn.swap_transport=None" in " ".join(gdn_option_problems(GDNOptions(swap_transport=None)))
    # the limit is each layer's (told at build), not a class attribute or a setter of the process
    assert not hasattr(layer.CPGatedDeltaNet, "max_recomputed_prefix")
    assert not [n for n in dir(layer) if n in ("set_max_recomputed_prefix", "prefixes_recomputed_up_to")]
