"""What tuning found, in the vocabulary every group shares (``report/`` turns findings into rows and text)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Change:
    """A knob pipeopt turned on the run, with the measured reason."""

    knob: str
    before: Any
    after: Any
    reason: str
    predicted_speedup: float | None = None  # what its trial window predicted, over the window before it
    measured_speedup: float | None = None  # what the window after the change measured, over the same


@dataclass
class Outcome:
    """What a group adds to the report: the knobs it turned, the code that keeps them, and notes."""

    changes: list[Change] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
