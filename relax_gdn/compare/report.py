"""The comparison's outputs: ``summary.md`` (a table to paste), ``summary.json``, PNG plots and one
self-contained ``report.html`` (the PNGs embedded as base64)."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from relax_gdn.compare.runs import Run
from relax_gdn.compare.stats import METRIC_LABELS, group_variants, variant_curves

TABLE_METRICS = ("tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_time_s", "peak_mem_gb", "host_syncs",
                 "final_loss", "mean_loss")
LINE_STYLES = ("-", "--", ":", "-.")
PLOTTED_CURVES = (("loss", "loss"), ("grad_norm", "grad norm"), ("tokens_per_s", "tok/s"), ("mfu", "MFU"))


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
    header = ["variant", "runs", "steady steps"] + [METRIC_LABELS[m] for m in TABLE_METRICS] + ["tok/s vs baseline"]
    rows = []
    for v in summary["variants"]:
        ratio = v["ratio_to_baseline"]["tokens_per_s"]
        steady = sum(r["steady_steps"] for r in v["runs"])
        label = v["label"] + (" (baseline)" if v["baseline"] else "")
        rows.append([label, str(len(v["runs"])), str(steady)] + [_cell(v["stats"][m]) for m in TABLE_METRICS]
                    + ["-" if ratio is None else f"{ratio:.3f}x"])
    return header, rows


def verdict_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for noise in summary["noise"]["variants"]:
        lines.append(f"A/A {noise['variant']} ({noise['runs']} runs): tok/s spread {_pct(noise['tokens_per_s_spread'], '')}"
                     f", loss max spread {_num(noise['loss_max_spread'])}, grad-norm max spread "
                     f"{_num(noise['grad_norm_max_spread'])}")
    if not summary["noise"]["available"]:
        lines.append("No variant has >= 2 runs: no A/A noise floor, A/B differences are not judged (no A/A).")
    for c in summary["comparisons"]:
        t = c["throughput"]
        text = f"{c['variant']} vs {c['baseline']}: tok/s **{t['verdict']}**"
        if "ratio" in t:
            text += (f" ({t['ratio']:.3f}x, {_pct(t['diff'])}; A/A noise {_pct(t['noise'], '')}; intervals "
                     f"{'overlap' if t['intervals_overlap'] else 'do not overlap'})")
        for key, name in (("loss", "loss curve"), ("grad_norm", "grad-norm curve")):
            k = c[key]
            text += f"; {name} **{k['verdict']}**"
            if k.get("steps"):
                text += (f" (RMS diff {_num(k['rms_diff'])} = {k['noise_ratio']:.2f}x the A/A noise "
                         f"{_num(k['rms_noise'])} over {k['steps']} steps; max |diff| {_num(k['max_abs_diff'])} "
                         f"at step {k['at_step']})")
        lines.append(text)
    return lines


def markdown(summary: dict[str, Any]) -> str:
    header, rows = table_rows(summary)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    out += ["", f"Steady state: {summary['rules']['warmup']} dropped; cells: median [95 % bootstrap interval].",
            f"Variants differ in: {', '.join(summary['varying_keys']) or '(nothing: repeats only)'}.", ""]
    out += [f"- {line}" for line in verdict_lines(summary)]
    return "\n".join(out) + "\n"


def _colours(labels: list[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def plot_curves(runs: list[Run], out_dir: Path) -> list[Path]:
    """``<key>.png`` per curve: one line per run, one colour per variant (curves with no values,
    e.g. MFU on CPU, are skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, variants = group_variants(runs)
    by_variant = {v.label: v.runs for v in variants}
    colours = _colours(list(by_variant))
    written = []
    for key, title in PLOTTED_CURVES:
        curves = variant_curves(by_variant, key)
        if not any(steps for lines in curves.values() for steps, _ in lines):
            continue
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for n, (label, lines) in enumerate(curves.items()):
            for i, (steps, values) in enumerate(lines):  # dashes keep identical curves of two variants visible
                ax.plot(steps, values, color=colours[label], ls=LINE_STYLES[n % len(LINE_STYLES)], alpha=0.85, lw=1.3,
                        label=label if i == 0 else None)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("step")
        ax.set_ylabel(title)
        ax.set_title(f"{title} vs step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{key}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def plot_throughput_bars(summary: dict[str, Any], out_dir: Path) -> Path:
    """Steady-state median tok/s per variant with its 95 % interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [v for v in summary["variants"] if v["stats"]["tokens_per_s"]]
    labels = [v["label"] for v in variants]
    colours = _colours([v["label"] for v in summary["variants"]])
    medians = [v["stats"]["tokens_per_s"]["median"] for v in variants]
    errors = [[m - v["stats"]["tokens_per_s"]["lo"] for m, v in zip(medians, variants)],
              [v["stats"]["tokens_per_s"]["hi"] - m for m, v in zip(medians, variants)]]
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(labels) + 1.5), dpi=100)
    ax.barh(range(len(labels)), medians, xerr=errors, color=[colours[lb] for lb in labels], capsize=4)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("steady-state tok/s (median, 95 % interval)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = out_dir / "throughput.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def html_report(summary: dict[str, Any], images: list[Path]) -> str:
    header, rows = table_rows(summary)
    table = "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
    table += "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    table += "</table>"
    verdicts = "".join(f"<li>{html.escape(line).replace('**', '')}</li>" for line in verdict_lines(summary))
    pictures = "".join(
        f'<figure><img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"<figcaption>{p.name}</figcaption></figure>" for p in images)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>relax-gdn comparison</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 7px;text-align:right}}td:first-child,th:first-child{{text-align:left}}
figure{{display:inline-block;margin:1em}}</style></head><body>
<h1>relax-gdn comparison</h1>
<p>Variants differ in: {html.escape(', '.join(summary['varying_keys']) or '(nothing: repeats only)')}.
Baseline: {html.escape(summary['baseline'])}. Steady state: {html.escape(summary['rules']['warmup'])} dropped;
cells: median [95 % bootstrap interval].</p>
{table}
<h2>A/A and A/B</h2><ul>{verdicts}</ul>
<h2>Plots</h2>{pictures}
</body></html>
"""


def write_reports(runs: list[Run], summary: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """summary.md, summary.json, the PNGs and report.html in ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary.md": out / "summary.md", "summary.json": out / "summary.json", "report.html": out / "report.html"}
    paths["summary.md"].write_text(markdown(summary))
    paths["summary.json"].write_text(json.dumps(summary, indent=2) + "\n")
    images = plot_curves(runs, out)
    images.append(plot_throughput_bars(summary, out))
    for image in images:
        paths[image.name] = image
    paths["report.html"].write_text(html_report(summary, images))
    return paths
