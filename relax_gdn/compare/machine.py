"""Whether two sets of runs shared a machine in a way that makes their tok/s compare the machine
more than the code, read from the step records' ``time``, ``host``, ``cpus`` and ``load_1m``
(``relax_gdn.train.loggers.where_and_when``; records without them, benchmark JSON and W&B runs,
say nothing here):

* **at the same time**: steady-state steps of a run of one and a run of the other overlapped in
  time on one host (a local sweep with ``parallel_jobs`` > 1, two commands started side by side);
* **one after another on a loaded machine**: all the runs on one host, none overlapping, and that
  host's 1-minute load during their steady state far above its cores (more than
  :data:`LOADED_FACTOR` x cores): each run's speed then depends on what else ran at the time.

The comparison keeps its verdict and the report says this beside it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from relax_gdn.compare.runs import Run

LOADED_FACTOR = 1.5  # a 1-minute load above this many times the host's cores is far above them
Steady = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]  # a run's records -> its steady-state ones


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _windows(run: Run, steady: Steady) -> list[tuple[float, float]]:
    """The steady-state steps as (start, end) wall-clock intervals."""
    return [
        (r["time"] - r["step_time_s"], r["time"])
        for r in steady(run.records)
        if _number(r.get("time")) and _number(r.get("step_time_s"))
    ]


def _host(run: Run) -> str | None:
    hosts = {r.get("host") for r in run.records if r.get("host")}
    return hosts.pop() if len(hosts) == 1 else None


def _overlapping_steps(a: Run, b: Run, steady: Steady) -> int:
    """How many of ``a``'s steady-state steps overlap a steady-state step of ``b`` in time."""
    theirs = _windows(b, steady)
    return sum(
        any(start < end_b and start_b < end for start_b, end_b in theirs)
        for start, end in _windows(a, steady)
    )


def shared_machine(runs: list[Run], baseline: list[Run], steady: Steady) -> dict[str, Any] | None:
    """Why the tok/s of ``runs`` against ``baseline`` compares their machine (module docstring), as
    ``{"kind": "overlap" | "loaded", "host", "cpus", ...}``, or None. ``steady``: a run's
    steady-state records (the steps the tok/s statistics use)."""
    for a in runs:
        for b in baseline:
            if a is b or _host(a) is None or _host(a) != _host(b):
                continue
            steps = _overlapping_steps(a, b, steady)
            if steps:
                return {
                    "kind": "overlap",
                    "host": _host(a),
                    "cpus": _cpus(a),
                    "run": a.name,
                    "baseline_run": b.name,
                    "steps": steps,
                    "of": len(_windows(a, steady)),
                }
    hosts = {_host(run) for run in runs + baseline}
    if len(hosts) != 1 or None in hosts:
        return None
    loads = [load for run in runs + baseline if (load := _median_load(run, steady)) is not None]
    cpus = _cpus((runs + baseline)[0])
    if not loads or not cpus or max(loads) <= LOADED_FACTOR * cpus:
        return None
    return {"kind": "loaded", "host": hosts.pop(), "cpus": cpus, "load": max(loads)}


def _cpus(run: Run) -> int | None:
    values = [r["cpus"] for r in run.records if _number(r.get("cpus"))]
    return int(values[0]) if values else None


def _median_load(run: Run, steady: Steady) -> float | None:
    loads = [float(r["load_1m"]) for r in steady(run.records) if _number(r.get("load_1m"))]
    return statistics.median(loads) if loads else None


def caution(found: dict[str, Any] | None) -> str | None:
    """What the report says beside the tok/s verdict, or None."""
    if found is None:
        return None
    if found["kind"] == "overlap":
        return (
            f"run {found['run']} and the baseline's run {found['baseline_run']} ran at the same time on "
            f"{found['host']} "
            f"({found['steps']} of {found['of']} steady-state steps overlapped), sharing its {found['cpus']} "
            "CPUs: the tok/s ratio measures that sharing as much as the code"
        )
    return (
        f"the runs ran one after another on {found['host']} at a load of up to {found['load']:.1f} on "
        f"{found['cpus']} CPUs: the tok/s ratio measures what else ran there as much as the code"
    )
