"""The before/after report as a rich table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pipeopt.measure.window import WindowStats
from pipeopt.report.fit import FitAndCost
from pipeopt.report.model import Report, SampleCacheFigures, Trial
from pipeopt.tuning.findings import Change

Row = tuple[str, Callable[[WindowStats], "float | None"], Callable[[float], str]]

_GB = 1024**3


def _pct(v: float) -> str:
    return f"{v:.0%}"


ROWS: tuple[Row, ...] = (
    ("samples/s", lambda w: w.samples_per_s, lambda v: f"{v:,.1f}"),
    ("steps/s", lambda w: w.steps_per_s, lambda v: f"{v:,.2f}"),
    ("step time", lambda w: w.step_time_s * 1e3, lambda v: f"{v:,.1f} ms"),
    ("data wait", lambda w: w.data_wait_frac, _pct),
    ("transfer", lambda w: w.transfer_frac, _pct),
    ("accelerator busy", lambda w: w.busy_frac, _pct),
    ("CPU main process", lambda w: w.resources.cpu_main_pct, lambda v: f"{v:.0f} %"),
    ("CPU loader workers", lambda w: w.resources.cpu_workers_pct, lambda v: f"{v:.0f} %"),
    ("peak device memory", lambda w: _gb(w.resources.peak_mem_bytes), lambda v: f"{v:.2f} GiB"),
    ("GPU utilisation", lambda w: w.resources.gpu_util_pct, lambda v: f"{v:.0f} %"),
    ("GPU memory used", lambda w: _gb(w.resources.gpu_mem_used_bytes), lambda v: f"{v:.2f} GiB"),
    ("GPU power", lambda w: w.resources.gpu_power_w, lambda v: f"{v:.0f} W"),
)


def _gb(v: int | None) -> float | None:
    return None if v is None else v / _GB


def _cell(window: WindowStats | None, get: Callable[[WindowStats], float | None], fmt: Callable[[float], str]) -> str:
    if window is None:
        return "-"
    value = get(window)
    return "n/a" if value is None else fmt(value)


def render(report: Report) -> Group:
    before, after = report.before, report.after
    title = f"pipeopt: {report.before_name} / after" if report.mode == "tune" else \
        "pipeopt: first / last window (observe only)"
    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("metric")
    table.add_column(_label(before, report.before_name), justify="right")
    table.add_column(_label(after, "after"), justify="right")
    table.add_column("change", justify="right")
    for label, get, fmt in ROWS:
        a = get(before) if before else None
        b = get(after) if after else None
        change = f"{b / a:.2f}x" if a and b and label in ("samples/s", "steps/s") else ""
        table.add_row(label, _cell(before, get, fmt), _cell(after, get, fmt), change)

    parts: list[RenderableType] = [table]
    if report.trials:
        parts.append(_trials_table(report))
    lines = _verdict_lines(report)
    for line in change_lines(report.changes):
        lines.append(f"{line}\n")
    for code in report.suggestions:
        lines.append(f"To keep it without pipeopt: {code}\n", style="bold")
    if report.mode == "observe":
        lines.append("Nothing was changed (observe only).\n")
    elif not report.changes:
        lines.append("Nothing was changed.\n")
    for skipped in report.skipped:
        lines.append(f"Skipped {skipped.group}: {skipped.reason}\n")
    for note in report.notes:
        lines.append(f"Note: {note}\n")
    env = report.environment
    lines.append(f"GPU monitoring: {env.gpu_monitoring}")
    if env.accelerator != "cuda":
        lines.append("; device memory: n/a (no CUDA allocator)")
    lines.append("\n")
    lines.append(
        f"{env.device_name} ({env.accelerator} x{env.device_count}, world size {env.world_size}), "
        f"{env.cpu_count} CPUs, torch {env.torch}, pipeopt {env.pipeopt}"
    )
    parts.append(Panel(lines, expand=False))
    if report.fit is not None:
        parts.append(fit_section(report, report.fit))
    if report.sample_cache is not None:
        parts.append(cache_panel(report.sample_cache))
    return Group(*parts)


def cache_panel(cache: SampleCacheFigures) -> Panel:
    return Panel("\n".join(cache_lines(cache)), title="Sample cache", title_align="left", expand=False)


def cache_lines(cache: SampleCacheFigures) -> list[str]:
    """The sample cache in words: what it holds, its size, what filling it cost, its trial, each epoch's hits."""
    lines = [f"Cached: {cache.cached}; {'kept: the run ended reading from it' if cache.kept else 'not kept'}",
             f"Stored {cache.stored:,} of {cache.length:,} items, {size_text(cache.bytes_used)} of a "
             f"{size_text(cache.budget_bytes)} budget, in {cache.directory}"]
    per = cache.fill_ms_per_sample
    lines.append(f"Fill cost: {cache.fill_s:.2f} s of CPU in all" + (f" ({per:.3f} ms an item to encode and write)"
                                                                       if per is not None else ""))
    if cache.trial_speedup is not None:
        lines.append(f"Best cached trial: {cache.trial_speedup:.2f}x the window before it")
    for row in cache.epochs:
        lines.append(f"Epoch {row['epoch']}: {row['samples']:,} samples, {row['misses']:,} made for the store, "
                     f"{_epoch_reads(row)}")
    return lines


def _epoch_reads(row: dict[str, Any]) -> str:
    """How an epoch used the store: read throughout (its hit rate), read in part, or not read - filled or not (a
    store already complete, or a cache not kept)."""
    if row["hit_rate"] is not None:
        return f"read from the store throughout: hit rate {row['hit_rate']:.1%}"
    if row.get("read"):
        return f"read from the store in part: settings that read it were in place for {row['read']:,} of its samples"
    return "not read from the store" + (" (filling it)" if row["misses"] else "")


def _trials_table(report: Report) -> Table:
    table = Table(title="loader trials (on the live run)", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("settings")
    table.add_column("predicted", justify="right")
    table.add_column("samples/s", justify="right")
    table.add_column("data wait", justify="right")
    table.add_column("status")
    for i, trial in enumerate(report.trials):
        table.add_row(*trial_cells(i, trial))
    return table


def trial_cells(i: int, trial: Trial) -> tuple[str, str, str, str, str, str]:
    """One trials-table row as text: number ("before" for the user's settings), settings, the loader model's
    predicted rate, the measured rate, wait, status."""
    predicted = "-" if trial.predicted_samples_per_s is None else f"{trial.predicted_samples_per_s:,.1f}"
    rate = "-" if trial.samples_per_s is None else f"{trial.samples_per_s:,.1f}"
    wait = "-" if trial.data_wait_frac is None else _pct(trial.data_wait_frac)
    status = trial.status if trial.error is None else f"{trial.status}: {trial.error}"
    return ("before" if i == 0 else str(i), settings_text(trial.settings), predicted, rate, wait, status)


def change_lines(changes: list[Change]) -> list[str]:
    """Each knob turned, from what, to what and why; a group's predicted and measured speedups once (its knobs share
    them)."""
    lines, shown = [], None
    for turned in changes:
        pair = (turned.predicted_speedup, turned.measured_speedup)
        lines.append(f"Changed {turned.knob}: {turned.before!r} -> {turned.after!r} ({turned.reason})"
                     f"{checked(turned) if pair != shown else ''}")
        shown = pair
    return lines


def checked(change: Change) -> str:
    """A change's predicted speedup beside the one measured after it, and how far off the prediction was."""
    p, m = change.predicted_speedup, change.measured_speedup
    if p is None or m is None or not m:
        return ""
    return f" [predicted {p:.2f}x, measured {m:.2f}x after the change: off by {abs(p - m) / m:.0%}]"


def _verdict_lines(report: Report) -> Text:
    """The verdict, its estimate, and the kept change's predicted and measured speedup."""
    lines = Text()
    if report.verdict:
        v = report.verdict
        lines.append(f"Verdict: {v.kind}", style="bold")
        lines.append(f" - {v.reason}.\n")
        lines.append(f"Estimated speedup if input were free: {v.input_free_speedup:.2f}x (from the "
                     f"{report.before_word} window)\n")
    else:
        lines.append("Verdict: not enough steps were measured for a window "
                     f"({report.steps_measured} steps seen).\n")
    for label, value, remark in speedups(report):
        lines.append(f"{label}: {value}{remark}\n")
    return lines


def speedups(report: Report) -> list[tuple[str, str, str]]:
    """The kept change's predicted and the measured speedup, as (label, value, remark) - the console's lines and the
    HTML page's. The measured one divides after by before, or by the first window, naming what that window ran."""
    rows = []
    if report.predicted_speedup is not None:
        rows.append(("Predicted speedup of the change (trial or loader model)", f"{report.predicted_speedup:.2f}x", ""))
    if report.measured_speedup is not None:
        basis = "after over before" if report.mode == "tune" else "last over first window"
        if report.mode == "tune" and report.before_ran is not None:
            basis = f"after over the first window, which ran {report.before_ran}"
        error = report.prediction_error
        off = f" (the prediction was off by {error:.0%})" if error is not None else ""
        rows.append((f"Measured speedup ({basis})", f"{report.measured_speedup:.2f}x", off))
    return rows


def _label(window: WindowStats | None, name: str) -> str:
    if window is None:
        return name
    return f"{name}\n(steps {window.first_step}-{window.first_step + window.steps - 1})"


def print_report(report: Report, console: Console | None = None) -> None:
    (console or Console()).print(render(report))


def settings_text(settings: dict[str, object]) -> str:
    """Loader settings in a few words: "4 workers, prefetch 2, persistent, pinned" or "DALI (cpu decoding)"."""
    if settings.get("dali"):
        return f"DALI ({settings['dali']} decoding)"
    workers = settings.get("num_workers")
    parts = [f"{workers} worker{'s' if workers != 1 else ''}" if workers else "main process"]
    if workers and settings.get("prefetch_factor") is not None:
        parts.append(f"prefetch {settings['prefetch_factor']}")
    if settings.get("persistent_workers"):
        parts.append("persistent")
    if settings.get("pin_memory"):
        parts.append("pinned")
    if settings.get("cache"):
        parts.append("sample cache")
    if workers and settings.get("give_way"):
        parts.append("giving way")
    parts += [f"{k}={v}" for k, v in settings.items()
              if k not in ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory", "cache", "give_way")
              and v is not None]
    return ", ".join(parts)


def size_text(n: float | None) -> str:
    """Bytes in binary units: "512 B", "8.0 KiB", "12.3 MiB", "1.20 GiB"."""
    if n is None:
        return "n/a"
    for unit, scale, digits in (("GiB", 1024**3, 2), ("MiB", 1024**2, 1), ("KiB", 1024, 1)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def memory_lines(fit: FitAndCost) -> list[str]:
    """The memory breakdown in words, one line per fact."""
    m = fit.memory
    if m is None:
        return [f"Memory: not counted ({fit.memory_note or 'no training step reached backward'})"]
    parts = [f"parameters {size_text(m.params_bytes)}", f"gradients {size_text(m.grads_bytes)}",
             f"optimizer state {size_text(m.optimizer_bytes)}",
             f"activations {size_text(m.activations_bytes)} ({size_text(m.per_sample_bytes)} a sample with its input)",
             f"batch {size_text(m.batch_bytes)}", f"total counted {size_text(m.counted_bytes)}"]
    lines = [f"Memory of one rank (counted on the run, micro-batch {m.micro_batch}, {m.precision}): "
             + ", ".join(parts)]
    if fit.peak_bytes is not None:
        lines.append(f"CUDA allocator: peak {size_text(fit.peak_bytes)}, reserved {size_text(fit.reserved_bytes)} "
                     f"of {size_text(fit.device_memory_bytes)} (budget {size_text(fit.budget_bytes)})")
    if m.hook_packed:
        lines.append(f"{m.hook_packed} saved tensor(s) packed by the program's own saved-tensor hooks (activation "
                     "checkpointing, offloading) are held by those hooks and not counted")
    if fit.memory_note:
        lines.append(f"Memory note: {fit.memory_note}")
    return lines


def health_line(window: WindowStats | None, status: str) -> str:
    """The accelerator's health over a window (NVML), or why it is not known."""
    r = window.resources if window is not None else None
    if r is None or r.gpu_util_pct is None:
        return f"Accelerator health: {status}"

    def pair(mean: float | None, p95: float | None, unit: str) -> str:
        return "n/a" if mean is None else f"{mean:.0f}{unit} (p95 {p95:.0f}{unit})" if p95 is not None else \
            f"{mean:.0f}{unit}"

    limit = f" of a {r.gpu_power_limit_w:.0f} W limit" if r.gpu_power_limit_w else ""
    return (f"Accelerator health ({window.label if window else ''} window): utilisation "
            f"{pair(r.gpu_util_pct, r.gpu_util_p95_pct, ' %')}, power {pair(r.gpu_power_w, r.gpu_power_p95_w, ' W')}"
            f"{limit}, temperature {pair(r.gpu_temp_c, r.gpu_temp_p95_c, ' C')}, SM clock "
            f"{pair(r.gpu_sm_clock_mhz, r.gpu_sm_clock_p95_mhz, ' MHz')}, clock events: "
            f"{r.gpu_throttle or 'none' if r.gpu_throttle is not None else 'n/a'}")


def time_lines(report: Report, fit: FitAndCost) -> list[str]:
    """The time (and cost) lines of ``report``'s ``fit``, its before window called as the report calls it."""
    t, before_name = fit.time, report.before_name

    def span(before: float | None, after: float | None, fmt: str, unit: str = "") -> str:
        pairs = ((before, before_name), (after, "after"))
        shown = [f"{format(v, fmt)}{unit} {when}" for v, when in pairs if v is not None]
        return " -> ".join(shown) or "n/a"

    lines = [f"Time per epoch ({t.steps_per_epoch} optimizer steps, at the {report.before_word} and "
             "after windows' measured pace): "
             f"{span(t.epoch_s_before, t.epoch_s_after, ',.1f', ' s')}" if t.steps_per_epoch else
             "Time per epoch: n/a (the epoch's length is not known)"]
    if t.planned_steps:
        whole_fit = span(t.fit_s_before, t.fit_s_after, ",.1f", " s")
        lines.append(f"Whole fit ({t.planned_steps} optimizer steps): {whole_fit}")
    if t.epochs_measured_s:
        shown = ", ".join(f"{s:,.1f}" for s in t.epochs_measured_s[:8])
        lines.append(f"Epochs run to their end, wall time: {shown}{' ...' if len(t.epochs_measured_s) > 8 else ''} s")
    if t.cost_per_hour is not None:
        per_epoch = span(t.epoch_cost_before, t.epoch_cost_after, ",.4g")
        whole = (f"; whole fit {span(t.fit_cost_before, t.fit_cost_after, ',.4g')}, saving {t.fit_saving:,.4g}"
                 if t.fit_saving is not None else "")
        lines.append(f"Cost at {t.cost_per_hour:g} an hour: per epoch {per_epoch}{whole}")
    return lines


def fit_section(report: Report, fit: FitAndCost) -> Panel:
    """The "Fit and cost" panel (``report.fit``): memory, what limits the run, accelerator health, which cards it
    fits, time, cost."""
    lines = memory_lines(fit)
    if fit.limit is not None:
        lines.append(f"Limit: {fit.limit} - {fit.limit_reason}")
    lines.append(health_line(report.after or report.before, report.environment.gpu_monitoring))
    lines += time_lines(report, fit)
    parts: list[RenderableType] = [Text("\n".join(lines))]
    if fit.fits_on:
        table = Table(title="fits on (predicted from the counted memory; micro-batch x accumulation where it must "
                            "change)", title_justify="left")
        for column in ("memory", "for example", "+20 % buffer", "+40 % buffer"):
            table.add_column(column, justify="left" if column == "for example" else "right")
        for row in fit.fits_on:
            table.add_row(f"{row.memory_gib:g} GiB", row.examples, *(f.text() for f in row.fits))
        parts.append(table)
    return Panel(Group(*parts), title="Fit and cost", title_align="left", expand=False)
