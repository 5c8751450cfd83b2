"""Tuning's findings as report rows and as the code that keeps them without pipeopt."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pipeopt.report.model import Trial as TrialRow
from pipeopt.tuning.findings import Change
from pipeopt.tuning.loader_search import Trial
from pipeopt.tuning.session import LoaderSession


def trial_rows(trials: Sequence[Trial]) -> list[TrialRow]:
    """The loader search's trials, one report row each."""
    return [TrialRow(settings=t.settings.as_kwargs(), samples_per_s=t.rate.value if t.rate else None,
                     data_wait_frac=t.data_wait_frac, status="ok" if t.ok else "failed", error=t.error,
                     predicted_samples_per_s=t.predicted)
            for t in trials]


def predicted_speedup(session: LoaderSession) -> float | None:
    """The kept change's trial rate over the before-window's (None when nothing changed); for workers added for
    the model's headroom (``LoaderSearch.with_headroom``), the model's rate for them."""
    chosen, before = session.chosen, session.before_rate
    if chosen is None or chosen.rate is None or before is None or not session.changes:
        return None
    rate = chosen.predicted if chosen.headroom_from is not None and chosen.predicted else chosen.rate.value
    return rate / before.value


def loader_changes(session: LoaderSession) -> list[Change]:
    """The loader's changes, each with the kept setting's speedup as its trial predicted it and as its after-window
    measured it (over the before-window)."""
    before, after = session.before_rate, session.after_rate
    measured = after / before.value if before is not None and after is not None and before.value else None
    predicted = predicted_speedup(session)
    return [dataclasses.replace(c, predicted_speedup=predicted, measured_speedup=measured) for c in session.changes]


def loader_suggestion(changes: Sequence[Change]) -> str | None:
    """The code that keeps the loader changes without pipeopt (None: nothing changed)."""
    if not changes:
        return None
    if changes[0].knob == "dali":
        return f"pipeopt.dali.loader_from(train_loader, device={changes[0].after!r})"
    return "DataLoader(..., " + ", ".join(f"{c.knob}={c.after!r}" for c in changes) + ")"
