"""Evaluation loss: the eval set (a file, or a held-out fraction never trained on), the keys'
validation, and the loss itself: equal to a forward written out here (per sample, unpacked, plain
cross-entropy from the logits) over the final weights, and logged as ``eval/loss`` in
metrics.jsonl and W&B (offline). CP 2 = CP 1 is in test_messages_data.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_gdn.config import ConfigError, validate
from relax_gdn.data import ByteChatTokenizer, synthetic_math_dataset
from relax_gdn.train.evaluate import EVAL_LOSS, holdout_indices, split_eval_set
from tests.distributed import job_runtime
from tests.helpers import MESSAGES_EXAMPLE as EXAMPLE
from tests.helpers import config_with as _cfg
from tests.helpers import messages_config as messages_cfg

pytestmark = pytest.mark.filterwarnings("ignore:The following imports from:DeprecationWarning")


def test_held_out_samples_are_removed_from_training_and_fixed_by_the_seed():
    data = synthetic_math_dataset(40, ByteChatTokenizer(), seed=0, max_steps=1)
    cfg = _cfg(eval__every_steps=5, eval__holdout_fraction=0.25, eval__num_samples=6)
    train, held = split_eval_set(cfg, ByteChatTokenizer(), data)
    train_ids, eval_ids = {s.sample_id for s in train.samples}, [s.sample_id for s in held.samples]
    assert len(train.samples) == 30 and len(eval_ids) == 6 and not train_ids & set(eval_ids)
    assert train_ids | set(holdout_indices(40, 0.25, 1234)) == set(range(40))
    again, held_again = split_eval_set(cfg, ByteChatTokenizer(), data)
    assert [s.sample_id for s in held_again.samples] == eval_ids
    assert holdout_indices(40, 0.25, 1234) != holdout_indices(40, 0.25, 1235)
    off, none = split_eval_set(_cfg(eval__holdout_fraction=0.25), ByteChatTokenizer(), data)  # every_steps=0
    assert none is None and len(off.samples) == 40


def test_eval_keys_are_validated(tmp_path):
    def problems(**dotted) -> str:
        with pytest.raises(ConfigError) as info:
            validate(_cfg(**dotted), 1)
        return str(info.value)

    assert "needs evaluation samples: set data.eval_path" in problems(eval__every_steps=2)
    assert "eval.holdout_fraction=1.5 must be a number in [0, 1)" in problems(eval__holdout_fraction=1.5)
    assert "eval.every_steps=-1" in problems(eval__every_steps=-1)
    assert "data.eval_path='nowhere.jsonl' does not exist" in problems(data__eval_path="nowhere.jsonl")
    assert "both set" in problems(data__eval_path=str(EXAMPLE), eval__holdout_fraction=0.1)
    validate(_cfg(eval__every_steps=2, eval__holdout_fraction=0.1), 1)


# ---------------------------------------------------------------------------------------------


def _hand_eval_loss(cfg, checkpoint: Path, eval_path: Path) -> tuple[float, int]:
    """Loss per loss token of every record in ``eval_path`` under the checkpoint's weights, one
    sample at a time: logits from the model, log-softmax and the mask applied here."""
    import torch

    from relax_gdn.data import make_micro_batch
    from relax_gdn.data.tokenizer import load_tokenizer
    from relax_gdn.parallel import ParallelContext
    from relax_gdn.train.build import build
    from relax_gdn.train.checkpoint_state import load_model_weights

    tokenizer = load_tokenizer(None)
    parallel = ParallelContext.initialize(tp=1, cp=1, dynamic_max_cp=None)
    try:
        model = build(
            cfg,
            parallel,
            tokenizer_vocab_size=tokenizer.vocab_size,
            device=torch.device("cpu"),
            bf16=False,
            runtime=None,
        ).model
        load_model_weights(checkpoint, model)
        model.eval()
        total, tokens = 0.0, 0
        for line in eval_path.read_text().splitlines():
            ids, mask = tokenizer.encode_messages(json.loads(line)["messages"])
            mb = make_micro_batch(
                [_sample(ids, mask)], cp_size=1, cp_rank=0, device="cpu", pad_id=tokenizer.pad_id
            )
            with torch.no_grad():
                logits = model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
            n = len(ids)
            logp = torch.log_softmax(logits[0, : n - 1].double(), dim=-1)
            nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
            weights = torch.tensor(mask[: n - 1], dtype=torch.float64)
            total += float((nll * weights).sum())
            tokens += int(weights.sum())
        return total / tokens, tokens
    finally:
        ParallelContext.destroy()


def _sample(ids, mask):
    from relax_gdn.data import Sample

    return Sample(input_ids=ids, loss_mask=mask, sample_id=0)


def _single_process_eval(tmp: str) -> dict:
    import os

    import torch

    from relax_gdn.train import run_training

    torch.set_num_threads(1)
    tmp = Path(tmp)
    eval_path = tmp / "eval.jsonl"
    eval_path.write_text("".join(line + "\n" for line in EXAMPLE.read_text().splitlines()[:5]))
    os.environ["WANDB_DIR"] = str(tmp / "wandb")  # W&B offline: no network
    os.environ["WANDB_SILENT"] = "true"
    (tmp / "wandb").mkdir()
    cfg = messages_cfg(
        data__eval_path=str(eval_path),
        eval__every_steps=2,
        eval__num_samples=None,
        train__steps=3,
        checkpoint__dir=str(tmp / "ckpt"),
        checkpoint__save_final=True,
        logging__jsonl=True,
        logging__wandb=dict(
            mode="offline", project="relax-gdn-test", entity=None, group=None, tags=[], name=None
        ),
    )
    result = run_training(cfg, tmp / "run", runtime=job_runtime())
    without_eval = run_training(
        cfg.with_overrides(
            {"eval.every_steps": 0, "checkpoint.save_final": False, "logging.wandb.mode": "disabled"}
        ),
        None,
        runtime=job_runtime(),
    )
    hand = _hand_eval_loss(cfg, Path(result.checkpoints[-1]), eval_path)
    jsonl = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    from tests.wandb_records import offline_run_records

    (wandb_run,) = (tmp / "wandb").rglob("offline-run-*")
    return {
        "records": result.records,
        "without_eval": without_eval.records,
        "hand": hand,
        "jsonl": jsonl,
        "wandb": offline_run_records(wandb_run)["history"],
    }


@pytest.fixture(scope="module")
def single(gloo, tmp_path_factory):
    return gloo(_single_process_eval, 1, str(tmp_path_factory.mktemp("eval")))[0]


def test_eval_loss_equals_a_hand_computed_forward_over_the_eval_samples(single):
    records = single["records"]
    assert [EVAL_LOSS in r for r in records] == [False, True, True]  # every 2 steps and after the last
    hand_loss, hand_tokens = single["hand"]
    assert records[-1]["eval/loss_tokens"] == hand_tokens
    assert records[-1][EVAL_LOSS] == pytest.approx(hand_loss, rel=1e-5)
    assert records[1][EVAL_LOSS] != records[2][EVAL_LOSS]  # the weights moved in between
    assert [r.get(EVAL_LOSS) for r in single["jsonl"]] == [r.get(EVAL_LOSS) for r in records]
    wandb = [json.loads(row[EVAL_LOSS]) if EVAL_LOSS in row else None for row in single["wandb"]]
    assert wandb == [r.get(EVAL_LOSS) for r in records]  # logged as eval/loss, not train/eval/loss
    assert all("train/eval/loss" not in row for row in single["wandb"])


def test_evaluating_leaves_training_unchanged(single):
    with_eval, without = single["records"], single["without_eval"]
    assert [r["loss"] for r in with_eval] == [r["loss"] for r in without]
    assert [r["grad_norm"] for r in with_eval] == [r["grad_norm"] for r in without]
