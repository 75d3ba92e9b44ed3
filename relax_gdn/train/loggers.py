"""Where step records go: console (rank 0, a progress bar: relax_gdn.train.console), a JSONL file per
run, W&B.

Only global rank 0 logs. A W&B failure (import, init, log, finish) never stops training: it is
logged once (a warning line, on the console and in train.log) and W&B is switched off for the rest
of the run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from relax_gdn.train.console import ConsoleProgress

logger = logging.getLogger("relax_gdn.train")


def run_tags(cfg) -> list[str]:
    """Tags that say what a run compares: mode, route, CP, TP, model, recompute (+ the user's)."""
    p = cfg.parallel
    tags = [
        f"mode:{cfg.gdn.cp_mode}",
        f"route:{cfg.gdn.route}",
        f"cp:{p.cp}",
        f"tp:{p.tp}",
        f"model:{cfg.model.preset}",
        f"recompute:{cfg.recompute.granularity}",
        f"max_tokens_per_gpu:{cfg.train.max_tokens_per_gpu}",
    ]
    if p.sp:
        tags.append("sp")
    if p.dynamic_cp.enabled:
        tags.append(f"dynamic_cp:{cfg.effective_max_cp}")
    return tags + [t for t in cfg.logging.wandb.tags if t not in tags]


def default_run_name(cfg) -> str:
    """``<model>-<mode>-<route>-tp<tp>-cp<cp>[-dcp<max>]-rc<recompute>`` unless ``run_name`` is set."""
    if cfg.run_name:
        return cfg.run_name
    p = cfg.parallel
    name = f"{cfg.model.preset}-{cfg.gdn.cp_mode}-{cfg.gdn.route}-tp{p.tp}{'sp' if p.sp else ''}-cp{p.cp}"
    if p.dynamic_cp.enabled:
        name += f"-dcp{cfg.effective_max_cp}"
    return name + f"-rc{cfg.recompute.granularity}-mt{cfg.train.max_tokens_per_gpu}"


def json_value(value: Any) -> Any:
    """A record value as ``metrics.jsonl`` holds it: a float that is not finite as the string
    ``"nan"``, ``"inf"`` or ``"-inf"`` (JSON has no such numbers; a null would read as "not
    measured"), everything else as it is."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def where_and_when() -> dict[str, Any]:
    """When a step ended and on what machine, how busy (the fields of :data:`MACHINE_FIELDS`): what
    ``relax_gdn.compare`` needs to tell runs that shared a machine, at once or one after another
    on a loaded one, whose tok/s then measure the machine as much as the code."""
    return {
        "time": time.time(),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 2),
    }


MACHINE_FIELDS = ("time", "host", "cpus", "load_1m")


class JsonlLogger:
    """``metrics.jsonl`` in the run directory: one JSON object per step, flushed each line. A step
    whose loss or grad norm is not finite carries ``"nonfinite": true`` and those values as strings
    (:func:`json_value`). Each line also says when the step ended and where (:func:`where_and_when`)."""

    def __init__(self, path: Path, append: bool = False):
        self.path = Path(path)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: json_value(v) for k, v in {**record, **where_and_when()}.items()}
        self._file.write(json.dumps(clean, sort_keys=False, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class WandbLogger:
    """W&B in ``online``/``offline`` mode; every call is guarded: a failure warns ONCE and turns W&B
    off, training goes on. An offline run prints one line at the end, where the run is and how to
    upload it, instead of W&B's own start lines and history / summary tables
    (``logging.show_third_party_warnings=true`` shows those)."""

    def __init__(self, cfg, run_dir: Path, config_dict: dict[str, Any], run_id: str | None = None):
        self.run = None
        self._failed = False
        self._records: list[dict[str, Any]] = []  # for the end-of-run summary
        w = cfg.logging.wandb
        self._one_line = w.mode == "offline" and not cfg.logging.show_third_party_warnings
        try:
            import wandb

            self.run = wandb.init(
                settings=wandb.Settings(silent=True) if self._one_line else None,
                project=w.project,
                entity=w.entity,
                group=w.group or f"{cfg.model.preset}",
                name=w.name or default_run_name(cfg),
                job_type=w.job_type,
                tags=run_tags(cfg),
                config=config_dict,
                mode=w.mode,
                dir=os.environ.get("WANDB_DIR") or str(run_dir),
                reinit="finish_previous",
                # a resumed run continues the W&B run its checkpoint names
                id=run_id,
                resume="allow" if run_id else None,
            )
        except Exception as e:  # noqa: BLE001 - any W&B problem must not stop training
            self._fail("init", e)

    def _fail(self, what: str, error: Exception) -> None:
        if not self._failed:  # one line, on the console and in train.log
            logger.warning(
                "W&B %s failed (%s: %s); continuing without W&B", what, type(error).__name__, error
            )
        self._failed = True
        self.run = None

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else getattr(self.run, "id", None)

    @property
    def run_dir(self) -> str | None:
        return None if self.run is None else getattr(self.run, "dir", None)

    def log(self, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        self._records.append(record)
        try:
            # evaluation fields keep their own namespace (``eval/loss``); the rest is ``train/<field>``
            self.run.log(
                {
                    (k if k.startswith("eval/") else f"train/{k}"): v
                    for k, v in record.items()
                    if k != "step" and v is not None
                },
                step=record["step"],
            )
        except Exception as e:  # noqa: BLE001
            self._fail("log", e)

    def close(self) -> None:
        """Write the run's summary (steady-state medians, peak memory, total tokens, CP-size
        histogram: the comparison's statistics, :func:`relax_gdn.run_stats.run_summary`) and finish."""
        if self.run is None:
            return
        try:
            from relax_gdn.run_stats import run_summary

            self.run.summary.update(run_summary(self._records))
            sync_dir = getattr(self.run.settings, "sync_dir", None)
            self.run.finish()
        except Exception as e:  # noqa: BLE001
            self._fail("finish", e)
            return
        if self._one_line and sync_dir:
            logger.info("W&B offline run %s; upload it with: wandb sync %s", sync_dir, sync_dir)


class RunLoggers:
    """All sinks of rank 0 (non-zero ranks get an empty one)."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    @classmethod
    def create(
        cls,
        cfg,
        run_dir: Path | None,
        *,
        is_rank0: bool,
        config_dict: dict[str, Any],
        append: bool = False,
        start_step: int = 0,
        wandb_run_id: str | None = None,
    ) -> RunLoggers:
        if not is_rank0:
            return cls([])
        sinks: list = []
        if cfg.logging.console:
            sinks.append(ConsoleProgress(cfg.train.steps, cfg.logging.log_every, start_step=start_step))
        if cfg.logging.jsonl and run_dir is not None:
            sinks.append(JsonlLogger(Path(run_dir) / "metrics.jsonl", append=append))
        if cfg.logging.wandb.mode != "disabled":
            sinks.append(
                WandbLogger(cfg, Path(run_dir) if run_dir else Path.cwd(), config_dict, wandb_run_id)
            )
        return cls(sinks)

    def log(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def wandb(self) -> WandbLogger | None:
        return next((s for s in self.sinks if isinstance(s, WandbLogger)), None)

    def wandb_run_id(self) -> str | None:
        wandb = self.wandb()
        return wandb.run_id if wandb is not None else None

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def start_run_loggers(
    cfg,
    run_dir: Path | None,
    *,
    dims,
    device,
    bf16: bool,
    vocab_size: int,
    dataset,
    is_rank0: bool,
    start_step: int,
    append: bool,
    wandb_run_id: str | None,
) -> RunLoggers:
    """A run's loggers (console, JSONL, W&B; rank 0), after rank 0 wrote ``config.yaml`` into
    ``run_dir``; what the run decided beyond its config (``dims``, ``device``, ``bf16``, the
    vocabulary, the data's size and skips) is logged with it as ``derived``. ``append``: a resumed
    run continues its metrics and W&B run (``wandb_run_id``)."""
    from relax_gdn.config.hydra_io import save_run_config

    derived = {
        "world_size": dims.world_size,
        "dp": dims.dp,
        "device": str(device),
        "bf16": bf16,
        "vocab_size": vocab_size,
        "run_name": default_run_name(cfg),
        "tags": run_tags(cfg),
        "num_samples": len(dataset),
        "data_skips": dataset.counts.as_dict(),
    }
    if is_rank0 and run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_run_config(cfg, run_dir)
    config_dict = {**cfg.to_dict(), "derived": derived}
    return RunLoggers.create(
        cfg,
        run_dir,
        is_rank0=is_rank0,
        config_dict=config_dict,
        start_step=start_step,
        append=append,
        wandb_run_id=wandb_run_id,
    )
