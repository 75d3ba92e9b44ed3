"""relax_gdn.model.gdn_runs: chunkwise GDN runs keep the residual stream contiguous.

Which layer boundaries are contiguous (pure function, every pattern shape); then, on CPU over
real gloo process groups and the real Megatron-Core tiny Qwen3.5: CP = 2 and 4 equal CP = 1
(per-token loss and every parameter gradient) with the switch on and off, under full recompute,
under dynamic CP, and with a pattern that ends in GDN layers (the loss then follows a GDN run);
CP = 1 with the switch on is bit-identical to off; the swaps per forward and per backward drop
from 2 x (GDN layers) to 2 x (GDN runs), counted through the swap's profiler range.

Each case is one job of the session's gloo pools (tests/conftest.py); the CP = 1 reference is
computed once per pool rank and layer count.
"""

from __future__ import annotations

import pytest
import torch

from relax_gdn.model.gdn_runs import residual_layouts
from tests.distributed import computed_once, value_error_message
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
    # the profiler's recorded events as they came: prof.events() first builds their call tree
    # (about 0.5 s of CPU per profile here), which a count of the swap's ranges does not need
    return sum(e.name().startswith(SWAP) for e in prof.profiler.kineto_results.events())


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


def _config(layers: int, **overrides):
    from relax_gdn.model import qwen3_5_config

    return qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True, num_layers=layers, **overrides)


def _reference(layers: int):
    """CP = 1 with the switch off, on the whole batch: the weights (perturbed so every one matters),
    loss, gradients and swaps; made once per pool rank and layer count, the same on every rank."""

    def make():
        from relax_gdn.model import qwen3_5_preset
        from tests.gdn_harness import self_group

        single = self_group()
        batch = _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size)
        torch.manual_seed(0)
        reference = _build(_config(layers), single, single, single, contiguous_between_layers=False)
        with torch.no_grad():  # zero-centred norms start at 0: perturb so every weight matters
            for p in reference.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return (reference.state_dict(), *_run(reference, batch, list(range(CU[-1]))))

    return computed_once(("contiguous runs reference", layers), make)


def _cp1_switch_on(layers: int) -> dict:
    """CP = 1 with the switch on (the pool of 1): the conversions are identities, the numbers
    bit-identical to the reference."""
    import torch.distributed as dist

    from relax_gdn.model import qwen3_5_preset

    state, ref_loss, ref_grads, ref_swaps = _reference(layers)
    single = dist.group.WORLD
    model = _build(_config(layers), single, single, single)
    model.load_state_dict(state)
    loss, grads, swaps = _run(model, _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size), list(range(CU[-1])))
    identical = torch.equal(loss, ref_loss) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    return {"off_swaps": ref_swaps, "on_swaps": swaps, "identical": identical}


# (layers, CP, switch, variant); CP 2 runs on the pool of 2, CP 4 and dynamic CP on the pool of 4
CP_CASES = [
    (layers, cp, switch, variant)
    for layers in (4, 6)
    for cp, switch, variant in [
        (2, "on", "plain"),
        (2, "off", "plain"),
        (2, "on", "recompute"),
        (4, "on", "plain"),
        (4, "off", "plain"),
    ]
    + ([(4, "on", "recompute"), (2, "on", "dynamic")] if layers == 4 else [])
]


def _case_id(case) -> str:
    layers, cp, switch, variant = case
    return f"{layers}layers-cp{cp}-{switch}-{variant}"


def _world_size(case) -> int:
    _, cp, _, variant = case
    return 4 if variant == "dynamic" else cp


def _cp_case(layers: int, cp: int, switch: str, variant: str) -> dict:
    """One CP case against the reference: errors, swaps and the decoder's layer kinds."""
    import torch.distributed as dist

    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model import qwen3_5_preset
    from tests.gdn_harness import self_group

    state, ref_loss, ref_grads, _ = _reference(layers)
    single, world = self_group(), dist.group.WORLD
    dynamic = variant == "dynamic"
    if dynamic:  # the pool of 4: the micro-batch runs on a pair of it
        pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][dist.get_rank() // 2]
    else:
        pair = world  # CP 2 on the pool of 2
    cfg = _config(layers, **(FULL_RECOMPUTE if variant == "recompute" else {}))
    model = _build(
        cfg,
        single,
        world,
        single,
        contiguous_between_layers=switch == "on",
        **({"max_cp_size": 4} if dynamic else {}),
    )
    model.load_state_dict(state)
    cp_group = pair if cp == 2 else world
    ids = thd_rank_indices(CU, cp, cp_group.rank(), "zigzag")
    batch = _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size)
    loss, grads, swaps = _run(model, batch, ids, cp_group=pair if dynamic else None)
    grads = _finalize_grads(model, grads, cfg, single, cp_group)
    return {
        "errors": _errors(ref_loss, ref_grads, loss, grads, ids),
        "swaps": swaps,
        "layer_kinds": [type(layer).__name__ for layer in model.decoder.layers],
    }


def _configuration_errors() -> dict:
    """On the pool of 2 (a TP group of 2 for the sequence-parallel spec)."""
    import torch.distributed as dist

    from relax_gdn.model import Qwen3_5Options, qwen3_5_config
    from relax_gdn.model.qwen3_5_specs import qwen3_5_block_spec
    from tests.gdn_harness import build_gdn, self_group, tiny_config

    single, pair = self_group(), dist.group.WORLD
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
            for spec in qwen3_5_block_spec(
                sp, Qwen3_5Options.for_preset("qwen3_5_tiny", spec_provider="local"), tp_group=pair
            ).layer_specs
        ],
    }


def _bad(errors: dict[str, float]) -> dict[str, float]:
    assert len(errors) > 40  # loss + every parameter
    return {k: v for k, v in errors.items() if not v < _tolerance(k)}


@pytest.mark.parametrize("case", CP_CASES, ids=_case_id)
def test_cp2_and_cp4_equal_cp1_with_the_switch_on_and_off(gloo_once, case):
    for rank, res in enumerate(gloo_once(_cp_case, _world_size(case), *case)):
        assert not _bad(res["errors"]), (rank, case, _bad(res["errors"]))


def test_full_recompute_and_dynamic_cp_are_covered():
    assert len([c for c in CP_CASES if c[0] == 4]) == 7 and len([c for c in CP_CASES if c[0] == 6]) == 5
    assert {
        (4, 2, "on", "recompute"),
        (4, 4, "on", "recompute"),
        (6, 2, "on", "recompute"),
        (4, 2, "on", "dynamic"),
    } <= set(CP_CASES)


@pytest.mark.parametrize("layers", [4, 6])
def test_cp1_with_the_switch_on_is_bit_identical_and_swaps_nothing(gloo_once, layers):
    for res in gloo_once(_cp1_switch_on, 1, layers):
        assert res["identical"]
        assert res["on_swaps"] == {"forward": 0, "backward": 0}
        assert res["off_swaps"] == {"forward": 0, "backward": 0}


@pytest.mark.parametrize("layers", [4, 6])
def test_swaps_drop_from_two_per_gdn_layer_to_two_per_gdn_run(gloo_once, layers):
    gdn_layers, runs = {4: 3, 6: 5}, {4: 1, 6: 2}

    def swaps(cp, switch, variant):
        return [
            res["swaps"]
            for res in gloo_once(
                _cp_case, _world_size((layers, cp, switch, variant)), layers, cp, switch, variant
            )
        ]

    for cp in (2, 4):
        for off, on in zip(swaps(cp, "off", "plain"), swaps(cp, "on", "plain")):
            assert off == {"forward": 2 * gdn_layers[layers], "backward": 2 * gdn_layers[layers]}
            assert on == {"forward": 2 * runs[layers], "backward": 2 * runs[layers]}
    # full recompute replays the forward's swaps once in the backward
    for replayed in swaps(2, "on", "recompute"):
        assert replayed == {"forward": 2 * runs[layers], "backward": 4 * runs[layers]}
    if layers == 4:
        for dynamic in swaps(2, "on", "dynamic"):
            assert dynamic == {"forward": 2, "backward": 2}


def test_gdn_layers_of_a_run_are_contiguous_layers(gloo_once):
    assert gloo_once(_cp_case, 2, 4, 2, "on", "plain")[0]["layer_kinds"] == ["ContiguousGDNLayer"] * 3 + [
        "TransformerLayer"
    ]
    assert gloo_once(_configuration_errors, 2)[0]["sp_layer_kinds"] == ["TransformerLayer"] * 4


def test_contiguous_hidden_layout_needs_chunkwise(gloo_once):
    errors = gloo_once(_configuration_errors, 2)[0]
    assert "hidden_layout='contiguous' needs gdn.cp_mode=chunkwise" in errors["headwise"]
    assert "unknown GDN hidden_layout 'global'" in errors["unknown"]
