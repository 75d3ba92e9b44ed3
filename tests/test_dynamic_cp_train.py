"""Dynamic CP end to end on gloo with 4 processes (max_cp 4): one step mixes CP sizes 1, 2 and 4,
and its loss and gradient norm equal static CP 4 on the same samples, in every GDN mode; the S4
preset trains the tiny model (TP 1 here: 4 CPU processes)."""

from __future__ import annotations

import pytest

from tests.distributed import JobResults, job_runtime
from tests.helpers import EQ_TOL
from tests.helpers import GDN_MODES as MODES
from tests.helpers import small_config as _cfg
from tests.helpers import step_fields as _step


def _mixed(mode: str, dynamic: bool):
    # samples of ~150-1800 tokens at 512 tokens per rank: this step needs CP 1, 2 and 4 (12 samples
    # of seed 10 do, about 6.8k tokens; 24 of the default seed too, with 15.5k)
    return _cfg(
        train__steps=1,
        train__seed=10,
        train__global_batch_size=12,
        train__max_tokens_per_gpu=512,
        data__max_sample_tokens=2048,
        data__synthetic_max_steps=20,
        parallel__cp=4,
        gdn__cp_mode=mode,
        recompute__granularity="full" if mode == "all_gather" else "none",
        logging__jsonl=False,
        parallel__dynamic_cp=dict(enabled=dynamic, max_cp=4 if dynamic else 1),
    )


def _static_and_dynamic(mode: str) -> dict:
    """Step 1 at static CP 4 and at dynamic CP <= 4 on the same samples (the pool of 4)."""
    from relax_gdn.train import run_training

    return {
        mode: tuple(
            run_training(_mixed(mode, dynamic), None, runtime=job_runtime()).records
            for dynamic in (False, True)
        )
    }


def _s4_preset() -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from relax_gdn.config import run_config_from_dict
    from relax_gdn.config.hydra_io import register_schema
    from relax_gdn.train import run_training
    from tests.helpers import ROOT

    conf_dir = str(ROOT / "conf")
    register_schema()  # conf/config.yaml composes on top of the dataclass schema
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        raw = compose(
            "config",
            overrides=[
                "experiment=s4",
                "model=tiny",
                "data=synthetic",
                "parallel.tp=1",
                "parallel.sp=false",
                "train.steps=2",
                "train.global_batch_size=8",
                "train.max_tokens_per_gpu=256",
                "train.device=cpu",
                "train.precision=fp32",
                "data.max_sample_tokens=1024",
                "logging.wandb.mode=disabled",
                "logging.jsonl=false",
            ],
        )
    return {
        "s4": run_training(
            run_config_from_dict(OmegaConf.to_container(raw, resolve=True)), None, runtime=job_runtime()
        ).records
    }


@pytest.fixture(scope="module")
def four(gloo_once):
    """Per rank of the pool of 4: the cases by key, each job run when a test first reads it."""
    jobs = {**{mode: (_static_and_dynamic, 4, mode) for mode in MODES}, "s4": (_s4_preset, 4)}
    return [JobResults(gloo_once, jobs, rank) for rank in range(4)]


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_cp_equals_static_cp4(four, mode):
    for rank, out in enumerate(four):
        static, dynamic = out[mode]
        assert set(dynamic[0]["cp_sizes"]) == {"1", "2", "4"}, dynamic[0]["cp_sizes"]
        got, want = _step(dynamic[0]), _step(static[0])
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=EQ_TOL), (mode, rank, key, got, want)


def test_s4_preset_trains_the_tiny_model(four):
    records = four[0]["s4"]
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)
    assert sum(records[0]["cp_sizes"].values()) > 0
