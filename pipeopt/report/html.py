"""The report as one self-contained HTML page: inline CSS and SVG charts, no script, nothing fetched at view time."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from pipeopt.files import write_atomic
from pipeopt.measure.window import WindowStats
from pipeopt.report.console import (
    ROWS,
    cache_lines,
    checked,
    health_line,
    memory_lines,
    settings_text,
    size_text,
    speedups,
    time_lines,
    trial_cells,
)
from pipeopt.report.fit import FitAndCost
from pipeopt.report.model import Report

COLOURS = {"wait": "#d9534f", "transfer": "#f0ad4e", "compute": "#5cb85c", "other": "#bbbbbb"}
MEMORY_COLOURS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer state": "#76b7b2",
                  "activations": "#e15759", "batch": "#59a14f", "allocator other": "#bab0ac"}
SERIES = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b")
CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1040px;color:#222}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#666} .verdict{padding:10px 14px;border-radius:6px;background:#f4f6fb;margin:14px 0}
.input-bound{border-left:5px solid #d9534f} .compute-bound{border-left:5px solid #5cb85c}
.balanced{border-left:5px solid #f0ad4e}
table{border-collapse:collapse;margin:6px 0} td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:right}
td:first-child,th:first-child{text-align:left} pre{background:#f6f8fa;padding:10px;border-radius:6px}
.del{color:#b31d28} .add{color:#22863a} .failed{color:#b31d28} svg{display:block;margin:6px 0}
.legend span{display:inline-block;margin-right:14px} .sw{width:10px;height:10px;display:inline-block;margin-right:4px}
"""


def _e(value: object) -> str:
    return html.escape(str(value))


def render_html(report: Report) -> str:
    env = report.environment
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>pipeopt report {_e(report.created)}</title><style>{CSS}</style></head><body>",
        f"<h1>pipeopt report</h1><div class='meta'>{_e(report.created)} &middot; {_e(report.mode)} &middot; "
        f"{_e(env.device_name)} ({_e(env.accelerator)} x{env.device_count}, world size {env.world_size}) &middot; "
        f"{env.cpu_count} CPUs &middot; torch {_e(env.torch)} &middot; pipeopt {_e(env.pipeopt)}</div>",
        _verdict(report),
        "<h2>Before / after</h2>", _table(report),
        "<h2>Where a step's time goes</h2>", _split_chart(report),
    ]
    if report.changes:
        parts += ["<h2>Changes</h2>", _changes(report)]
    if report.trials:
        parts += ["<h2>Trials on the live run</h2>", _trials_chart(report), _trials_table(report)]
    parts += ["<h2>Over the run</h2>", _timeline(report)]
    if report.fit is not None:
        parts += ["<h2>Fit and cost</h2>", _fit_section(report, report.fit)]
    if report.sample_cache is not None:
        parts += ["<h2>Sample cache</h2><ul>"
                  + "".join(f"<li>{_e(line)}</li>" for line in cache_lines(report.sample_cache)) + "</ul>"]
    extra = [f"Skipped {s.group}: {s.reason}" for s in report.skipped] + list(report.notes)
    if extra:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in extra) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(report: Report, path: Path) -> Path:
    """Write the page atomically. Raises ``OSError``."""
    return write_atomic(path, render_html(report))


def _verdict(report: Report) -> str:
    v = report.verdict
    if v is None:
        return "<div class='verdict'>Not enough steps were measured for a window.</div>"
    lines = [f"<b>{_e(v.kind)}</b>: {_e(v.reason)}.",
             f"Estimated speedup if input were free: <b>{v.input_free_speedup:.2f}x</b> "
             f"({_e(report.before_word)} window)."]
    lines += [f"{_e(label)}: <b>{value}</b>{_e(remark)}." for label, value, remark in speedups(report)]
    return f"<div class='verdict {_e(v.kind)}'>" + "<br>".join(lines) + "</div>"


def _table(report: Report) -> str:
    rows = [f"<table><tr><th>metric</th><th>{_e(report.before_name)}</th><th>after</th></tr>"]
    for label, get, fmt in ROWS:
        cells = []
        for w in (report.before, report.after):
            value = get(w) if w is not None else None
            cells.append("-" if w is None else ("n/a" if value is None else fmt(value)))
        rows.append(f"<tr><td>{_e(label)}</td><td>{_e(cells[0])}</td><td>{_e(cells[1])}</td></tr>")
    rows.append("</table>")
    rows.append(f"<div class='meta'>GPU monitoring: {_e(report.environment.gpu_monitoring)}</div>")
    return "".join(rows)


def _split_chart(report: Report) -> str:
    windows = [(name, w) for name, w in ((report.before_word, report.before), ("after", report.after))
               if w is not None]
    if not windows:
        return "<p>No window was measured.</p>"
    width, left, bar = 900, 70, 26
    longest = max(w.step_time_s for _, w in windows) or 1.0
    scale = (width - left - 80) / longest
    svg = [f"<svg width='{width}' height='{len(windows) * 40 + 10}' role='img' aria-label='step time split'>"]
    for i, (name, w) in enumerate(windows):
        y = 8 + i * 40
        svg.append(f"<text x='0' y='{y + 18}'>{name}</text>")
        x = float(left)
        other = max(0.0, w.step_time_s - w.wait_s - w.transfer_s - w.compute_s)
        for part, seconds in (("wait", w.wait_s), ("transfer", w.transfer_s), ("compute", w.compute_s),
                              ("other", other)):
            span = seconds * scale
            if span > 0:
                svg.append(f"<rect x='{x:.1f}' y='{y}' width='{span:.1f}' height='{bar}' fill='{COLOURS[part]}'>"
                           f"<title>{part}: {seconds * 1e3:.2f} ms</title></rect>")
                x += span
        svg.append(f"<text x='{x + 6:.1f}' y='{y + 18}'>{w.step_time_s * 1e3:.1f} ms</text>")
    svg.append("</svg>")
    legend = "".join(f"<span><i class='sw' style='background:{c}'></i>{k}</span>" for k, c in COLOURS.items())
    return "".join(svg) + f"<div class='legend'>{legend}</div>"


def _changes(report: Report) -> str:
    pairs = [(c.predicted_speedup, c.measured_speedup) for c in report.changes]
    rows = "".join(f"<li><b>{_e(c.knob)}</b>: {_e(c.before)} &rarr; {_e(c.after)} ({_e(c.reason)})"
                   f"{_e(checked(c)) if i == 0 or pairs[i] != pairs[i - 1] else ''}</li>"
                   for i, c in enumerate(report.changes))
    old = ", ".join(f"{c.knob}={c.before!r}" for c in report.changes)
    diff = "".join(f"<span class='del'>- DataLoader(..., {_e(old)})</span>\n<span class='add'>+ {_e(code)}</span>\n"
                   for code in report.suggestions)
    return f"<ul>{rows}</ul><pre>{diff}</pre>"


def _trials_chart(report: Report) -> str:
    rates = [t.samples_per_s or 0.0 for t in report.trials]
    top = max(rates) or 1.0
    width, left, bar = 900, 330, 18
    svg = [f"<svg width='{width}' height='{len(report.trials) * 26 + 10}' role='img' aria-label='trials'>"]
    for i, trial in enumerate(report.trials):
        y = 6 + i * 26
        label = ("before: " if i == 0 else f"{i}: ") + settings_text(trial.settings)
        svg.append(f"<text x='0' y='{y + 14}'>{_e(label)}</text>")
        if trial.samples_per_s is None:
            svg.append(f"<text x='{left}' y='{y + 14}' class='failed' fill='#b31d28'>failed</text>")
            continue
        span = trial.samples_per_s / top * (width - left - 110)
        colour = SERIES[0] if i else "#999999"
        svg.append(f"<rect x='{left}' y='{y}' width='{span:.1f}' height='{bar}' fill='{colour}'></rect>"
                   f"<text x='{left + span + 6:.1f}' y='{y + 14}'>{trial.samples_per_s:,.0f}/s</text>")
    svg.append("</svg>")
    return "".join(svg)


def _trials_table(report: Report) -> str:
    rows = ["<table><tr><th>#</th><th>settings</th><th>predicted samples/s</th><th>samples/s</th><th>data wait</th>"
            "<th>status</th></tr>"]
    for i, t in enumerate(report.trials):
        css = " class='failed'" if t.status == "failed" else ""
        rows.append(f"<tr{css}>" + "".join(f"<td>{_e(cell)}</td>" for cell in trial_cells(i, t)) + "</tr>")
    return "".join(rows) + "</table>"


def _timeline(report: Report) -> str:
    windows = report.timeline
    if len(windows) < 2:
        return "<p>Fewer than two windows were measured.</p>"
    charts = [_line_chart("samples/s", windows, [("samples/s", lambda w: w.samples_per_s or w.steps_per_s)])]
    charts.append(_line_chart("share of step time (%)", windows, [
        ("data wait", lambda w: 100 * w.data_wait_frac),
        ("accelerator busy", lambda w: 100 * w.busy_frac),
        ("GPU utilisation (NVML)", lambda w: w.resources.gpu_util_pct),
    ], y_max=100.0))
    charts.append(_line_chart("memory (GiB)", windows, [
        ("peak allocated (CUDA)", lambda w: _gib(w.resources.peak_mem_bytes)),
        ("used on device (NVML)", lambda w: _gib(w.resources.gpu_mem_used_bytes)),
    ]))
    return "".join(charts)


def _gib(value: int | None) -> float | None:
    return None if value is None else value / 2**30


def _line_chart(title: str, windows: Sequence[WindowStats], series: list, y_max: float | None = None) -> str:
    points = [(name, [(w.first_step + w.steps, get(w)) for w in windows]) for name, get in series]
    points = [(name, [(x, y) for x, y in pts if y is not None]) for name, pts in points]
    points = [(name, pts) for name, pts in points if pts]
    if not points:
        return f"<p><b>{_e(title)}</b>: not measured on this run (see GPU monitoring above).</p>"
    width, height, pad = 900, 180, 46
    xs = [x for _, pts in points for x, _ in pts]
    top = y_max or max(y for _, pts in points for _, y in pts) * 1.1 or 1.0
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (width - 2 * pad)

    def sy(y: float) -> float:
        return height - pad / 2 - y / top * (height - pad)

    svg = [f"<svg width='{width}' height='{height}' role='img' aria-label='{_e(title)}'>",
           f"<text x='{pad}' y='12'>{_e(title)} (x: optimizer step)</text>",
           f"<line x1='{pad}' y1='{sy(0):.1f}' x2='{width - pad}' y2='{sy(0):.1f}' stroke='#999'/>",
           f"<text x='2' y='{sy(top) + 10:.1f}'>{top:,.0f}</text><text x='2' y='{sy(0):.1f}'>0</text>"]
    legend = []
    for (name, pts), colour in zip(points, SERIES):
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        svg.append(f"<polyline points='{path}' fill='none' stroke='{colour}' stroke-width='2'/>")
        legend.append(f"<span><i class='sw' style='background:{colour}'></i>{_e(name)}</span>")
    svg.append("</svg>")
    return "".join(svg) + f"<div class='legend'>{''.join(legend)}</div>"


def _fit_section(report: Report, fit: FitAndCost) -> str:
    lines = memory_lines(fit)
    if fit.limit is not None:
        lines.append(f"Limit: {fit.limit} - {fit.limit_reason}")
    parts = ["<ul>" + "".join(f"<li>{_e(line)}</li>" for line in lines) + "</ul>", _memory_bar(fit)]
    parts.append("<ul>" + "".join(f"<li>{_e(line)}</li>" for line in time_lines(report, fit)) + "</ul>")
    if fit.fits_on:
        rows = ["<table><tr><th>memory</th><th>for example</th><th>+20 % buffer</th><th>+40 % buffer</th></tr>"]
        rows += [f"<tr><td>{row.memory_gib:g} GiB</td><td>{_e(row.examples)}</td>"
                 + "".join(f"<td>{_e(f.text())}</td>" for f in row.fits) + "</tr>" for row in fit.fits_on]
        parts.append("<p>Fits on (predicted from the counted memory; micro-batch x accumulation where it must "
                     "change):</p>" + "".join(rows) + "</table>")
    parts.append(f"<p>{_e(health_line(report.after or report.before, report.environment.gpu_monitoring))}</p>")
    if any(w.resources.gpu_util_pct is not None for w in report.timeline):
        parts.append(_line_chart("accelerator health", report.timeline, [
            ("utilisation (%)", lambda w: w.resources.gpu_util_pct),
            ("power (% of limit)", lambda w: _share(w.resources.gpu_power_w, w.resources.gpu_power_limit_w)),
            ("temperature (C)", lambda w: w.resources.gpu_temp_c),
            ("SM clock (% of the run's highest)", _clock_share(report.timeline)),
        ]))
    return "".join(parts)


def _share(part: float | None, whole: float | None) -> float | None:
    return None if part is None or not whole else 100 * part / whole


def _clock_share(windows: Sequence[WindowStats]) -> object:
    top = max((w.resources.gpu_sm_clock_mhz or 0.0 for w in windows), default=0.0)
    return lambda w: _share(w.resources.gpu_sm_clock_mhz, top)


def _memory_bar(fit: FitAndCost) -> str:
    m = fit.memory
    if m is None:
        return ""
    parts = [("parameters", m.params_bytes), ("gradients", m.grads_bytes), ("optimizer state", m.optimizer_bytes),
             ("activations", m.activations_bytes), ("batch", m.batch_bytes)]
    if fit.peak_bytes is not None and fit.peak_bytes > m.counted_bytes:
        parts.append(("allocator other", fit.peak_bytes - m.counted_bytes))
    total = sum(v or 0 for _, v in parts) or 1
    width, left, bar = 900, 10, 26
    svg = [f"<svg width='{width}' height='{bar + 30}' role='img' aria-label='memory breakdown'>"]
    x = float(left)
    for name, value in parts:
        span = (value or 0) / total * (width - 2 * left)
        if span > 0:
            svg.append(f"<rect x='{x:.1f}' y='4' width='{span:.1f}' height='{bar}' fill='{MEMORY_COLOURS[name]}'>"
                       f"<title>{name}: {size_text(value)}</title></rect>")
            x += span
    svg.append(f"<text x='{left}' y='{bar + 24}'>{size_text(total)} in all</text></svg>")
    legend = "".join(f"<span><i class='sw' style='background:{MEMORY_COLOURS[k]}'></i>{_e(k)} {size_text(v)}</span>"
                     for k, v in parts)
    return "".join(svg) + f"<div class='legend'>{legend}</div>"
