"""The comparison's outputs: ``summary.md`` (a table to paste), ``summary.json``, PNG plots and one
self-contained ``report.html`` (the PNGs embedded as base64).

Every plot's axes have one fixed size whatever the labels: legends go below the axes and long
labels wrap, and the saved image grows around them (``bbox_inches="tight"``) instead of the axes
shrinking. Each variant has its own colour, line style, marker and line width (the first widest,
drawn underneath), with the markers of different variants at different steps, so curves that
coincide all stay visible."""

from __future__ import annotations

import base64
import html
import json
import textwrap
from pathlib import Path
from typing import Any

from relax_gdn.compare.machine import caution
from relax_gdn.compare.runs import Run
from relax_gdn.compare.stats import METRIC_LABELS, group_variants, variant_curves

TABLE_METRICS = (
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "mfu",
    "step_time_s",
    "peak_mem_gb",
    "host_syncs",
    "final_loss",
    "mean_loss",
    "final_mtp_loss",
)
OPTIONAL_COLUMNS = ("final_mtp_loss",)  # shown only when a variant has values (runs that train an MTP layer)
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
PLOTTED_CURVES = (
    ("loss", "loss"),
    ("mtp_loss", "MTP loss"),
    ("grad_norm", "grad norm"),
    ("tokens_per_s", "tok/s"),
    ("mfu", "MFU"),
)
AXES_INCHES = (6.4, 3.2)  # width, height of every curve plot's axes
BAR_INCHES = 0.42  # throughput plot: axes height per variant with a one-line label
BAR_LINE_INCHES = 0.14  # and per further line of its wrapped label
BAR_LABEL_CHARS = 48  # characters per line of a bar's label
DPI = 100
MARKS_PER_LINE = 8  # markers along one curve


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.4g}"


def _cell(stat: dict[str, Any] | None) -> str:
    if stat is None:
        return "-"
    if stat["n"] == 1 or stat["lo"] == stat["hi"]:
        return _num(stat["median"])
    return f"{_num(stat['median'])} [{_num(stat['lo'])}, {_num(stat['hi'])}]"


def _pct(x: float | None, sign: str = "+") -> str:
    return "-" if x is None else f"{100 * x:{sign}.1f} %"


def table_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    metrics = [
        m
        for m in TABLE_METRICS
        if m not in OPTIONAL_COLUMNS or any(v["stats"].get(m) for v in summary["variants"])
    ]
    header = ["variant", "runs", "steady steps"] + [METRIC_LABELS[m] for m in metrics] + ["tok/s vs baseline"]
    rows = []
    for v in summary["variants"]:
        ratio = v["ratio_to_baseline"]["tokens_per_s"]
        steady = sum(r["steady_steps"] for r in v["runs"])
        label = (
            v["label"]
            + (" (baseline)" if v["baseline"] else "")
            + (f" (diverged: {v['nonfinite_steps']} non-finite steps)" if v.get("diverged") else "")
        )
        rows.append(
            [label, str(len(v["runs"])), str(steady)]
            + [_cell(v["stats"][m]) for m in metrics]
            + ["-" if ratio is None else f"{ratio:.3f}x"]
        )
    return header, rows


def verdict_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for noise in summary["noise"]["variants"]:
        mtp = noise.get("mtp_loss_max_spread")
        lines.append(
            f"A/A {noise['variant']} ({noise['runs']} runs): tok/s spread {_pct(noise['tokens_per_s_spread'], '')}"
            f", loss max spread {_num(noise['loss_max_spread'])}, grad-norm max spread "
            f"{_num(noise['grad_norm_max_spread'])}"
            + ("" if mtp is None else f", MTP-loss max spread {_num(mtp)}")
        )
    for v in summary["variants"]:
        for run in v["runs"]:
            if run.get("diverged"):
                lines.append(
                    f"{v['label']}: run {run['name']} **diverged**: {run['nonfinite_steps']} non-finite "
                    f"step(s) from step {run['first_nonfinite_step']} (loss or grad norm not finite); "
                    "left out of the A/A noise floor"
                )
    if not summary["noise"]["available"]:
        lines.append(
            "No variant has two or more runs (seeds): there is no A/A, so the differences below are "
            "measured but not judged (no A/A)."
        )
    for c in summary["comparisons"]:
        named = (("loss", "loss curve"), ("grad_norm", "grad-norm curve"), ("mtp_loss", "MTP-loss curve"))
        curves = [
            _curve_text(name, c[key]) for key, name in named if key != "mtp_loss" or c[key].get("steps")
        ]
        paired = c.get("paired", {})
        curves += [_paired_text(name, paired[key]) for key, name in named if paired.get(key, {}).get("pairs")]
        shared = caution(c.get("shared_machine"))
        throughput = _throughput_text(c["throughput"]) + (f" (**caution**: {shared})" if shared else "")
        lines.append(f"{c['variant']} vs {c['baseline']}: " + "; ".join([throughput, *curves]))
    return lines


def _throughput_text(t: dict[str, Any]) -> str:
    text = f"tok/s **{t['verdict']}**"
    if "ratio" not in t:
        return text
    noise = "" if t["verdict"] == "no A/A" else f"; A/A noise {_pct(t['noise'], '')}"
    return (
        text + f" ({t['ratio']:.3f}x, {_pct(t['diff'])}{noise}; intervals "
        f"{'overlap' if t['intervals_overlap'] else 'do not overlap'})"
    )


def _curve_text(name: str, k: dict[str, Any]) -> str:
    text = f"{name} **{k['verdict']}**"
    if not k.get("steps"):
        return text
    against = (
        ""
        if k["verdict"] in ("no A/A", "diverged")
        else f" = {k['noise_ratio']:.2f}x the A/A noise {_num(k['rms_noise'])}"
    )
    return (
        text + f" (RMS diff {_num(k['rms_diff'])}{against} over {k['steps']} steps; max |diff| "
        f"{_num(k['max_abs_diff'])} at step {k['at_step']})"
    )


def _paired_text(name: str, k: dict[str, Any]) -> str:
    seeds = ", ".join(f"{p['seed']}: {_signed(p['mean_diff'])}" for p in k["per_pair"])
    return (
        f"{name}, same-seed pairs: **{k['verdict']}** (mean diff {_signed(k['mean_diff'])}"
        f" ({_pct(k['rel_diff'])}), 95 % interval [{_signed(k['lo'])}, {_signed(k['hi'])}] over "
        f"{k['pairs']} same-seed pair(s), {k['steps']} steps; by seed {seeds})"
    )


def _signed(x: float) -> str:
    return ("+" if x >= 0 else "") + _num(x)


def markdown(summary: dict[str, Any]) -> str:
    header, rows = table_rows(summary)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    out += [
        "",
        f"Steady state: {summary['rules']['warmup']} dropped; cells: median [95 % bootstrap interval].",
        f"Variants differ in: {', '.join(summary['varying_keys']) or '(nothing: repeats only)'}.",
        "",
    ]
    out += [f"- {line}" for line in verdict_lines(summary)]
    return "\n".join(out) + "\n"


def _styles(labels: list[str]) -> dict[str, dict[str, Any]]:
    """Matplotlib line properties per variant (module docstring): colour, dashes, marker, width."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    n = len(labels)
    return {
        label: {
            "color": cmap(i % 10),
            "ls": LINE_STYLES[i % len(LINE_STYLES)],
            "marker": MARKERS[i % len(MARKERS)],
            "lw": 3.0 - 1.6 * i / (n - 1) if n > 1 else 1.6,
            "zorder": 2 + i,
        }
        for i, label in enumerate(labels)
    }


def _wrapped(label: str, width: int) -> str:
    return "\n".join(textwrap.wrap(label, width, break_long_words=False, break_on_hyphens=False)) or label


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fixed_axes(plt, width_in: float, height_in: float):
    """A figure whose axes are ``width_in`` x ``height_in``; saving with ``bbox_inches="tight"``
    then grows the image around titles, tick labels and legends instead of shrinking the axes."""
    fig = plt.figure(figsize=(width_in, height_in), dpi=DPI)
    return fig, fig.add_axes((0.0, 0.0, 1.0, 1.0))


def _legend_below(ax, styles: dict[str, dict[str, Any]]) -> None:
    from matplotlib.lines import Line2D

    longest = max(len(label) for label in styles)
    ncols, wrap = (3, 28) if longest <= 28 else (2, 44) if longest <= 44 else (1, 90)
    handles = [
        Line2D([], [], markersize=5, markeredgecolor="white", markeredgewidth=0.6, **style)
        for style in styles.values()
    ]
    ax.legend(
        handles,
        [_wrapped(label, wrap) for label in styles],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.2),
        ncols=min(ncols, len(styles)),
        fontsize=8,
        frameon=False,
    )


def plot_curves(runs: list[Run], out_dir: Path) -> list[Path]:
    """``<key>.png`` per curve: one line per run, one style per variant (curves with no values,
    e.g. MFU on CPU, are skipped)."""
    plt = _pyplot()
    _, variants = group_variants(runs)
    by_variant = {v.label: v.runs for v in variants}
    styles = _styles(list(by_variant))
    written = []
    for key, title in PLOTTED_CURVES:
        curves = variant_curves(by_variant, key)
        if not any(steps for lines in curves.values() for steps, _ in lines):
            continue
        fig, ax = _fixed_axes(plt, *AXES_INCHES)
        for n, (label, lines) in enumerate(curves.items()):
            for steps, values in lines:
                # at least one step apart per variant: each variant marks steps the others do not
                every = max(len(curves), round(len(steps) / MARKS_PER_LINE))
                ax.plot(
                    steps,
                    values,
                    markersize=5,
                    markeredgecolor="white",
                    markeredgewidth=0.6,
                    markevery=(n * every // len(curves), every),
                    **styles[label],
                )
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("step")
        ax.set_ylabel(title)
        ax.set_title(f"{title} vs step")
        ax.grid(alpha=0.3)
        _legend_below(ax, styles)
        path = out_dir / f"{key}.png"
        fig.savefig(path, bbox_inches="tight", pad_inches=0.15)
        plt.close(fig)
        written.append(path)
    return written


def plot_throughput_bars(summary: dict[str, Any], out_dir: Path) -> Path:
    """Steady-state median tok/s per variant with its 95 % interval."""
    plt = _pyplot()
    variants = [v for v in summary["variants"] if v["stats"]["tokens_per_s"]]
    labels = [v["label"] for v in variants]
    styles = _styles([v["label"] for v in summary["variants"]])
    medians = [v["stats"]["tokens_per_s"]["median"] for v in variants]
    errors = [
        [m - v["stats"]["tokens_per_s"]["lo"] for m, v in zip(medians, variants)],
        [v["stats"]["tokens_per_s"]["hi"] - m for m, v in zip(medians, variants)],
    ]
    ticks = [_wrapped(lb, BAR_LABEL_CHARS) for lb in labels]
    lines = max((tick.count("\n") + 1 for tick in ticks), default=1)
    per_bar = BAR_INCHES + BAR_LINE_INCHES * (lines - 1)  # room for the wrapped labels
    fig, ax = _fixed_axes(plt, AXES_INCHES[0], max(1.2, per_bar * len(labels)))
    ax.barh(range(len(labels)), medians, xerr=errors, color=[styles[lb]["color"] for lb in labels], capsize=4)
    ax.set_yticks(range(len(labels)), ticks, fontsize=8)
    ax.invert_yaxis()
    ax.set_title("steady-state tok/s per variant")
    ax.set_xlabel("tok/s (median, 95 % interval)")
    ax.grid(axis="x", alpha=0.3)
    path = out_dir / "throughput.png"
    fig.savefig(path, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return path


def html_report(summary: dict[str, Any], images: list[Path]) -> str:
    header, rows = table_rows(summary)
    table = "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
    table += "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    table += "</table>"
    verdicts = "".join(f"<li>{html.escape(line).replace('**', '')}</li>" for line in verdict_lines(summary))
    pictures = "".join(  # the bars (as wide as their labels) get a row of their own
        f'<figure{" class=wide" if p.stem == "throughput" else ""}><img alt="{p.stem}" '
        f'src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"<figcaption>{p.name}</figcaption></figure>"
        for p in images
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>relax-gdn comparison</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 7px;text-align:right}}td:first-child,th:first-child{{text-align:left;max-width:30em}}
.plots{{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:1em;align-items:start}}
figure{{margin:0}}figure.wide{{grid-column:1/-1}}figure img{{max-width:100%;height:auto}}figcaption{{font-size:12px;color:#555}}</style></head><body>
<h1>relax-gdn comparison</h1>
<p>Variants differ in: {html.escape(", ".join(summary["varying_keys"]) or "(nothing: repeats only)")}.
Baseline: {html.escape(summary["baseline"])}. Steady state: {html.escape(summary["rules"]["warmup"])} dropped;
cells: median [95 % bootstrap interval].</p>
{table}
<h2>A/A and A/B</h2><ul>{verdicts}</ul>
<h2>Plots</h2><div class="plots">{pictures}</div>
</body></html>
"""


def write_reports(runs: list[Run], summary: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """summary.md, summary.json, the PNGs and report.html in ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "summary.md": out / "summary.md",
        "summary.json": out / "summary.json",
        "report.html": out / "report.html",
    }
    paths["summary.md"].write_text(markdown(summary))
    paths["summary.json"].write_text(json.dumps(summary, indent=2) + "\n")
    images = plot_curves(runs, out)
    images.append(plot_throughput_bars(summary, out))
    for image in images:
        paths[image.name] = image
    paths["report.html"].write_text(html_report(summary, images))
    return paths
