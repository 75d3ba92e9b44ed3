"""relax_gdn.model.qwen3_5 on CPU: the tiny Qwen3.5 over CP = 2 (every GDN mode, and chunkwise under
dynamic CP) and over TP = 2 x CP = 2 (SP on and off) equals TP = CP = 1 on the same weights and
packed batch (per-token loss and every parameter gradient), packing leaks nothing across
documents, the 9B preset has the published shapes, RoPE by per-token positions equals
Megatron-Core's THD RoPE, configuration errors, and the spec-provider choice.

Each case is one job of the session's gloo pools (tests/conftest.py); the single-rank reference
is computed once per pool rank and shared by the cases.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.distributed import computed_once, value_error_message
from tests.helpers import GDN_MODES
from tests.model_harness import CU, FULL_RECOMPUTE, LOSS_TOL, tp_shard
from tests.model_harness import batch as _batch
from tests.model_harness import build as _build
from tests.model_harness import errors as _errors
from tests.model_harness import finalize_grads as _finalize_grads
from tests.model_harness import loss_and_grads as _run
from tests.model_harness import tolerance as _tolerance

# ---------------------------------------------------------------------------------------------
# helpers run inside the worker processes
# ---------------------------------------------------------------------------------------------


def _tp2_cp2_groups():
    """The pool of 4 as TP 2 x CP 2: (a one-rank group, this rank's TP pair {0,1}/{2,3}, its CP pair
    {0,2}/{1,3}); every rank makes the same groups in the same order."""
    import torch.distributed as dist

    from tests.gdn_harness import self_group

    rank = dist.get_rank()
    single = self_group()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return single, pairs[rank // 2], strided[rank % 2]


# ---------------------------------------------------------------------------------------------
# the jobs the session's gloo pools run (one per test case)
# ---------------------------------------------------------------------------------------------


def _tiny_reference():
    """TP = CP = 1 on the whole batch: the weights (perturbed so every one matters), per-token
    loss and gradients; made once per pool rank, the same on every rank."""

    def make():
        from relax_gdn.model import qwen3_5_config, qwen3_5_preset
        from tests.gdn_harness import self_group

        single = self_group()
        tokens, labels, positions = _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size)
        torch.manual_seed(0)
        reference = _build(
            qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True), single, single, single
        )
        with torch.no_grad():  # zero-centred norms start at 0: perturb so every weight matters
            for p in reference.parameters():
                p.add_(0.05 * torch.randn_like(p))
        ref_loss, ref_grads = _run(reference, tokens, labels, positions, CU)
        return reference.state_dict(), ref_loss, ref_grads

    return computed_once("qwen3_5_tiny reference", make)


def _cp2_errors(mode: str) -> dict[str, float]:
    """CP = 2 (the pool of 2), TP = 1, one GDN mode: errors against the reference."""
    import torch.distributed as dist

    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model import qwen3_5_config, qwen3_5_preset
    from tests.gdn_harness import self_group

    state, ref_loss, ref_grads = _tiny_reference()
    single, pair = self_group(), dist.group.WORLD
    tokens, labels, positions = _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size)
    ids = thd_rank_indices(CU, 2, pair.rank(), "zigzag")
    recompute = FULL_RECOMPUTE if mode == "all_gather" else {}
    config = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True, **recompute)
    model = _build(config, single, pair, single, mode)
    model.load_state_dict(state)
    loss, grads = _run(model, tokens, labels, positions, CU, ids)
    grads = _finalize_grads(model, grads, config, single, pair)
    return _errors(ref_loss, ref_grads, loss, grads, ids)


def _dynamic_cp2_errors() -> dict[str, float]:
    """Dynamic CP (the pool of 4): the model's static CP group is all 4 ranks, the micro-batch runs
    on a pair (PackedSeqParams.cp_group / local_cp_size), as relax_gdn.parallel hands it out."""
    import torch.distributed as dist

    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model import qwen3_5_config, qwen3_5_preset
    from tests.gdn_harness import self_group

    state, ref_loss, ref_grads = _tiny_reference()
    single = self_group()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    pair = pairs[dist.get_rank() // 2]
    tokens, labels, positions = _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size)
    ids = thd_rank_indices(CU, 2, pair.rank(), "zigzag")
    base = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True)
    model = _build(base, single, dist.group.WORLD, single, "chunkwise", max_cp_size=4)
    model.load_state_dict(state)
    loss, grads = _run(model, tokens, labels, positions, CU, ids, cp_group=pair)
    grads = _finalize_grads(model, grads, base, single, pair)
    return _errors(ref_loss, ref_grads, loss, grads, ids)


def _tp2cp2_errors(mode: str, sp: bool) -> dict[str, float]:
    """TP = 2 x CP = 2 (the pool of 4): TP groups {0,1},{2,3}; CP groups {0,2},{1,3}."""
    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model import qwen3_5_config, qwen3_5_preset

    state, ref_loss, ref_grads = _tiny_reference()
    single, tp_group, cp_group = _tp2_cp2_groups()
    tp_rank, cp_rank = tp_group.rank(), cp_group.rank()
    tokens, labels, positions = _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size)
    ids = thd_rank_indices(CU, 2, cp_rank, "zigzag")
    config = qwen3_5_config(
        "qwen3_5_tiny",
        use_cpu_initialization=True,
        tensor_model_parallel_size=2,
        sequence_parallel=sp,
        **(FULL_RECOMPUTE if mode == "all_gather" else {}),
    )
    model = _build(config, tp_group, cp_group, single, mode)
    params = dict(model.named_parameters())

    def shard(name, full):
        return tp_shard(name, full, params[name], config, 2, tp_rank)

    model.load_state_dict({k: shard(k, v) if k in params else v for k, v in state.items()})
    loss, grads = _run(model, tokens, labels, positions, CU, ids)
    grads = _finalize_grads(model, grads, config, tp_group, cp_group)
    return _errors(ref_loss, ref_grads, loss, grads, ids, shard)


def _rename_qk_norms(model) -> dict[str, str]:
    """Register every attention layer's QK-norms as ``query_norm`` / ``key_norm``: the layer still
    runs them (an instance attribute keeps the old name reachable), while no parameter name says
    ``q_layernorm`` / ``k_layernorm`` any more. Returns {new parameter name: old one}."""
    before = {id(p): n for n, p in model.named_parameters()}
    for layer in model.decoder.layers:
        attention = layer.self_attention
        for old, new in (("q_layernorm", "query_norm"), ("k_layernorm", "key_norm")):
            module = attention._modules.pop(old, None)
            if module is not None:
                attention._modules[new] = module
                object.__setattr__(attention, old, module)
    return {n: before[id(p)] for n, p in model.named_parameters() if n != before[id(p)]}


def _renamed_qk_norms_case(state, reference, batch, tp_group, cp_group, single, ids) -> dict:
    """TP = 2 x CP = 2 with the QK-norms under other names, gradients synced by the CPU path's
    optimizer (``CPUGradSyncOptimizer``): the QK-norms' TP-partial gradients are summed because
    their parameters say so, whatever their modules are called."""
    from relax_gdn.config import RunConfig
    from relax_gdn.model import qwen3_5_config
    from relax_gdn.train.optimizer import CPUGradSyncOptimizer
    from tests.gdn_harness import packed_params

    (ref_loss, ref_grads), (tokens, labels, positions) = reference, batch
    config = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True, tensor_model_parallel_size=2)
    model = _build(config, tp_group, cp_group, single, "chunkwise")
    params = dict(model.named_parameters())

    def shard(name, full):
        return tp_shard(name, full, params[name], config, 2, tp_group.rank())

    model.load_state_dict({k: shard(k, v) if k in params else v for k, v in state.items()})
    renamed = _rename_qk_norms(model)
    optimizer = CPUGradSyncOptimizer(
        model, RunConfig(), dp_cp_group=cp_group, tp_group=tp_group, sequence_parallel=False
    )
    optimizer.zero_grad()
    loss = model(
        tokens[:, ids],
        positions[:, ids],
        None,
        labels=labels[:, ids],
        packed_seq_params=packed_params(CU, "cpu"),
    )
    loss.sum().backward()
    optimizer._finish_grad_sync()  # DP x CP sum, then the TP-partial ones over TP
    grads = {renamed.get(n, n): p.grad.detach().clone() for n, p in model.named_parameters()}
    return {
        "errors": _errors(ref_loss, ref_grads, loss.detach(), grads, ids, shard),
        "renamed": sorted(renamed),
        "names": [n for n, _ in model.named_parameters()],
    }


def _tp2_renamed_qk_norms() -> dict:
    """The renamed-QK-norm case at TP = 2 x CP = 2 (the pool of 4)."""

    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model import qwen3_5_preset

    state, ref_loss, ref_grads = _tiny_reference()
    single, tp_group, cp_group = _tp2_cp2_groups()
    batch = _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size)
    ids = thd_rank_indices(CU, 2, cp_group.rank(), "zigzag")
    return _renamed_qk_norms_case(state, (ref_loss, ref_grads), batch, tp_group, cp_group, single, ids)


def _packed_vs_alone() -> dict[str, float]:
    """Packing leaks nothing: each document alone gives the same per-token loss (the pool of 1)."""
    import torch.distributed as dist

    from relax_gdn.model import qwen3_5_config, qwen3_5_preset
    from tests.gdn_harness import packed_params

    state, _, _ = _tiny_reference()
    single = dist.group.WORLD
    tokens, labels, positions = _batch(qwen3_5_preset("qwen3_5_tiny").vocab_size)
    reference = _build(qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True), single, single, single)
    reference.load_state_dict(state)
    whole = reference(tokens, positions, None, labels=labels, packed_seq_params=packed_params(CU, "cpu"))
    leak = 0.0
    for a, b in zip(CU, CU[1:]):
        if a == b:
            continue
        alone = reference(
            tokens[:, a:b],
            positions[:, a:b],
            None,
            labels=labels[:, a:b],
            packed_seq_params=packed_params([0, b - a], "cpu"),
        )
        leak = max(leak, (alone - whole[:, a:b]).abs().max().item())
    return {"loss": leak}


def _alone(check: str):
    """A check that needs a group of one rank only (the pool of 1)."""
    import torch.distributed as dist

    from relax_gdn.model import qwen3_5_config
    from relax_gdn.model import qwen3_5_specs as specs

    single = dist.group.WORLD
    if check == "counts":  # the 9B preset on the meta device: parameter counts of docs/design/QWEN3_5.md
        return _nine_b_counts(single)
    if check == "errors":
        return {
            **_configuration_errors(single),
            "te_imports": specs.transformer_engine_import_error() is None,
        }
    if check == "spec_provider":
        return _spec_provider_choice()
    assert check == "rope", check
    return _rope_against_megatron(config=qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True))


def _nine_b_counts(single) -> dict[str, int]:
    from relax_gdn.model import qwen3_5_config

    config = qwen3_5_config("qwen3_5_9b", use_cpu_initialization=True, perform_initialization=False)
    with torch.device("meta"):
        model = _build_9b(config, single)
    layers = model.decoder.layers
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    kinds = [type(layer.self_attention).__name__ for layer in layers]
    return {
        "total": count(model),
        "gdn": count(layers[0].self_attention),
        "attention": count(layers[3].self_attention),
        "mlp": count(layers[0].mlp),
        "attention_layers": [i for i, k in enumerate(kinds) if k == "Qwen3_5SelfAttention"],
        "gdn_layers": sum(k == "CPGatedDeltaNet" for k in kinds),
        "tied": int(model.share_embeddings_and_output_weights),
    }


def _build_9b(config, single):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from relax_gdn.model import build_qwen3_5_preset_model

    pgs = ProcessGroupCollection(tp=single, cp=single, pp=single, embd=single)
    return build_qwen3_5_preset_model("qwen3_5_9b", config, pg_collection=pgs)


def _configuration_errors(single) -> dict[str, str | None]:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model import Qwen3_5Options, build_qwen3_5_model, qwen3_5_config

    pgs = ProcessGroupCollection(tp=single, cp=single, pp=single, embd=single)
    config = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True)

    def build(cfg=config, groups=pgs, **fields):
        return build_qwen3_5_model(
            cfg, Qwen3_5Options(vocab_size=256, max_sequence_length=64, **fields), groups
        )

    tp2 = qwen3_5_config("qwen3_5_tiny", use_cpu_initialization=True, tensor_model_parallel_size=2)
    return {
        "pp": value_error_message(lambda: qwen3_5_config("qwen3_5_tiny", pipeline_model_parallel_size=2)),
        "te_specs": value_error_message(lambda: build(spec_provider="te")),
        "te_attention": value_error_message(lambda: build(spec_provider="local", attention_backend="te")),
        "tp_mismatch": value_error_message(lambda: build(tp2)),
        "all_gather": value_error_message(lambda: build(gdn=GDNOptions(cp_mode="all_gather", max_cp_size=2))),
        "missing_groups": value_error_message(
            lambda: build(groups=ProcessGroupCollection(tp=single, cp=single))
        ),
        "no_positions": value_error_message(lambda: build()(torch.zeros(1, 8, dtype=torch.long), None, None)),
    }


def _spec_provider_choice() -> dict:
    from relax_gdn.model import qwen3_5 as q
    from relax_gdn.model import qwen3_5_specs as specs

    outcome = {"te_imports": specs.transformer_engine_import_error() is None}
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    specs.logger.addHandler(handler)
    specs.logger.setLevel(logging.INFO)
    specs._logged_choices.clear()
    outcome["choices"] = [specs.resolve_spec_provider(p) for p in ("auto", "auto", "local")]
    outcome["logged"] = [m for m in records if "spec provider" in m]
    for name, fn in {
        "te": lambda: specs.resolve_spec_provider("te"),
        "unknown": lambda: specs.resolve_spec_provider("tex"),
        "preset": lambda: q.qwen3_5_config("qwen3_5_4b"),
        "field": lambda: q.qwen3_5_config("qwen3_5_tiny", hidden_sise=8),
    }.items():
        try:
            fn()
            outcome[name] = None
        except ValueError as e:
            outcome[name] = str(e)
    return outcome


class _FakeCPGroup:
    """Rank and size, all Megatron-Core's THD RoPE asks of its CP group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _rope_against_megatron(config) -> dict[int, float]:
    """Per-token RoPE from zigzag-sharded positions vs Megatron-Core's own THD RoPE (which splits
    each document's positions for its static CP group itself), on every rank of CP = 1, 2, 4."""
    from megatron.core.models.common.embeddings.rope_utils import (
        _apply_rotary_pos_emb_thd,
        apply_rotary_pos_emb,
    )
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from relax_gdn.layout import thd_rank_indices
    from relax_gdn.model import TokenRotaryEmbedding

    cu = [0, 16, 16, 24, 64, 72]  # multiples of 2*4
    kwargs = dict(
        kv_channels=config.kv_channels, rotary_percent=0.25, rotary_base=1e7, use_cpu_initialization=True
    )
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    theirs = RotaryEmbedding(**kwargs, cp_group=_FakeCPGroup(1, 0))(longest, packed_seq=True)
    ours = TokenRotaryEmbedding(**kwargs, cp_group=_FakeCPGroup(1, 0))
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])
    x = torch.randn(cu[-1], 4, config.kv_channels, generator=torch.Generator().manual_seed(3))
    errors = {}
    for cp in (1, 2, 4):
        worst = 0.0
        for r in range(cp):
            ids = thd_rank_indices(cu, cp, r, "zigzag")
            expect = _apply_rotary_pos_emb_thd(x[ids], torch.tensor(cu), theirs, cp_group=_FakeCPGroup(cp, r))
            got = apply_rotary_pos_emb(
                x[ids].unsqueeze(1),
                ours.for_positions(positions[ids][None]),
                config=config,
                cp_group=_FakeCPGroup(cp, r),
            ).squeeze(1)
            assert torch.equal(got[..., 4:], x[ids][..., 4:])  # partial: 4 of 16 dims rotate
            worst = max(worst, (got - expect).abs().max().item())
        errors[cp] = worst
    return errors


@pytest.mark.parametrize("mode", [*GDN_MODES, "chunkwise_dynamic"])
def test_cp2_every_mode_and_dynamic_cp_match_single_rank(gloo, mode):
    per_rank = gloo(_dynamic_cp2_errors, 4) if mode == "chunkwise_dynamic" else gloo(_cp2_errors, 2, mode)
    for rank, errors in enumerate(per_rank):
        assert len(errors) > 40  # loss + every parameter
        bad = {k: v for k, v in errors.items() if not v < _tolerance(k)}
        assert not bad, (rank, mode, bad)


@pytest.mark.parametrize(
    "mode,sp", [("chunkwise", False), ("chunkwise", True), ("headwise", True), ("all_gather", False)]
)
def test_tp2_cp2_with_and_without_sp_matches_single_rank(gloo, mode, sp):
    for rank, errors in enumerate(gloo(_tp2cp2_errors, 4, mode, sp)):
        assert len(errors) > 40  # loss + every parameter
        bad = {k: v for k, v in errors.items() if not v < _tolerance(k)}
        assert not bad, (rank, mode, sp, bad)


def test_tp_partial_gradients_follow_the_parameter_not_its_name(gloo):
    """The QK-norms renamed: the CPU optimizer still sums their TP-partial gradients (an attribute
    set where the norm makes its weight), and every gradient matches the single-rank model."""
    for rank, case in enumerate(gloo(_tp2_renamed_qk_norms, 4)):
        assert len(case["renamed"]) == 2, case["renamed"]  # q and k norm of the tiny model's attention layer
        assert not [n for n in case["names"] if "q_layernorm" in n or "k_layernorm" in n]
        assert len(case["errors"]) > 40  # loss + every parameter
        bad = {k: v for k, v in case["errors"].items() if not v < _tolerance(k)}
        assert not bad, (rank, bad)


def test_packed_documents_do_not_leak(gloo):
    assert gloo(_packed_vs_alone, 1)[0]["loss"] < LOSS_TOL


def test_nine_b_preset_shapes(gloo):
    counts = gloo(_alone, 1, "counts")[0]
    assert abs(counts["total"] - 8.954e9) < 0.5e6, counts  # docs/design/QWEN3_5.md: 8.954 B
    assert round(counts["gdn"] / 1e6, 2) == 67.40
    assert round(counts["attention"] / 1e6, 2) == 58.72
    assert round(counts["mlp"] / 1e6, 2) == 150.99
    assert counts["attention_layers"] == list(range(3, 32, 4)) and counts["gdn_layers"] == 24
    assert counts["tied"] == 0


def test_configuration_errors(gloo):
    errors = gloo(_alone, 1, "errors")[0]
    assert "pipeline_model_parallel_size=2" in errors["pp"] and "parallel.pp=1" in errors["pp"]
    if not errors["te_imports"]:
        assert "spec_provider='te' needs Transformer Engine" in errors["te_specs"]
    assert "attention_backend='te'" in errors["te_attention"]
    assert "tensor_model_parallel_size=2" in errors["tp_mismatch"] and "1 ranks" in errors["tp_mismatch"]
    assert "recompute.granularity=full" in errors["all_gather"]
    assert "lacks ['pp', 'embd']" in errors["missing_groups"]
    assert "position_ids" in errors["no_positions"]


def test_spec_provider_auto_is_local_and_te_refuses_without_te(gloo):
    outcome = gloo(_alone, 1, "spec_provider")[0]
    assert outcome["choices"] == ["local", "local", "local"]  # auto is the verified path, TE or not
    assert len(outcome["logged"]) == 2  # once per choice
    if outcome["te_imports"]:
        assert "model.spec_provider=te selects its specs" in outcome["logged"][0]
        pytest.skip("Transformer Engine imports here: the refusal of spec_provider=te cannot be checked")
    assert "no transformer_engine" in outcome["logged"][0]
    assert "spec_provider='te' needs Transformer Engine" in outcome["te"]
    assert "spec_provider='local'" in outcome["te"]
    assert "unknown spec_provider 'tex'" in outcome["unknown"]
    assert "unknown Qwen3.5 preset 'qwen3_5_4b'" in outcome["preset"]
    assert "['hidden_sise'] are not TransformerConfig fields" in outcome["field"]


def test_token_rope_equals_megatron_thd_rope(gloo):
    errors = gloo(_alone, 1, "rope")[0]
    assert set(errors) == {1, 2, 4} and max(errors.values()) < 1e-6, errors
