"""A saved W&B report with the comparison's panels (``--wandb-report ENTITY/PROJECT --group G``).

:func:`report_spec` is pure (what the report holds: the run set's filter and grouping, one panel
per metric) and tested offline; :func:`build_report` turns it into ``wandb_workspaces`` report
objects (offline too); ``Report.save()`` needs a W&B server and an API key (``WANDB_API_KEY``).
"""

from __future__ import annotations

from typing import Any

from relax_gdn.compare.runs import CompareInputError

HISTORY = "train/"  # the training loop logs each record field as train/<field>
LINE_PANELS = (
    ("loss", "loss"),
    ("mtp_loss", "MTP loss"),
    ("grad_norm", "grad norm"),
    ("tokens_per_s", "tok/s"),
    ("mfu", "MFU"),
    ("step_time_s", "step time (s)"),
    ("peak_mem_gb", "peak memory (GB)"),
)
BAR_PANELS = (
    ("steady/tokens_per_s", "steady-state tok/s (median)"),
    ("steady/tokens_per_s_per_gpu", "steady-state tok/s/GPU (median)"),
    ("steady/mfu", "steady-state MFU (median)"),
    ("steady/step_time_s", "steady-state step time (s)"),
    ("peak_mem_gb", "peak memory (GB)"),
    ("final_loss", "final loss"),
)


def report_spec(path: str, group: str, group_by: str = "gdn.cp_mode") -> dict[str, Any]:
    """The report for W&B group ``group`` of ``ENTITY/PROJECT``: curves vs step and bars of the
    end-of-run summaries (``relax_gdn.compare.stats.run_summary``), runs grouped by ``group_by``."""
    if path.count("/") != 1 or not all(path.split("/")):
        raise CompareInputError(f"--wandb-report {path!r}: expected ENTITY/PROJECT")
    entity, project = path.split("/")
    return {
        "entity": entity,
        "project": project,
        "title": f"relax-gdn: {group} by {group_by}",
        "description": "Curves vs step (one line per group, mean with min/max band) and the end-of-run "
        "steady-state summaries (warm-up steps dropped) of every run in the group.",
        "runset": {"name": group, "filters": f"Group = '{group}'", "groupby": [f"config.{group_by}"]},
        "panels": [
            {"kind": "line", "title": f"{title} vs step", "x": "Step", "y": [HISTORY + key]}
            for key, title in LINE_PANELS
        ]
        + [{"kind": "bar", "title": title, "metrics": [key]} for key, title in BAR_PANELS],
    }


def build_report(spec: dict[str, Any]):
    """``wandb_workspaces`` Report objects for ``spec`` (no server needed until ``.save()``)."""
    import wandb_workspaces.reports.v2 as wr

    runset = wr.Runset(
        entity=spec["entity"],
        project=spec["project"],
        name=spec["runset"]["name"],
        filters=spec["runset"]["filters"],
        groupby=spec["runset"]["groupby"],
    )
    panels = []
    for panel in spec["panels"]:
        if panel["kind"] == "line":
            panels.append(wr.LinePlot(title=panel["title"], x=panel["x"], y=panel["y"]))
        else:
            panels.append(wr.BarPlot(title=panel["title"], metrics=panel["metrics"]))
    return wr.Report(
        entity=spec["entity"],
        project=spec["project"],
        title=spec["title"],
        description=spec["description"],
        blocks=[
            wr.H1(text=spec["title"]),
            wr.P(text=spec["description"]),
            wr.PanelGrid(runsets=[runset], panels=panels),
        ],
    )


def save_report(spec: dict[str, Any]) -> str:
    """Save the report on the W&B server; returns its URL."""
    report = build_report(spec)
    try:
        report.save()
    except Exception as e:  # noqa: BLE001 - no server, no key: one message
        raise CompareInputError(
            f"saving the W&B report to {spec['entity']}/{spec['project']} failed "
            f"({type(e).__name__}: {e}); it needs the W&B server and an API key (wandb login / "
            "WANDB_API_KEY)"
        ) from e
    return report.url
