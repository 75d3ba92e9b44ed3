"""Compare training runs: ``python -m relax_gdn.compare RUN_OR_SWEEP_DIR... [--out DIR]``.

Reads run directories (``metrics.jsonl`` + ``config.yaml``), sweep directories, benchmark JSON
files or a W&B group; groups runs into variants by the config keys that differ; reports
steady-state medians with bootstrap intervals, ratios to a baseline and A/A-vs-A/B verdicts as
``summary.md``, ``summary.json``, PNG plots and ``report.html``. Rules: :mod:`.stats`.
Depends on numpy (matplotlib and wandb imported when used) and :mod:`relax_gdn.run_stats` (the
statistics it shares with the training loop), never on the training package.
"""

from relax_gdn.compare.runs import Run, find_runs, load_bench_json, load_run_dir, load_wandb_runs
from relax_gdn.compare.stats import compare_runs
from relax_gdn.run_stats import run_summary, warmup_steps

__all__ = [
    "Run",
    "compare_runs",
    "find_runs",
    "load_bench_json",
    "load_run_dir",
    "load_wandb_runs",
    "run_summary",
    "warmup_steps",
]
