"""One fit's findings put together as its report: which windows are "before" and "after", the changes in the order
a reader follows them (precision, the loader, the batch plan), the notes and the suggested code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeopt.measure.window import WindowStats
from pipeopt.report.findings import loader_changes, loader_suggestion, predicted_speedup, trial_rows
from pipeopt.report.model import Environment, Report, Skipped
from pipeopt.tuning.findings import Outcome
from pipeopt.tuning.session import LoaderSession, started_from
from pipeopt.verdict import judge


def assemble(*, windows: Sequence[WindowStats], environment: Environment, skipped: Sequence[Skipped],
             steps_measured: int, dropped_partial: int, session: LoaderSession | None, current_loader: str | None,
             precision: Outcome | None, batch: Outcome | None, after_from: int | None,
             cache: Outcome | None = None, cache_after: WindowStats | None = None) -> Report:
    """The report of a fit. ``after_from``: the windows measured before the last group's decision (the next one is
    after every change); ``current_loader``: the settings the run ended with; ``cache_after``: the sample cache's
    after-window, measured after every change when the cache was kept (it decides last)."""
    notes = _measurement_notes(windows, dropped_partial)
    before, after, extra = _loader_part(windows, session, current_loader, notes)
    changed = any(o is not None and o.changes for o in (precision, batch))
    if changed and after_from is not None and len(windows) > after_from:
        after = windows[after_from]  # measured after every change, the batch plan's and precision's included
    for outcome, first in ((precision, True), (batch, False)):  # precision reads first, the batch plan last
        if outcome is None:
            continue
        for key, items in (("changes", outcome.changes), ("suggestions", outcome.suggestions)):
            extra[key] = [*items, *extra.get(key, [])] if first else [*extra.get(key, []), *items]
        notes.extend(outcome.notes)
    if cache is not None:  # decided last: its rows after the others
        extra["changes"] = [*extra.get("changes", []), *cache.changes]
        loader_code = loader_suggestion(session.changes) if session is not None else None
        if cache.changes and loader_code is not None:  # a plain DataLoader keeps the loader's part, not the store
            extra["suggestions"] = [f"{code} (the loader settings alone: the sample cache needs pipeopt)"
                                    if code == loader_code else code for code in extra.get("suggestions", [])]
        notes.extend(cache.notes)
        if cache.changes and cache_after is not None:
            after = cache_after
    tuned = session is not None or precision is not None or batch is not None or cache is not None
    return Report(mode="tune" if tuned else "observe", environment=environment, before=before, after=after,
                  verdict=judge(before) if before else None, skipped=list(skipped), notes=notes,
                  timeline=list(windows), steps_measured=steps_measured, **extra)


def _measurement_notes(windows: Sequence[WindowStats], dropped_partial: int) -> list[str]:
    notes = []
    if dropped_partial:
        notes.append(f"{dropped_partial} accumulation group(s) cut short by validation or an epoch end were not "
                     "measured")
    if windows and all(w.wait_s == 0.0 for w in windows):
        notes.append("no data fetch was timed: this Lightning version or a custom data fetcher hides the train "
                     "loader's `next()`; data wait shows 0")
    return notes


def _loader_part(windows: Sequence[WindowStats], session: LoaderSession | None, current_loader: str | None,
                 notes: list[str]) -> tuple[WindowStats | None, WindowStats | None, dict[str, Any]]:
    """The before and after windows as the loader session saw them, and its rows."""
    first = windows[0] if windows else None
    last = windows[-1] if len(windows) > 1 else None
    if session is None:
        return first, last, {}
    before, after = session.before, session.after
    before_ran = None
    if before is None:  # applied from a checkpoint or the cache: no window of the user's settings exists
        before, after = first, last
        started = started_from(session)
        if before is not None and started is not None:  # the first window ran an earlier run's settings
            origin = "an earlier run of this fit cached" if session.from_cache else "the run this one resumes kept"
            before_ran = (f"the loader settings {origin} ({started.describe()}), in force from the first step: your "
                          "own settings were not measured on this run")
    elif after is None and session.state == "done" and windows and windows[-1] is not before:
        after = windows[-1]  # nothing changed: the run's last window, measured after tuning ended
    if session.state != "done" and session.before is not None:
        best = session.search.choice() if session.search is not None else None
        verified = (f"; the best setting a window measured: {best.settings.describe()} "
                    f"({best.rate.value:,.1f} samples/s)" if best is not None and best.rate is not None else "")
        notes.append(f"the fit ended before loader tuning finished (it was in its {session.state} phase); the run "
                     f"ended with {current_loader}{verified}")
    notes.extend(session.notes)
    suggestion = loader_suggestion(session.changes)
    trials = session.search.trials if session.search is not None else []
    return before, after, dict(before_ran=before_ran, changes=loader_changes(session), trials=trial_rows(trials),
                               suggestions=[suggestion] if suggestion else [],
                               predicted_speedup=predicted_speedup(session))
