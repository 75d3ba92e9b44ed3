"""A run's data: the tokenizer, training set and eval set ``cfg.data`` / ``cfg.eval`` name, loaded
and checked before the model is built (a source that cannot be used, or a sample no micro-batch
holds, is one :class:`~relax_gdn.errors.DataError` naming the key to fix)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_gdn.config import RunConfig
from relax_gdn.config.validate import missing_data_path
from relax_gdn.data import SFTDataset, load_sft_dataset, load_tokenizer, padded_length, synthetic_math_dataset
from relax_gdn.errors import DataError
from relax_gdn.train.evaluate import EvalSet, split_eval_set

logger = logging.getLogger("relax_gdn.train")


@dataclass(frozen=True)
class RunData:
    """A run's data, loaded and checked before the model exists."""

    tokenizer: Any  # relax_gdn.data.SFTTokenizer
    dataset: SFTDataset  # the training set
    eval_set: EvalSet | None  # None: no evaluation


def load_data(cfg: RunConfig, log: bool = True) -> RunData:
    """The tokenizer, training set and eval set that ``cfg`` names: errors name the data.* / eval.*
    key to fix. ``log``: this rank logs what loading skipped."""
    d = cfg.data
    tokenizer = load_tokenizer(None if d.tokenizer in ("embedded", "byte") else d.tokenizer)
    if d.source == "synthetic":
        dataset = synthetic_math_dataset(
            d.num_samples,
            tokenizer,
            seed=cfg.train.seed,
            max_sample_tokens=cfg.sample_token_limit,
            max_steps=d.synthetic_max_steps,
            min_steps=1,
        )
    else:
        if not d.path or not Path(d.path).exists():
            raise DataError(missing_data_path(d.path, d.source))
        dataset = load_sft_dataset(
            d.path,
            tokenizer,
            prompt_field=d.prompt_field,
            response_field=d.response_field,
            max_sample_tokens=cfg.sample_token_limit,
            max_samples=d.num_samples,
            format=d.source,
            split=d.split,
            record_format=d.format,
        )
        if dataset.counts.examples and log:
            logger.warning(
                "data.path=%s: %s\n  %s",
                d.path,
                dataset.counts.summary(),
                "\n  ".join(dataset.counts.report_lines()),
            )
    dataset, eval_set = split_eval_set(cfg, tokenizer, dataset)
    if len(dataset) < cfg.train.global_batch_size:
        raise DataError(
            f"the data has {len(dataset)} usable samples ({dataset.counts.summary()}), fewer than "
            f"train.global_batch_size={cfg.train.global_batch_size}: use more data or a smaller batch"
        )
    check_samples_fit(dataset.samples, cfg)
    if eval_set is not None:
        check_samples_fit(eval_set.samples, cfg)
    return RunData(tokenizer, dataset, eval_set)


def load_run_data(cfg: RunConfig, data=None, log: bool = True) -> RunData:
    """What ``cfg.data`` names (:func:`load_data`), or the prepared ``(tokenizer, SFTDataset)`` pair
    ``data`` after checking that its samples fit."""
    if data is None:
        return load_data(cfg, log=log)
    run_data = RunData(*data, eval_set=None)
    check_samples_fit(run_data.dataset.samples, cfg)
    return run_data


def check_samples_fit(samples, cfg: RunConfig) -> None:
    """Every sample must fit one micro-batch at the largest CP size, checked before step 1 (not
    as an error or an OOM at whatever step first draws it). Skipping them instead is the data
    side's job: ``data.max_sample_tokens`` drops and counts them at load time."""
    cp = cfg.parallel.cp  # with dynamic CP, max_cp == cp
    capacity = cfg.train.max_tokens_per_gpu * cp
    too_long = [s for s in samples if padded_length(len(s), cp) > capacity]
    if too_long:
        worst = max(too_long, key=len)
        raise DataError(
            f"{len(too_long)} samples do not fit one micro-batch of train.max_tokens_per_gpu x parallel.cp = "
            f"{cfg.train.max_tokens_per_gpu} x {cp} = {capacity} tokens (e.g. sample {worst.sample_id}: {len(worst)} "
            f"tokens): set data.max_sample_tokens={capacity} to skip them (counted in the run log), or raise "
            "train.max_tokens_per_gpu / parallel.cp"
        )
