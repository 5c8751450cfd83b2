"""A finished report where the user sees it: the console table, and the JSON and HTML files."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from pipeopt._lightning import rank_zero_warn
from pipeopt.report.console import print_report
from pipeopt.report.html import write_html
from pipeopt.report.json_io import write_report
from pipeopt.report.model import Report


def publish(report: Report, *, console: Console | None, report_dir: Path | None) -> tuple[Path | None, Path | None]:
    """Print the report and write it to ``report_dir`` (None: no files); the JSON and HTML paths written. A failed
    write only warns: training results are unaffected."""
    print_report(report, console)
    if report_dir is None:
        return None, None
    try:
        json_path = write_report(report, report_dir)
        return json_path, write_html(report, json_path.with_suffix(".html"))
    except OSError as err:
        rank_zero_warn(f"PipeOpt could not write its report to {report_dir}: {err}. Training results are "
                       "unaffected; pass `report_dir=` a writable directory.")
        return None, None
