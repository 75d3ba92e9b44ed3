"""relax_gdn.model.gdn_runs: chunkwise GDN runs keep the residual stream contiguous.

Which layer boundaries are contiguous (pure function, every pattern shape); then, on CPU over
real gloo process groups and the real Megatron-Core tiny Qwen3.5: CP = 2 and 4 equal CP = 1
(per-token loss and every parameter gradient) with the switch on and off, under full recompute,
under dynamic CP, and with a pattern that ends in GDN layers (the loss then follows a GDN run);
CP = 1 with the switch on is bit-identical to off; the swaps per forward and per backward drop
from 2 x (GDN layers) to 2 x (GDN runs), counted through the swap's profiler range.

All process-group cases run in ONE spawn of 4 gloo processes.
"""

from __future__ import annotations

import pytest
import torch

from relax_gdn.model.gdn_runs import residual_layouts
from tests.distributed import run_distributed, value_error_message
from tests.model_harness import FULL_RECOMPUTE
from tests.model_harness import build as _build
from tests.model_harness import errors as _errors
from tests.model_harness import finalize_grads as _finalize_grads
from tests.model_harness import tolerance as _tolerance

Z, C = "zigzag", "contiguous"
QWEN = [True, True, True, False]  # one Qwen3.5 block: GDN, GDN, GDN, attention
ENDS_IN_GDN = QWEN + [True, True]  # num_layers=6 of the same 3:1 frequency: 2 runs, the last at the loss
# multiples of 2 x CP = 8 for CP <= 4: short documents, an empty padding slot, one long document
# spanning several ranks' contiguous slices
CU = [0, 16, 16, 24, 64, 72]
SWAP = "relax_gdn.swap"


def _layouts(pattern, **kwargs):
    options = dict(contiguous_between_layers=True, cp_mode="chunkwise", sequence_parallel=False)
    return residual_layouts(pattern, **{**options, **kwargs})


def test_contiguous_boundaries_are_those_inside_gdn_runs():
    assert _layouts(QWEN) == (Z, C, C, Z, Z)
    assert _layouts(QWEN * 2) == (Z, C, C, Z, Z, C, C, Z, Z)
    assert _layouts(ENDS_IN_GDN) == (Z, C, C, Z, Z, C, Z)  # the loss still sees zigzag
    assert _layouts([True, False, True, False]) == (Z,) * 5  # runs of one: the mixer swaps itself
    assert _layouts([True] * 3) == (Z, C, C, Z)
    assert _layouts([]) == (Z,)


def test_only_chunkwise_without_sequence_parallel_keeps_runs_contiguous():
    assert _layouts(QWEN, contiguous_between_layers=False) == (Z,) * 5
    assert _layouts(QWEN, cp_mode="headwise") == (Z,) * 5
    assert _layouts(QWEN, cp_mode="all_gather") == (Z,) * 5
    assert _layouts(QWEN, sequence_parallel=True) == (Z,) * 5


# ---------------------------------------------------------------------------------------------
# inside the worker processes
# ---------------------------------------------------------------------------------------------


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (1, CU[-1]), generator=g)
    labels = torch.randint(0, vocab, (1, CU[-1]), generator=g)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(CU, CU[1:])])[None]
    return tokens, labels, positions


def _swaps(prof) -> int:
    return sum(e.name.startswith(SWAP) for e in prof.events())


def _run(model, batch, ids, cp_group=None):
    """Per-token loss, parameter gradients of ``sum(loss)`` and the swaps counted in the forward
    and in the backward, on the rows ``ids`` of the batch."""
    from torch.profiler import profile

    from tests.gdn_harness import packed_params

    tokens, labels, positions = (t[:, ids] for t in batch)
    dynamic = {} if cp_group is None else {"cp_group": cp_group, "local_cp_size": cp_group.size()}
    psp = packed_params(CU, "cpu", **dynamic)
    with profile() as forward:
        loss = model(tokens, positions, None, labels=labels, packed_seq_params=psp)
    with profile() as backward:
        loss.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, {"forward": _swaps(forward), "backward": _swaps(backward)}


def _cases():
    import torch.distributed as dist

    from relax_gdn.compat.cpu import apply_cpu_shims
    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model import qwen3_5_config, qwen3_5_preset

    apply_cpu_shims()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(4)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    single, pair, world = singles[rank], pairs[rank // 2], dist.group.WORLD
    batch = _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size)
    everything = list(range(CU[-1]))
    results = {}

    for layers in (4, 6):
        def config(**overrides):
            return qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True, num_layers=layers, **overrides)

        torch.manual_seed(0)
        reference = _build(config(), single, single, single, contiguous_between_layers=False)
        with torch.no_grad():  # zero-centred norms start at 0: perturb so every weight matters
            for p in reference.parameters():
                p.add_(0.05 * torch.randn_like(p))
        state = reference.state_dict()
        ref_loss, ref_grads, ref_swaps = _run(reference, batch, everything)
        results[(layers, "cp1", "off", "swaps")] = ref_swaps

        # CP = 1 with the switch on: the conversions are identities, the numbers bit-identical
        model = _build(config(), single, single, single)
        model.load_state_dict(state)
        loss, grads, swaps = _run(model, batch, everything)
        results[(layers, "cp1", "on", "swaps")] = swaps
        results[(layers, "cp1", "on", "identical")] = torch.equal(loss, ref_loss) and all(
            torch.equal(grads[n], g) for n, g in ref_grads.items()
        )

        cases = [(2, "on", {}), (2, "off", {}), (2, "on", FULL_RECOMPUTE), (4, "on", {}), (4, "off", {})]
        if layers == 4:
            cases += [(4, "on", FULL_RECOMPUTE), (2, "on", "dynamic")]
        for cp, switch, extra in cases:
            dynamic = extra == "dynamic"
            cfg = config(**({} if dynamic else extra))
            group = world if cp == 4 or dynamic else pair
            model = _build(
                cfg, single, group, single, contiguous_between_layers=switch == "on",
                **({"max_cp_size": 4} if dynamic else {}),
            )
            model.load_state_dict(state)
            cp_group = pair if cp == 2 else world
            ids = thd_rank_indices(CU, cp, cp_group.rank(), "zigzag")
            loss, grads, swaps = _run(model, batch, ids, cp_group=pair if dynamic else None)
            grads = _finalize_grads(model, grads, cfg, single, cp_group)
            name = "dynamic" if dynamic else ("recompute" if extra else "plain")
            results[(layers, f"cp{cp}", switch, name)] = _errors(ref_loss, ref_grads, loss, grads, ids)
            results[(layers, f"cp{cp}", switch, name, "swaps")] = swaps
            if layers == 4 and cp == 2 and switch == "on" and not extra:
                results["layer_kinds"] = [type(layer).__name__ for layer in model.decoder.layers]

    if rank == 0:
        results["errors"] = _configuration_errors(single, pair)
    return results


def _configuration_errors(single, pair) -> dict:
    from relax_gdn.model import qwen3_5_config
    from relax_gdn.model.qwen3_5 import qwen3_5_block_spec
    from tests.gdn_harness import build_gdn, tiny_config

    config = tiny_config()
    # TP = 2 with sequence parallelism splits each rank's rows over TP too: no contiguous runs
    sp = qwen3_5_config("qwen3_5_tiny", tensor_model_parallel_size=2, sequence_parallel=True)
    return {
        "headwise": value_error_message(
            lambda: build_gdn(config, single, single, "headwise", hidden_layout="contiguous")
        ),
        "unknown": value_error_message(lambda: build_gdn(config, single, single, hidden_layout="global")),
        "sp_layer_kinds": [
            spec.module.__name__
            for spec in qwen3_5_block_spec(sp, spec_provider="local", tp_group=pair).layer_specs
        ],
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(_cases, 4)


def _bad(errors: dict[str, float]) -> dict[str, float]:
    assert len(errors) > 40  # loss + every parameter
    return {k: v for k, v in errors.items() if not v < _tolerance(k)}


@pytest.mark.slow
@pytest.mark.parametrize("layers", [4, 6])
def test_cp2_and_cp4_equal_cp1_with_the_switch_on_and_off(results, layers):
    for rank, res in enumerate(results):
        cases = [k for k in res if k[0] == layers and len(k) == 4 and k[1] != "cp1" and k[3] != "swaps"]
        expected = 7 if layers == 4 else 5
        assert len(cases) == expected, cases
        for case in cases:
            assert not _bad(res[case]), (rank, case, _bad(res[case]))


@pytest.mark.slow
def test_full_recompute_and_dynamic_cp_are_covered(results):
    cases = {k for k in results[0] if len(k) == 4}
    assert {(4, "cp2", "on", "recompute"), (4, "cp4", "on", "recompute"), (6, "cp2", "on", "recompute"),
            (4, "cp2", "on", "dynamic")} <= cases


@pytest.mark.slow
def test_cp1_with_the_switch_on_is_bit_identical_and_swaps_nothing(results):
    for res in results:
        for layers in (4, 6):
            assert res[(layers, "cp1", "on", "identical")]
            assert res[(layers, "cp1", "on", "swaps")] == {"forward": 0, "backward": 0}
            assert res[(layers, "cp1", "off", "swaps")] == {"forward": 0, "backward": 0}


@pytest.mark.slow
def test_swaps_drop_from_two_per_gdn_layer_to_two_per_gdn_run(results):
    gdn_layers, runs = {4: 3, 6: 5}, {4: 1, 6: 2}
    for res in results:
        for layers in (4, 6):
            for cp in (2, 4):
                off = res[(layers, f"cp{cp}", "off", "plain", "swaps")]
                on = res[(layers, f"cp{cp}", "on", "plain", "swaps")]
                assert off == {"forward": 2 * gdn_layers[layers], "backward": 2 * gdn_layers[layers]}
                assert on == {"forward": 2 * runs[layers], "backward": 2 * runs[layers]}
            # full recompute replays the forward's swaps once in the backward
            replayed = res[(layers, "cp2", "on", "recompute", "swaps")]
            assert replayed == {"forward": 2 * runs[layers], "backward": 4 * runs[layers]}
        assert res[(4, "cp2", "on", "dynamic", "swaps")] == {"forward": 2, "backward": 2}


@pytest.mark.slow
def test_gdn_layers_of_a_run_are_contiguous_layers(results):
    assert results[0]["layer_kinds"] == ["ContiguousGDNLayer"] * 3 + ["TransformerLayer"]
    assert results[0]["errors"]["sp_layer_kinds"] == ["TransformerLayer"] * 4


@pytest.mark.slow
def test_contiguous_hidden_layout_needs_chunkwise(results):
    errors = results[0]["errors"]
    assert "hidden_layout='contiguous' needs gdn.cp_mode=chunkwise" in errors["headwise"]
    assert "unknown GDN hidden_layout 'global'" in errors["unknown"]
