"""The before/after report as a rich table."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pipeopt.measure.window import WindowStats
from pipeopt.report.model import Report, Trial

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
    title = "pipeopt: before / after" if report.mode == "tune" else "pipeopt: first / last window (observe only)"
    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("metric")
    table.add_column(_label(before, "before"), justify="right")
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
    lines = Text()
    if report.verdict:
        v = report.verdict
        lines.append(f"Verdict: {v.kind}", style="bold")
        lines.append(f" - {v.reason}.\n")
        lines.append(f"Estimated speedup if input were free: {v.input_free_speedup:.2f}x (from the before window)\n")
    else:
        lines.append("Verdict: not enough steps were measured for a window "
                     f"({report.steps_measured} steps seen).\n")
    if report.predicted_speedup is not None:
        lines.append(f"Predicted speedup of the change (from its trial): {report.predicted_speedup:.2f}x\n")
    if report.measured_speedup is not None:
        what = "after over before" if report.mode == "tune" else "last over first window"
        lines.append(f"Measured speedup ({what}): {report.measured_speedup:.2f}x\n")
    for turned in report.changes:
        lines.append(f"Changed {turned.knob}: {turned.before!r} -> {turned.after!r} ({turned.reason})\n")
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
    return Group(*parts)


def _trials_table(report: Report) -> Table:
    table = Table(title="loader trials (on the live run)", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("settings")
    table.add_column("samples/s", justify="right")
    table.add_column("data wait", justify="right")
    table.add_column("status")
    for i, trial in enumerate(report.trials):
        table.add_row(*trial_cells(i, trial))
    return table


def trial_cells(i: int, trial: Trial) -> tuple[str, str, str, str, str]:
    """One trials-table row as text: number ("before" for the user's settings), settings, rate, wait, status."""
    rate = "-" if trial.samples_per_s is None else f"{trial.samples_per_s:,.1f}"
    wait = "-" if trial.data_wait_frac is None else _pct(trial.data_wait_frac)
    status = trial.status if trial.error is None else f"{trial.status}: {trial.error}"
    return ("before" if i == 0 else str(i), settings_text(trial.settings), rate, wait, status)


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
    parts += [f"{k}={v}" for k, v in settings.items()
              if k not in ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory") and v is not None]
    return ", ".join(parts)
