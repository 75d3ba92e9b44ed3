"""Evaluation loss: which samples (``data.eval_path`` or a held-out fraction of the training set)
and the loss per real loss token over them, under the training run's own CP layout and
micro-batching.

* :func:`split_eval_set` decides the eval set once, at load time. With ``data.eval_path`` it reads
  that source (same record formats and limits as the training data); otherwise it holds out
  ``eval.holdout_fraction`` of the training samples, chosen by a permutation seeded with
  ``train.seed`` and REMOVED from the training set, so the two never overlap and every rank (and a
  resumed run) makes the same split. The first ``eval.num_samples`` of it are evaluated.
* :class:`Evaluator` runs every ``eval.every_steps`` steps and after the last step: ``model.eval()``,
  no gradients, the eval samples packed exactly as a training global batch is (this rank's
  micro-batches from the loop's own planner, dynamic CP included), the summed per-token loss
  all-reduced over every rank (TP ranks hold the same value, hence / tp) and divided by the eval
  set's loss tokens; then ``model.train()`` again. The result goes on that step's metrics record
  as ``eval/loss`` (and ``eval/loss_tokens``): console, ``metrics.jsonl`` and W&B all see it there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from relax_gdn.data import Sample, SFTDataset, load_sft_dataset
from relax_gdn.errors import DataError
from relax_gdn.train.loss import summed_token_loss

EVAL_LOSS = "eval/loss"
EVAL_LOSS_TOKENS = "eval/loss_tokens"
_HOLDOUT_STREAM = 0x4556  # separates the held-out permutation from the batch shuffles of the same seed


@dataclass
class EvalSet:
    samples: list[Sample]
    source: str  # where they came from, for the run log

    @property
    def num_loss_tokens(self) -> int:
        return sum(s.num_loss_tokens for s in self.samples)


def holdout_indices(num_samples: int, fraction: float, seed: int) -> list[int]:
    """Indices (sorted) of the held-out samples: ``round(fraction * n)`` of them, at least one."""
    count = max(1, round(fraction * num_samples))
    rng = np.random.default_rng([abs(int(seed)), int(int(seed) < 0), _HOLDOUT_STREAM])
    order = rng.permutation(num_samples)
    return sorted(int(i) for i in order[:count])


def split_eval_set(cfg, tokenizer, dataset: SFTDataset) -> tuple[SFTDataset, EvalSet | None]:
    """(training set, eval set or None when ``eval.every_steps`` is 0); see the module docstring."""
    ev, d = cfg.eval, cfg.data
    if not ev.every_steps:
        return dataset, None
    if d.eval_path:
        loaded = load_sft_dataset(
            d.eval_path,
            tokenizer,
            prompt_field=d.prompt_field,
            response_field=d.response_field,
            max_sample_tokens=cfg.sample_token_limit,
            max_samples=ev.num_samples,
            split=d.split,
            record_format=d.format,
        )
        return dataset, EvalSet(loaded.samples, f"data.eval_path={d.eval_path}")
    held = holdout_indices(len(dataset), ev.holdout_fraction, cfg.train.seed)
    if len(held) >= len(dataset):
        raise DataError(
            f"eval.holdout_fraction={ev.holdout_fraction} of {len(dataset)} samples leaves none "
            "to train on: lower it or use data.eval_path"
        )
    held_set = set(held)
    train = [s for i, s in enumerate(dataset.samples) if i not in held_set]
    eval_samples = [dataset.samples[i] for i in held][: ev.num_samples]
    return (
        SFTDataset(samples=train, source=dataset.source, counts=dataset.counts),
        EvalSet(eval_samples, f"{len(held)} held-out training samples (eval.holdout_fraction)"),
    )


class Evaluator:
    """Eval loss on a fixed set; ``micro_batches(samples)`` yields this rank's built micro-batches
    of those samples exactly as the training loop packs a global batch."""

    def __init__(
        self,
        eval_set: EvalSet | None,
        every_steps: int,
        total_steps: int,
        micro_batches: Callable[[list[Sample]], Iterable],
        tp: int,
        device: torch.device,
    ):
        self.eval_set = eval_set
        self.every = every_steps if eval_set is not None else 0
        self.total = total_steps
        self.micro_batches = micro_batches
        self.tp = tp
        self.device = device

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.total)

    def run(self, model) -> dict[str, float | int]:
        """``{"eval/loss", "eval/loss_tokens"}`` for the current weights; a collective (every rank)."""
        loss = evaluate_loss(model, self.eval_set.samples, self.micro_batches, tp=self.tp, device=self.device)
        return {EVAL_LOSS: loss, EVAL_LOSS_TOKENS: self.eval_set.num_loss_tokens}


def evaluate_loss(
    model,
    samples: list[Sample],
    micro_batches: Callable[[list[Sample]], Iterable],
    *,
    tp: int,
    device: torch.device,
) -> float:
    """Mean loss per loss token of ``samples`` (no gradients, eval mode; train mode restored)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float32, device=device)
    try:
        with torch.no_grad():
            for mb in micro_batches(samples):
                total += summed_token_loss(model, mb)
    finally:
        model.train(was_training)
    dist.all_reduce(total)  # every rank's shard of every micro-batch, each loss token once
    return total.item() / tp / max(sum(s.num_loss_tokens for s in samples), 1)
