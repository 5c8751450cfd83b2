"""The report dataclass. Everything in it was measured; ``to_dict`` is the JSON schema (report/schema.json)."""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeopt.measure.window import WindowStats
from pipeopt.report.fit import FitAndCost
from pipeopt.tuning.findings import Change
from pipeopt.verdict import Verdict

SCHEMA_VERSION = 5
#: Older versions ``from_dict`` still reads (they have no "fit" section before 3, no "sample_cache" before 4, no
#: "before_ran" before 5: their "before" was the user's settings, or unmarked).
READABLE_VERSIONS = (1, 2, 3, 4, 5)
MAX_TIMELINE = 512


@dataclass(frozen=True)
class Trial:
    """One candidate configuration tried on the live run."""

    settings: dict[str, Any]
    samples_per_s: float | None
    data_wait_frac: float | None
    status: str  # "ok" | "failed"
    error: str | None = None
    predicted_samples_per_s: float | None = None  # the loader model's prediction when the trial was proposed


@dataclass(frozen=True)
class Skipped:
    """A knob group that was asked for but not tuned, and why."""

    group: str
    reason: str


@dataclass(frozen=True)
class Environment:
    accelerator: str
    device_name: str
    device_count: int
    world_size: int
    cpu_count: int
    python: str
    torch: str
    lightning: dict[str, str]
    pipeopt: str
    gpu_monitoring: str


def _speedup(before: WindowStats | None, after: WindowStats | None) -> float | None:
    if before is None or after is None:
        return None
    if before.samples_per_s and after.samples_per_s:
        return after.samples_per_s / before.samples_per_s
    return after.steps_per_s / before.steps_per_s


@dataclass
class SampleCacheFigures:
    """The sample cache of a fit: what it holds, what filling it cost, how often an epoch found its samples there.
    ``epochs``: one row an epoch - ``epoch``, ``reading`` (the loader read from the store from its start to its
    end), ``samples`` trained, ``read`` (of them, those trained while settings that read the store were in place: a
    trial's, a filler's that reads what the store holds, or kept ones; absent in reports written before it was
    counted), ``misses`` (samples made because the store did not have them) and ``hit_rate`` (None unless
    reading)."""

    cached: str  # what of each item is cached
    directory: str
    kept: bool  # the run ended reading from it
    stored: int
    length: int
    bytes_used: int
    budget_bytes: int
    fill_s: float  # CPU time encoding and writing the stored items cost, summed over the processes that filled it
    trial_speedup: float | None  # the best cached trial over the window before it
    epochs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fill_ms_per_sample(self) -> float | None:
        return 1000.0 * self.fill_s / self.stored if self.stored else None


def thin(windows: list[WindowStats], limit: int = MAX_TIMELINE) -> list[WindowStats]:
    """At most ``limit`` windows, evenly spread, always keeping the first and the last."""
    if len(windows) <= limit:
        return list(windows)
    step = (len(windows) - 1) / (limit - 1)
    return [windows[round(i * step)] for i in range(limit)]


@dataclass
class Report:
    """Before/after figures of one fit. In observe mode ``before`` is the first window and ``after`` the last.
    ``before_ran``: None when ``before`` measured the user's own settings; else what it ran instead - a loader
    configuration an earlier run kept (the tuning cache's, or the checkpoint's a resumed fit applies), in force from
    the fit's first step, so no window of the user's settings exists and "before" is only the first window."""

    mode: str  # "observe" | "tune"
    environment: Environment
    before: WindowStats | None = None
    after: WindowStats | None = None
    verdict: Verdict | None = None
    changes: list[Change] = field(default_factory=list)
    trials: list[Trial] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)  # code the user can paste to keep the changes
    predicted_speedup: float | None = None  # a tuner's prediction for the change it kept (from its trial); else None
    timeline: list[WindowStats] = field(default_factory=list)
    steps_measured: int = 0
    fit: FitAndCost | None = None  # memory breakdown, the cards it fits, what limits it, time and cost
    sample_cache: SampleCacheFigures | None = None
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    before_ran: str | None = None

    @property
    def before_name(self) -> str:
        """What the "before" figures are called where they are shown: "before", or "first window"."""
        return "before" if self.before_ran is None else "first window"

    @property
    def before_word(self) -> str:
        """``before_name`` before the word "window": "before", or "first"."""
        return "before" if self.before_ran is None else "first"

    @property
    def measured_speedup(self) -> float | None:
        return _speedup(self.before, self.after)

    @property
    def prediction_error(self) -> float | None:
        """How far the kept change's predicted speedup was from the after-window's: |predicted - measured| /
        measured (None without both, or where ``before`` is not the window the prediction was made over)."""
        measured, predicted = self.measured_speedup, self.predicted_speedup
        if self.before_ran is not None or measured is None or predicted is None or not measured:
            return None
        return abs(predicted - measured) / measured

    def to_dict(self) -> dict[str, Any]:
        timeline = thin(self.timeline)
        fit = self.fit.to_dict() if self.fit else None
        if fit is not None:  # the limits of the windows the timeline keeps
            kept = {w.index for w in timeline}
            fit["window_limits"] = [pair for pair in fit["window_limits"] if pair[0] in kept]
        return {
            "schema_version": SCHEMA_VERSION,
            "created": self.created,
            "mode": self.mode,
            "environment": asdict(self.environment),
            "before": self.before.to_dict() if self.before else None,
            "before_ran": self.before_ran,
            "after": self.after.to_dict() if self.after else None,
            "verdict": self.verdict.to_dict() if self.verdict else None,
            "predicted_speedup": self.predicted_speedup,
            "measured_speedup": self.measured_speedup,
            "prediction_error": self.prediction_error,
            "changes": [asdict(c) for c in self.changes],
            "trials": [asdict(t) for t in self.trials],
            "skipped": [asdict(s) for s in self.skipped],
            "notes": list(self.notes),
            "suggestions": list(self.suggestions),
            "steps_measured": self.steps_measured,
            "timeline": [w.to_dict() for w in timeline],
            "fit": fit,
            "sample_cache": asdict(self.sample_cache) if self.sample_cache else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        if not isinstance(data, dict):
            raise ValueError(f"a report is a JSON object, not a {type(data).__name__}")
        version = data.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise ValueError(f"report schema_version {version!r} is not supported; expected one of {READABLE_VERSIONS}")
        if version == 1:  # one `predicted_speedup` meant the change's prediction, or the verdict's estimate
            verdict = data["verdict"] and {**data["verdict"]}
            if verdict:
                verdict["input_free_speedup"] = verdict.pop("predicted_speedup")
            predicted = data["predicted_speedup"] if data["changes"] else None
            data = {**data, "verdict": verdict, "predicted_speedup": predicted}

        def window(d: dict[str, Any] | None) -> WindowStats | None:
            return WindowStats.from_dict(d) if d else None

        return cls(
            mode=data["mode"],
            environment=Environment(**data["environment"]),
            before=window(data["before"]),
            before_ran=data.get("before_ran"),
            after=window(data["after"]),
            verdict=Verdict(**data["verdict"]) if data["verdict"] else None,
            changes=[Change(**c) for c in data["changes"]],
            trials=[Trial(**t) for t in data["trials"]],
            skipped=[Skipped(**s) for s in data["skipped"]],
            notes=list(data["notes"]),
            suggestions=list(data["suggestions"]),
            predicted_speedup=data["predicted_speedup"],
            timeline=[WindowStats.from_dict(w) for w in data["timeline"]],
            steps_measured=data["steps_measured"],
            fit=FitAndCost.from_dict(data["fit"]) if data.get("fit") else None,
            sample_cache=SampleCacheFigures(**data["sample_cache"]) if data.get("sample_cache") else None,
            created=data["created"],
        )
