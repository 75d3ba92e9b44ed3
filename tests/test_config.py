"""relax_gdn.config: every validation rule fires with a message naming its key(s); the Hydra tree
composes (default, cpu_demo, S1-S4) and each preset validates for its intended world size; the
FLOPs module reproduces docs/design/QWEN3_5.md. All in the pytest process (no process group)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from relax_gdn.config import ConfigError, RunConfig, run_config_from_dict, validate
from tests.helpers import config_with as _cfg

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def _problems(cfg: RunConfig, world: int) -> str:
    with pytest.raises(ConfigError) as info:
        validate(cfg, world)
    return str(info.value)


def test_default_validates_on_one_process():
    dims = validate(RunConfig(), 1)
    assert (dims.dp, dims.tp, dims.cp) == (1, 1, 1)


# (overrides, world size, every string the message must contain)
RULES = [
    (dict(parallel__tp=2, parallel__cp=2), 6, ["world size 6", "parallel.tp", "parallel.cp"]),
    (dict(parallel__tp=8), 8, ["num_attention_heads=4", "parallel.tp=8"]),
    (
        dict(parallel__cp=4, gdn__cp_mode="headwise", model__preset="qwen3_5_tiny", parallel__tp=2),
        8,
        ["gdn.cp_mode=headwise", "linear_num_key_heads=4", "parallel.tp x cp = 2 x 4"],
    ),
    (
        dict(parallel__cp=2, gdn__cp_mode="all_gather", recompute__granularity="none"),
        2,
        ["gdn.cp_mode=all_gather", "recompute.granularity=full"],
    ),
    (
        dict(parallel__cp=2, gdn__cp_mode="all_gather", recompute__granularity="selective"),
        2,
        ["recompute.granularity=full"],
    ),
    (
        dict(parallel__cp=2, gdn__cp_mode="chunkwise", train__deterministic=True),
        2,
        ["gdn.cp_mode=chunkwise", "train.deterministic=false"],
    ),
    (dict(parallel__sp=True), 1, ["parallel.sp=true", "parallel.tp"]),
    (
        dict(parallel__cp=2, parallel__dynamic_cp=dict(enabled=True, max_cp=4)),
        2,
        ["parallel.dynamic_cp.max_cp=4", "parallel.cp=2"],
    ),
    (
        dict(parallel__cp=4, parallel__dynamic_cp=dict(enabled=True, max_cp=3)),
        4,
        ["parallel.dynamic_cp.max_cp=3", "power of two"],
    ),
    (dict(train__global_batch_size=3), 2, ["train.global_batch_size=3", "data-parallel size 2"]),
    (dict(train__max_tokens_per_gpu=0), 1, ["train.max_tokens_per_gpu=0", "even"]),
    (dict(train__max_tokens_per_gpu=511), 1, ["train.max_tokens_per_gpu=511", "even"]),
    (dict(logging__profile_steps=[3, 1]), 1, ["logging.profile_steps=[3, 1]", "first <= last"]),
    (
        dict(train__max_tokens_per_gpu=256, data__max_sample_tokens=512),
        1,
        ["data.max_sample_tokens=512", "train.max_tokens_per_gpu x parallel.cp"],
    ),
    (dict(gdn__cp_mode="ringwise"), 1, ["gdn.cp_mode='ringwise'"]),
    (dict(gdn__route="eager"), 1, ["gdn.route='eager'"]),
    (dict(gdn__swap_transport="nvshmem"), 1, ["gdn.swap_transport='nvshmem'"]),
    (dict(gdn__max_recomputed_prefix=-1), 1, ["gdn.max_recomputed_prefix=-1", ">= 0"]),
    (dict(gdn__max_recomputed_prefix="1k"), 1, ["gdn.max_recomputed_prefix='1k'"]),
    (dict(gdn__contiguous_between_layers="yes"), 1, ["gdn.contiguous_between_layers='yes'", "true or false"]),
    (dict(recompute__granularity="most"), 1, ["recompute.granularity='most'"]),
    (
        dict(logging__wandb=dict(mode="cloud", project="p", entity=None, group=None, tags=[], name=None)),
        1,
        ["logging.wandb.mode='cloud'"],
    ),
    (
        dict(data__source="jsonl", data__path="/nonexistent/train.jsonl"),
        1,
        ["data.path='/nonexistent/train.jsonl'"],
    ),
    (dict(data__source="parquet", data__path=None), 1, ["data.path is required"]),
    (
        dict(data__source="jsonl", data__path="nowhere.jsonl"),
        1,
        ["data.path='nowhere.jsonl'", "looked for from /"],
    ),
    (dict(data__tokenizer="/nonexistent/tok"), 1, ["data.tokenizer='/nonexistent/tok'"]),
    (dict(optim__min_lr=1.0), 1, ["optim.min_lr=1.0"]),
    (dict(optim__warmup_steps=2.5), 1, ["optim.warmup_steps=2.5", "fraction", "whole number"]),
    (dict(optim__warmup_steps=-1), 1, ["optim.warmup_steps=-1"]),
    (dict(checkpoint__resume="/nonexistent/ckpt"), 1, ["checkpoint.resume="]),
    (dict(parallel__cp=3, parallel__dynamic_cp=dict(enabled=True)), 3, ["parallel.cp=3", "power of two"]),
    (
        dict(checkpoint__resume="auto"),
        1,
        ["checkpoint.resume=auto needs checkpoint.dir", "checkpoint.dir=ckpt/"],
    ),
    (dict(model__preset="qwen3_5_4b"), 1, ["model.preset='qwen3_5_4b'"]),
    (dict(train__steps=0), 1, ["train.steps=0"]),
]


@pytest.mark.parametrize("overrides,world,needles", RULES, ids=[",".join(r[0]) for r in RULES])
def test_every_rule_names_its_keys(overrides, world, needles):
    message = _problems(_cfg(**overrides), world)
    for needle in needles:
        assert needle in message, (needle, message)


def test_all_problems_are_reported_together():
    error = pytest.raises(ConfigError, validate, _cfg(parallel__sp=True, train__steps=0, gdn__route="x"), 1)
    assert len(error.value.problems) == 3


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "notes").write_text("mine")
    message = _problems(_cfg(checkpoint__dir=str(tmp_path / "notes")), 1)
    assert f"checkpoint.dir='{tmp_path / 'notes'}' is a file, not a directory" in message
    validate(_cfg(checkpoint__dir=str(tmp_path / "new")), 1)  # a directory still to be made is fine


def test_route_prebuild_is_fine_with_every_mode():
    for mode in ("headwise", "chunkwise", "all_gather"):
        validate(
            _cfg(gdn__cp_mode=mode, gdn__route="prebuild", parallel__cp=2, recompute__granularity="full"), 2
        )


def test_unknown_keys_in_a_dict_are_refused():
    values = RunConfig().to_dict()
    values["parallel"]["pp"] = 2
    with pytest.raises(ValueError, match=r"unknown config key 'parallel.pp'"):
        run_config_from_dict(values)


def test_dotted_overrides_set_nested_keys_and_refuse_unknown_ones():
    cfg = RunConfig().with_overrides({"train.steps": 7, "parallel.dynamic_cp.max_cp": 4})
    assert cfg.train.steps == 7 and cfg.parallel.dynamic_cp.max_cp == 4 and RunConfig().train.steps != 7
    with pytest.raises(ValueError, match=r"unknown config key 'train.stpes'"):
        RunConfig().with_overrides({"train.stpes": 7})
    with pytest.raises(ValueError, match=r"'train.steps.x'.*train.steps is not a group"):
        RunConfig().with_overrides({"train.steps.x": 7})


# ------------------------------------------------------------------------------------- Hydra


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    from relax_gdn.config.hydra_io import register_schema, run_config_from_hydra

    register_schema()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return run_config_from_hydra(compose(config_name="config", overrides=list(overrides)))


def test_default_composition_is_the_cpu_demo():
    cfg = _compose()
    assert cfg.model.preset == "qwen3_5_tiny" and cfg.data.source == "synthetic"
    assert cfg.data.tokenizer == "embedded" and cfg.logging.wandb.mode == "disabled"
    assert cfg.train.device == "auto" and cfg.parallel.cp == 1
    validate(cfg, 1)
    demo = _compose("experiment=cpu_demo")
    assert demo == cfg
    validate(_compose("experiment=cpu_demo", "parallel.cp=2"), 2)


def test_the_composed_default_is_the_dataclass_default():
    """``python train.py`` with no overrides runs exactly ``RunConfig()``: the dataclasses are the
    one place that states a default."""
    assert _compose() == RunConfig()


def _group_options() -> list[tuple[str, str]]:
    conf = Path(CONF_DIR)
    return sorted(
        (group.name, option.stem)
        for group in conf.iterdir()
        if group.is_dir() and group.name != "hydra"
        for option in group.glob("*.yaml")
    )


# what an option needs beyond itself: (world size, overrides)
_OPTION_NEEDS = {("parallel", "tp2_sp_cp4"): (8, ["model=qwen3_5_9b"])}


@pytest.mark.parametrize("group,option", _group_options(), ids=[f"{g}={o}" for g, o in _group_options()])
def test_every_option_composes_and_validates(group, option, data_files):
    world, extra = _OPTION_NEEDS.get((group, option), (1, []))
    if group == "experiment":
        world = 8 if option != "cpu_demo" else 1
        extra = [*data_files] if option != "cpu_demo" else []
    elif group == "data" and option != "synthetic":
        extra = [*data_files]
    cfg = _compose(f"{group}={option}", *extra)
    validate(cfg, world)


def test_group_and_key_overrides_compose():
    cfg = _compose("gdn=headwise", "recompute=full", "parallel.cp=2", "gdn.route=prebuild")
    assert (cfg.gdn.cp_mode, cfg.gdn.route, cfg.recompute.granularity) == ("headwise", "prebuild", "full")
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose("parallel.pp=2")  # unknown keys are Hydra's job


@pytest.fixture
def data_files(tmp_path):
    data = tmp_path / "train.parquet"
    data.write_bytes(b"PAR1")  # existence is what validation checks; reading happens in the loop
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    return f"data.path={data}", f"data.tokenizer={tokenizer}"


@pytest.mark.parametrize("scenario", ["s1", "s2", "s3", "s4"])
def test_seed_scenarios_compose_and_validate_on_eight_gpus(scenario, data_files):
    cfg = _compose(f"experiment={scenario}", *data_files)
    assert cfg.model.preset == "qwen3_5_9b"
    assert (cfg.parallel.tp, cfg.parallel.sp, cfg.parallel.cp) == (2, True, 4)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.min_lr, cfg.optim.schedule) == (
        "adam",
        1e-5,
        1e-6,
        "cosine",
    )
    assert (cfg.optim.weight_decay, cfg.optim.beta1, cfg.optim.beta2, cfg.optim.clip_grad) == (
        0.1,
        0.9,
        0.98,
        1.0,
    )
    assert (cfg.train.global_batch_size, cfg.train.seed, cfg.train.precision) == (64, 1234, "bf16")
    expect = {
        "s1": ("full", 8192, False),
        "s2": ("none", 8192, False),
        "s3": ("full", 24576, False),
        "s4": ("full", 8192, True),
    }[scenario]
    assert (
        cfg.recompute.granularity,
        cfg.train.max_tokens_per_gpu,
        cfg.parallel.dynamic_cp.enabled,
    ) == expect
    assert scenario.upper() in cfg.logging.wandb.tags
    for mode in ("chunkwise", "headwise"):
        dims = validate(dataclasses.replace(cfg, gdn=dataclasses.replace(cfg.gdn, cp_mode=mode)), 8)
        assert (dims.dp, dims.tp, dims.cp) == (1, 2, 4)
    all_gather = dataclasses.replace(cfg, gdn=dataclasses.replace(cfg.gdn, cp_mode="all_gather"))
    if scenario == "s2":  # the seed: all_gather cannot run without full recompute
        assert "recompute.granularity=full" in _problems(all_gather, 8)
    else:
        validate(all_gather, 8)
    assert "world size 6" in _problems(cfg, 6)


def test_scenarios_need_their_data_path():
    with pytest.raises(ConfigError, match="data.path is required"):
        validate(_compose("experiment=s1"), 8)


def test_resolved_config_round_trips(tmp_path):
    from relax_gdn.config.hydra_io import load_run_config, save_run_config

    cfg = _compose("parallel.cp=2", "gdn=all_gather", "recompute=full")
    loaded = load_run_config(save_run_config(cfg, tmp_path))
    assert loaded == cfg.resolved() and loaded.learning_rates == cfg.learning_rates
    assert loaded.resolved() == loaded  # resolving twice changes nothing


# ------------------------------------------------------------------------------------- FLOPs


def test_flops_match_qwen3_5_md():
    from relax_gdn.model import qwen3_5_config
    from relax_gdn.train.flops import (
        ModelShape,
        flops_per_token,
        megatron_flops_breakdown,
        relax_flops,
        step_flops,
    )

    shape = ModelShape.from_transformer_config(qwen3_5_config("qwen3_5_9b"), 248_320)
    assert (shape.num_attention_layers, shape.num_gdn_layers) == (8, 24)
    for s_eff, expect in ((8192, 49.53e9), (24576, 52.75e9)):
        assert flops_per_token(shape, s_eff) == pytest.approx(expect, rel=5e-3)
        assert relax_flops(shape, 1, s_eff) - flops_per_token(shape, s_eff) == pytest.approx(6.1e9, rel=0.01)
    parts = megatron_flops_breakdown(shape, 1, 8192)
    for name, expect in dict(
        mlp=28.99,
        gdn_projections=9.70,
        logits=6.10,
        attention_projections=2.82,
        attention_core=1.61,
        gdn_core=0.30,
    ).items():
        assert getattr(parts, name) / 1e9 == pytest.approx(expect, abs=0.01), name
    # s_eff = sum L^2 / sum L: two documents of 8192 and one of 16384
    megatron, relax = step_flops(shape, [8192, 8192, 16384])
    s_eff = (2 * 8192**2 + 16384**2) / 32768
    assert megatron == pytest.approx(32768 * flops_per_token(shape, s_eff), rel=1e-12)
    assert relax > megatron


def test_metrics_use_real_tokens_and_megatron_accounting():
    import torch

    from relax_gdn.model import qwen3_5_config
    from relax_gdn.train.flops import H200_PEAK_BF16_TFLOPS, ModelShape, step_flops
    from relax_gdn.train.metrics import REQUIRED_RECORD_FIELDS, MetricsProcessor

    shape = ModelShape.from_transformer_config(qwen3_5_config("qwen3_5_9b"), 248_320)
    metrics = MetricsProcessor(shape, world_size=8, device=torch.device("cpu"))
    assert metrics.peak_tflops is None
    metrics.peak_tflops = H200_PEAK_BF16_TFLOPS  # as on an H200
    lengths = [8192] * 4 + [4096] * 8
    record = metrics.record(
        step=3,
        loss=0.35,
        grad_norm=1.0,
        lr=1e-5,
        seq_lengths=lengths,
        loss_tokens=40000,
        padded_tokens=70000,
        num_micro_batches=2,
        epoch=0,
        step_time_s=2.0,
    ).as_dict()
    assert set(REQUIRED_RECORD_FIELDS) <= set(record)
    assert record["tokens"] == sum(lengths) and record["tokens_per_s"] == sum(lengths) / 2.0
    megatron, relax = step_flops(shape, lengths)
    assert record["tflops_per_gpu"] == pytest.approx(megatron / 2.0 / 8 / 1e12)
    assert record["mfu"] == pytest.approx(record["tflops_per_gpu"] / 989.0)
    assert record["mfu_relax"] == pytest.approx(relax / 2.0 / 8 / 1e12 / 989.0)
    assert record["peak_mem_gb"] is None and record["host_syncs"] is None


def test_warmup_is_a_fraction_or_steps_and_clamped_below_the_run(caplog):
    from relax_gdn.train.optimizer import resolve_warmup_steps

    assert resolve_warmup_steps(RunConfig().optim.warmup_steps, RunConfig().train.steps) == 3  # the demo's
    assert [resolve_warmup_steps(0.1, n) for n in (1, 3, 10, 35)] == [0, 0, 1, 4]
    assert (
        resolve_warmup_steps(0, 5) == 0
        and resolve_warmup_steps(4, 5) == 4
        and resolve_warmup_steps(4.0, 5) == 4
    )
    assert not caplog.records
    validate(_cfg(optim__warmup_steps=30), 1)  # a warm-up as long as the run is clamped, not refused
    assert resolve_warmup_steps(30, 30) == 29 and resolve_warmup_steps(3, 1) == 0
    assert [r.getMessage() for r in caplog.records][0].startswith(
        "optim.warmup_steps=30 is not below train.steps=30"
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), (3e-3, 3e-4)),  # the tiny demo keeps its fast rate
        (("model=qwen3_5_9b",), (1e-5, 1e-6)),  # a fine-tuning rate for the 9B
        (("model.preset=qwen3_5_9b",), (1e-5, 1e-6)),  # the key, not only the group, decides
        (("model=qwen3_5_9b_reduced",), (2e-4, 2e-5)),  # randomly initialised: a from-scratch rate
        (("model=qwen3_5_9b", "optim.lr=3e-5"), (3e-5, 3e-6)),  # a given rate wins; the floor follows it
        (("model=qwen3_5_9b", "optim.min_lr=0"), (1e-5, 0.0)),
    ],
)
def test_learning_rate_defaults_follow_the_model_preset(overrides, expected):
    cfg = _compose(*overrides)
    assert cfg.learning_rates == pytest.approx(expected)
    resolved = cfg.resolved()  # what config.yaml records
    assert (resolved.optim.lr, resolved.optim.min_lr) == pytest.approx(expected)


def test_an_unusable_learning_rate_names_the_value():
    with pytest.raises(ConfigError, match=r"optim.min_lr=0.5 must be within \[0, optim.lr=1e-05\]"):
        validate(_compose("model=qwen3_5_9b", "optim.min_lr=0.5"), 1)


def test_a_sweep_is_composed_once_per_swept_value():
    from relax_gdn.config.hydra_io import sweep_jobs_to_compose

    jobs = sweep_jobs_to_compose(
        ["train.seed=1,2,3", "gdn=chunkwise,headwise", "+x=1", "train.steps=range(4,6)"]
    )
    assert jobs == [
        ["train.seed=1", "gdn=chunkwise", "+x=1", "train.steps=4"],
        ["train.seed=2", "gdn=headwise", "+x=1", "train.steps=5"],
        ["train.seed=3", "gdn=chunkwise", "+x=1", "train.steps=4"],
    ]
    assert sweep_jobs_to_compose([]) == [[]]
    assert sweep_jobs_to_compose(["model=glob(t*)"]) is None  # Hydra's sweeper lists a glob's options
    with pytest.raises(ConfigError, match="no viable alternative"):
        sweep_jobs_to_compose(["train.steps=[1"])


def test_dynamic_cp_without_max_cp_runs_up_to_the_cp_group():
    cfg = _cfg(parallel__cp=4, parallel__dynamic_cp=dict(enabled=True))
    assert cfg.parallel.dynamic_cp.max_cp is None
    validate(cfg, 4)
    assert cfg.effective_max_cp == 4


@pytest.mark.parametrize(
    "typed,meant",
    [
        ("train.stepz", "train.steps"),  # a typo
        ("model.lora_rank", "model.lora.rank"),
        ("train.max_steps", "train.steps"),  # another trainer's name (HF Trainer, Megatron-LM)
        ("optim.learning_rate", "optim.lr"),
        ("train.eval_every", "eval.every_steps"),
        ("data.eval_fraction", "eval.holdout_fraction"),
        ("parallel.context_parallel_size", "parallel.cp"),
    ],
)
def test_an_unknown_key_names_the_key_it_is_closest_to(typed, meant):
    from relax_gdn.config.schema import unknown_key_problem

    assert unknown_key_problem(typed).endswith(f"(relax_gdn/config/schema.py). Did you mean {meant}?")


def test_no_guess_for_a_key_like_none_and_every_other_name_is_a_key():
    from relax_gdn.config.schema import KNOWN_AS, config_keys, unknown_key_problem

    assert "Did you mean" not in unknown_key_problem("train.banana")
    assert "Did you mean" not in unknown_key_problem("foo.bar")
    assert set(KNOWN_AS.values()) <= set(config_keys())
