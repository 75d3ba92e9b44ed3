"""Where runs come from: run directories, sweep directories, benchmark JSON files and W&B.

A run is its step records (the ``metrics.jsonl`` schema, docs/design/ARCHITECTURE.md: one JSON object per
step with at least ``step``, ``loss``, ``grad_norm``, ``lr``, ``tokens``, ``tokens_per_s``,
``mfu``; optional ``step_time_s``, ``peak_mem_gb``, ``host_syncs``, ``world_size``, ``cp_sizes``)
and its resolved config (``config.yaml`` beside it), flattened to dotted keys. Nothing from the
training package is imported: the files are the interface.

Benchmark results (e.g. ``python -m relax_gdn.bench.train_e2e``) are read from one JSON file::

    {"variants": [{"name": "chunkwise", "config": {"gdn": {"cp_mode": "chunkwise"}, ...},
                   "records": [{"step": 1, "loss": ..., "tokens_per_s": ...}, ...]}, ...]}

A step whose loss or grad norm was not finite is kept (``"nonfinite": true``, the values as the
strings ``"nan"`` / ``"inf"``; files written before that mark hold ``"loss": null``): its values are
read back as float NaN / inf, which every statistic leaves out, and :func:`nonfinite_steps` counts it.

Each entry is one run. ``config`` (nested or dotted) holds what the variant set: a key that some
variants set and others leave alone takes, in those, the value every variant started from:
``meta.base_config`` (nested or dotted) where the file has it, else the recipe's default
(``relax_gdn.config.schema``), never an empty value. Entries whose configs then agree (seeds
aside) are repeats of one variant. An entry without ``config`` is told apart by its ``name``
(the config key ``bench.variant``). Other keys (``summary``, ``meta``'s rest) are ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_gdn.errors import RecipeError

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
BENCH_VARIANT_KEY = "bench.variant"
WANDB_HISTORY_PREFIX = "train/"  # the training loop logs every record field under train/


class CompareInputError(RecipeError, ValueError):
    """Input the comparison cannot use (a path, a file, an argument); the message names it and the
    command-line tool prints it (exit code 2)."""


NONFINITE_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def is_nonfinite(record: dict[str, Any]) -> bool:
    """Whether a step record (as :func:`clean_records` returns it) is a step whose loss or grad norm
    was not finite."""
    values = [record.get("loss"), record.get("grad_norm")]
    return bool(record.get("nonfinite")) or any(isinstance(v, float) and not math.isfinite(v) for v in values)


def nonfinite_steps(records: list[dict[str, Any]]) -> int:
    return sum(is_nonfinite(r) for r in records)


@dataclass
class Run:
    """One training run: where it came from, its flattened config and its step records."""

    name: str
    source: str  # a directory, a file#variant or wandb:<entity>/<project>/<id>
    config: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        """Processes of the run: the records say it; else the config (``derived.world_size``
        from W&B), else TP x CP (one data-parallel replica assumed)."""
        for record in self.records:
            if record.get("world_size"):
                return int(record["world_size"])
        if self.config.get("derived.world_size"):
            return int(self.config["derived.world_size"])
        return int(self.config.get("parallel.tp") or 1) * int(self.config.get("parallel.cp") or 1)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted))
        else:
            out[dotted] = value
    return out


def clean_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training step records in step order, one per step: a resumed run appends to its file and
    may repeat the steps between its last checkpoint and the stop; the later record wins. Eval
    records (no ``loss``) and steps run under the profiler (``"profiled": true``, benchmarks) are
    left out. A non-finite loss or grad norm (module docstring) reads back as a float."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        if "step" not in record or "loss" not in record or record.get("profiled"):
            continue
        record = dict(record)
        for key in ("loss", "grad_norm"):
            if isinstance(record.get(key), str) and record[key] in NONFINITE_TEXT:
                record[key] = NONFINITE_TEXT[record[key]]
        if record["loss"] is None:  # written before non-finite steps were marked: a NaN loss
            record["loss"], record["nonfinite"] = math.nan, True
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines):  # a run killed mid-write leaves a torn last line
                break
            raise CompareInputError(f"{path}:{n} is not JSON ({e.msg})") from e
    return records


def load_run_dir(path: str | Path) -> Run:
    """A run directory: ``metrics.jsonl`` and ``config.yaml`` (written by the training loop)."""
    import yaml

    path = Path(path)
    metrics = path / METRICS_FILE
    if not metrics.exists():
        raise CompareInputError(f"{path} has no {METRICS_FILE}: not a run directory")
    config_path = path / CONFIG_FILE
    try:
        config = flatten(yaml.safe_load(config_path.read_text()) or {}) if config_path.exists() else {}
    except yaml.YAMLError as e:
        raise CompareInputError(
            f"{config_path} is not YAML ({e}); restore the run's config.yaml or leave that run out"
        ) from e
    return Run(name=path.name, source=str(path), config=config, records=clean_records(read_jsonl(metrics)))


def recipe_defaults() -> dict[str, Any]:
    """Every config key's default, dotted (``relax_gdn.config.schema``, the one place that holds them)."""
    from dataclasses import asdict

    from relax_gdn.config.schema import RunConfig

    return flatten(asdict(RunConfig()))


def load_bench_json(path: str | Path) -> list[Run]:
    """The benchmark shape in the module docstring."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CompareInputError(f"{path} is not JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(data, dict) or not isinstance(data.get("variants"), list):
        raise CompareInputError(f'{path}: expected {{"variants": [{{"name", "config", "records"}}, ...]}}')
    configs = [flatten(variant.get("config") or {}) for variant in data["variants"]]
    set_somewhere = {key for config in configs for key in config}
    start = {**recipe_defaults(), **flatten((data.get("meta") or {}).get("base_config") or {})}
    runs = []
    for i, (variant, config) in enumerate(zip(data["variants"], configs)):
        name = str(variant.get("name", f"variant{i}"))
        resolved = {key: start[key] for key in set_somewhere if key in start} | config
        if "config" not in variant:  # nothing says what it ran: its name does
            resolved[BENCH_VARIANT_KEY] = name
        runs.append(
            Run(
                name=f"{name}#{i}",
                source=f"{path}#{i}",
                config=resolved,
                records=clean_records(variant.get("records") or []),
            )
        )
    return runs


def find_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Runs under each path: a run directory, a sweep (or any) directory searched for
    ``metrics.jsonl`` files, or a benchmark ``.json`` file. Run names are made unique by their
    path relative to the argument (``<sweep>/3`` -> ``3``)."""
    runs: list[Run] = []
    for arg in paths:
        path = Path(arg)
        if path.is_file() and path.suffix == ".json":
            runs.extend(load_bench_json(path))
        elif (path / METRICS_FILE).exists():
            runs.append(load_run_dir(path))
        elif path.name == METRICS_FILE and path.is_file():  # a run's file given for its directory
            runs.append(load_run_dir(path.parent))
        elif path.is_dir():
            found = sorted(p.parent for p in path.rglob(METRICS_FILE))
            if not found:
                raise CompareInputError(f"no {METRICS_FILE} under {path}")
            for run_dir in found:
                run = load_run_dir(run_dir)
                run.name = str(run_dir.relative_to(path)) if run_dir != path else run_dir.name
                runs.append(run)
        else:
            raise CompareInputError(f"{path} is neither a run/sweep directory nor a benchmark .json file")
    seen: dict[str, int] = {}
    for run in runs:  # two sweeps both have a run "0"
        seen[run.name] = seen.get(run.name, 0) + 1
    for run in runs:
        if seen[run.name] > 1:
            run.name = run.source
    return [r for r in runs if r.records]


# ---- W&B ------------------------------------------------------------------------------------------


def records_from_wandb_history(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """W&B history rows (``_step`` + ``train/<field>``, as the training loop logs them) -> step records."""
    records = []
    for row in rows:
        # a NaN loss is a non-finite step (kept); other NaNs are values the row does not hold
        fields = {
            k[len(WANDB_HISTORY_PREFIX) :]: v
            for k, v in row.items()
            if k.startswith(WANDB_HISTORY_PREFIX) and (k == f"{WANDB_HISTORY_PREFIX}loss" or not _is_nan(v))
        }
        if "loss" not in fields or row.get("_step") is None:
            continue
        records.append({"step": int(row["_step"]), **fields})
    return clean_records(records)


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def run_from_wandb(run: Any, path: str) -> Run:
    """A W&B public-API run object (``.id``, ``.name``, ``.config``, ``.scan_history()``) -> Run."""
    config = flatten({k: v for k, v in dict(run.config).items() if not str(k).startswith("_")})
    return Run(
        name=run.name or run.id,
        source=f"wandb:{path}/{run.id}",
        config=config,
        records=records_from_wandb_history(run.scan_history()),
    )


def load_wandb_runs(path: str, group: str, api: Any = None) -> list[Run]:
    """Every run of W&B group ``group`` in ``ENTITY/PROJECT`` (needs the W&B server and an API key)."""
    try:
        if api is None:
            import wandb

            api = wandb.Api()
        runs: Iterator[Any] = iter(api.runs(path, filters={"group": group}))
        out = [run_from_wandb(r, path) for r in runs]
    except Exception as e:  # noqa: BLE001 - no server, no key, no such project: one message
        raise CompareInputError(
            f"reading W&B {path} group {group!r} failed ({type(e).__name__}: {e}); it needs "
            "the W&B server and an API key (wandb login / WANDB_API_KEY)"
        ) from e
    if not out:
        raise CompareInputError(f"W&B project {path} has no runs in group {group!r}")
    return [r for r in out if r.records]
