"""Reports as JSON files (schema: report/schema.json, documented in docs/report.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeopt.files import write_atomic
from pipeopt.report.model import Report

#: JSON Schema of a report file (draft 2020-12).
SCHEMA_PATH = Path(__file__).with_name("schema.json")


def report_filename(report: Report) -> str:
    stamp = report.created.replace(":", "").replace("-", "").replace("+0000", "Z")
    return f"pipeopt-{stamp}-{os.getpid()}.json"


def write_report(report: Report, directory: Path) -> Path:
    """Write ``report`` into ``directory`` atomically (a reader never sees half a file). Raises ``OSError``."""
    return write_atomic(directory / report_filename(report),
                        json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n")


def read_report(path: str | os.PathLike[str]) -> Report:
    with open(path, encoding="utf-8") as handle:
        return Report.from_dict(json.load(handle))
