"""What rank 0 prints: a progress bar while training, one summary at the end.

* On a terminal: a ``rich`` progress bar (elapsed, ETA, step, loss, tok/s, MFU) redrawn in place;
  while it is drawn, log lines bound for the terminal print above it, each on its own line.
* Anywhere else (SLURM logs, pipes, files): one plain line every ``logging.log_every`` steps and
  at the last step, never a carriage return or an escape code, so logs stay greppable.
* :func:`print_run_summary`: one table (rich on a terminal, aligned ``key: value`` lines
  otherwise) with steps, tokens, median tok/s and MFU over the steady state, peak memory,
  loss first -> last (and the MTP layer's), the eval loss, and where the outputs are.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from relax_gdn.model.fp8.plan import fp8_plan_of
from relax_gdn.run_stats import cp_size_histogram, steady_records
from relax_gdn.train.evaluate import EVAL_LOSS
from relax_gdn.train.metrics import format_cp_sizes


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}g}"
    return str(value)


def _clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-:--:--"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _is_terminal(stream) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def step_line(record: dict[str, Any], total: int) -> str:
    """The plain one-line account of a step (non-terminal output)."""
    per = "gpu" if record.get("peak_mem_gb") is not None else "process"  # GPU runs alone measure memory
    mtp = f"mtp_loss {_fmt(record['mtp_loss'])} " if record.get("mtp_loss") is not None else ""
    line = (
        f"step {record['step']}/{total} loss {_fmt(record['loss'])} {mtp}"
        f"grad_norm {_fmt(record['grad_norm'], 3)} lr {_fmt(record['lr'], 3)} "
        f"{record['tokens_per_s']:.0f} tok/s "
        f"{record['tflops_per_gpu']:.3g} TFLOP/s/{per} mfu {_fmt(record.get('mfu'), 3)} "
        f"{record['step_time_s']:.2f} s"
    )
    if record.get("cp_sizes"):  # dynamic CP: micro-batches per CP size this step
        line += f" [{format_cp_sizes(record['cp_sizes'])}]"
    if record.get(EVAL_LOSS) is not None:
        line += f" eval/loss {_fmt(record[EVAL_LOSS])}"
    return line


class ConsoleProgress:
    """The console sink of :class:`~relax_gdn.train.loggers.RunLoggers` (rank 0 only)."""

    def __init__(
        self, total_steps: int, every: int = 1, stream=None, start_step: int = 0, terminal: bool | None = None
    ):
        self.total = total_steps
        self.every = every
        self.stream = stream or sys.stdout
        self.terminal = _is_terminal(self.stream) if terminal is None else terminal
        self.start_step = start_step
        self._started = time.perf_counter()
        self._progress = None
        if self.terminal:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            console = Console(file=self.stream, force_terminal=True)
            self._progress = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"),
                console=console,
                transient=False,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self._progress.start()
            self._log_streams = _log_through(console)

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if self._progress is not None:
            stats = (
                f"loss {_fmt(record['loss'])}  {record['tokens_per_s']:.0f} tok/s  "
                f"mfu {_fmt(record.get('mfu'), 3)}"
            )
            if record.get(EVAL_LOSS) is not None:
                self._progress.console.print(f"step {step}: eval/loss {_fmt(record[EVAL_LOSS])}")
            self._progress.update(self._task, completed=step, stats=stats)
            return
        if step % self.every and step != self.total and record.get(EVAL_LOSS) is None:
            return
        elapsed = time.perf_counter() - self._started
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done > 0 else None
        self.stream.write(f"{step_line(record, self.total)} | elapsed {_clock(elapsed)} eta {_clock(eta)}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._progress is not None:
            for handler, stream in self._log_streams:
                handler.setStream(stream)  # flushes what the proxy holds, above the bar
            self._progress.stop()
            self._progress = None


def _log_through(console) -> list[tuple[logging.StreamHandler, Any]]:
    """Point the root logger's handlers that write to a terminal at ``console`` (rich's proxy prints
    each line above the live progress bar; written to the terminal directly, a line would continue
    the bar's line). Returns (handler, stream) pairs to put back."""
    from rich.file_proxy import FileProxy

    moved = []
    for handler in logging.getLogger().handlers:
        if (
            isinstance(handler, logging.StreamHandler)
            and not isinstance(handler, logging.FileHandler)
            and _is_terminal(handler.stream)
        ):
            moved.append((handler, handler.setStream(FileProxy(console, handler.stream))))
    return moved


def log_run_start(run_name: str, cfg, dims, *, device, bf16: bool, model, data) -> None:
    """The run's first lines (rank 0): ``run_name``, the layout, device, precision, parameters (and how many
    train, with LoRA) and samples; the evaluation when there is one."""
    dataset, eval_set = data.dataset, data.eval_set
    n_params = sum(p.numel() for p in model.parameters())
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = f"{n_params:,} params/rank" + (
        f" ({n_trained:,} train: LoRA adapters)" if n_trained < n_params else ""
    )
    run_logger = logging.getLogger("relax_gdn.train")
    run_logger.info(
        "run %s: world %d = dp %d x cp %d x tp %d on %s (%s); %s; %d samples (%s)",
        run_name,
        dims.world_size,
        dims.dp,
        dims.cp,
        dims.tp,
        device,
        "bf16" if bf16 else "fp32",
        params,
        len(dataset),
        dataset.counts.summary(),
    )
    fp8_plan = fp8_plan_of(model)
    if fp8_plan is not None:
        emulated = (
            " (emulated on CPU: the same casts, the GEMMs in fp32)" if str(device).startswith("cpu") else ""
        )
        run_logger.info("%s%s", fp8_plan.startup_line(), emulated)
    if eval_set is not None and cfg.eval.every_steps:
        run_logger.info(
            "evaluation every %d steps on %d samples from %s",
            cfg.eval.every_steps,
            len(eval_set.samples),
            eval_set.source,
        )


def steady_state(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps that measure speed, by the rule the comparison and the W&B summary use
    (:func:`relax_gdn.run_stats.warmup_steps`: the first 10 % of the run, at least 3 steps, are
    warm-up: kernel autotuning, allocator growth, caches)."""
    return steady_records(records)


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run_summary(result) -> list[tuple[str, str]]:
    """(label, value) rows describing a finished :class:`~relax_gdn.train.run_result.TrainResult`."""
    records = result.records
    if not records:
        return [("steps", "none run")]
    first, last = records[0], records[-1]
    steady = steady_state(records)
    skipped = len(records) - len(steady)
    rows = [
        ("steps", f"{first['step']}..{last['step']}" if result.start_step else str(last["step"])),
        ("tokens", f"{sum(r['tokens'] for r in records):,} (real, all ranks)"),
        (
            "median tok/s",
            f"{_median([r['tokens_per_s'] for r in steady]):,.0f}"
            + (f" (first {skipped} step(s) left out as warm-up)" if skipped else ""),
        ),
        (
            "median MFU",
            _fmt(_median([r.get("mfu") for r in steady]), 3)
            + ("" if last.get("mfu") is not None else " (accelerator peak unknown)"),
        ),
    ]
    peak = [r.get("peak_mem_gb") for r in records if r.get("peak_mem_gb") is not None]
    rows.append(("peak memory", f"{max(peak):.1f} GiB (rank 0)" if peak else "- (not measured off GPU)"))
    rows.append(("loss", f"{_fmt(first['loss'])} -> {_fmt(last['loss'])}"))
    if last.get("mtp_loss") is not None:  # the MTP layer's, apart from the LM's (relax_gdn.train.loss)
        rows.append(("MTP loss", f"{_fmt(first.get('mtp_loss'))} -> {_fmt(last['mtp_loss'])}"))
    evals = [r for r in records if r.get(EVAL_LOSS) is not None]
    if evals:
        rows.append(
            (
                "eval loss",
                f"{_fmt(evals[-1][EVAL_LOSS])} (step {evals[-1]['step']}, {len(evals)} evaluation(s))",
            )
        )
    if getattr(result, "fp8", None):
        rows.append(("FP8 GEMMs", result.fp8))
    histogram = cp_size_histogram(records)
    if histogram:
        rows.append(("micro-batches per CP size", format_cp_sizes(histogram)))
    nonfinite = getattr(result, "nonfinite_steps", 0)
    if nonfinite:
        rows.append(("non-finite steps", f"{nonfinite} (loss or grad norm not finite; updates not applied)"))
    stop = getattr(result, "stop", None)
    if stop is not None:
        rows.append(("stopped", f"after step {stop.step} ({stop.why}; exit code {stop.exit_code})"))
    run_dir = result.run_dir
    rows.append(("run directory", str(run_dir) if run_dir is not None else "- (none written)"))
    if run_dir is not None and (Path(run_dir) / "metrics.jsonl").exists():
        rows.append(("metrics", str(Path(run_dir) / "metrics.jsonl")))
    if result.checkpoints:
        last_checkpoint = Path(result.checkpoints[-1])
        rows.append(("checkpoints", f"{last_checkpoint.parent} (last: {last_checkpoint.name})"))
    if result.wandb_dir:
        rows.append(("W&B", str(result.wandb_dir)))
    return rows


def print_run_summary(result, stream=None, terminal: bool | None = None) -> None:
    """Print :func:`run_summary` once: a rich table on a terminal, plain aligned lines elsewhere."""
    stream = stream or sys.stdout
    rows = run_summary(result)
    if _is_terminal(stream) if terminal is None else terminal:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="run summary", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for label, value in rows:
            table.add_row(label, value)
        Console(file=stream, force_terminal=True).print(table)
        return
    width = max(len(label) for label, _ in rows)
    stream.write("run summary\n" + "".join(f"  {label:<{width}}  {value}\n" for label, value in rows))
    stream.flush()
