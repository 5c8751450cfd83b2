"""What tuning found, in the vocabulary every group shares (``report/`` turns findings into rows and text)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Change:
    """A knob pipeopt turned on the run, with the measured reason."""

    knob: str
    before: Any
    after: Any
    reason: str
