"""``model.lora`` options without ``model.lora.rank``: refused (they would do nothing, the whole
model would train), one message naming each key set and the fix, exit 2, nothing written; the same
options with a rank, and a rank alone, pass."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax_gdn.config import ConfigError, RunConfig, validate
from tests.distributed import child_env
from tests.helpers import ROOT

FIX = "set model.lora.rank (e.g. 16) to train adapters, or leave model.lora.* out to train the whole model"


@pytest.mark.parametrize(
    "overrides,named",
    [
        ({"model.lora.targets": ["attention"]}, "model.lora.targets"),
        ({"model.lora.alpha": 32.0, "model.lora.dropout": 0.1}, "model.lora.alpha, model.lora.dropout"),
    ],
)
def test_lora_options_without_a_rank_are_refused(overrides, named):
    with pytest.raises(ConfigError) as refused:
        validate(RunConfig().with_overrides(overrides), 1)
    assert refused.value.problems == [
        f"{named} set but model.lora.rank is 0 (no LoRA: the whole model would train "
        f"and {named} would do nothing): {FIX}"
    ]
    validate(RunConfig().with_overrides({**overrides, "model.lora.rank": 4}), 1)  # with a rank: LoRA
    validate(RunConfig().with_overrides({"model.lora.rank": 4}), 1)


def test_train_py_refuses_lora_targets_without_a_rank_before_writing_anything(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            f"hydra.run.dir={tmp_path / 'run'}",
            "model.lora.targets=[attention,mlp]",
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr == (
        f"error: configuration problem: model.lora.targets set but model.lora.rank is 0 (no LoRA: "
        f"the whole model would train and model.lora.targets would do nothing): {FIX}\n"
    )
    assert list(tmp_path.iterdir()) == []
