"""Loader tuning on the live run, start to finish: before-window, trials, choice, after-window, keep or revert.

Every trial step is a real training step on the user's data in the user's order; only the loader's worker
settings differ. Decisions are made between steps (``on_step_end``), never inside a fetch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pipeopt.measure.window import WindowStats
from pipeopt.report.model import Change, Trial as ReportTrial
from pipeopt.tuning.loader_search import Budget, LoaderSearch, LoaderSettings, Trial
from pipeopt.tuning.noise import DEFAULT_FLOOR, Rate, faster


class Switcher(Protocol):
    user_settings: LoaderSettings
    current: LoaderSettings
    failed: BaseException | None

    def switch(self, settings: LoaderSettings, *, timeout_s: float | None = None) -> None: ...

    def settle(self) -> None: ...

    def restore_user(self) -> None: ...


def _in_flight(settings: LoaderSettings) -> int:
    """Batches a loader with these settings may hold when replaced (delivered before the new one's)."""
    return settings.num_workers * (settings.prefetch_factor or 0) + 1


class LoaderSession:
    def __init__(
        self,
        switcher: Switcher,
        *,
        budget: Budget,
        budget_s: float,
        reset_meter: Callable[[str, int, int], None],
        clock: Callable[[], float],
        say: Callable[[str], None] = lambda line: None,
        worker_memory: Callable[[], int | None] = lambda: None,
        floor: float = DEFAULT_FLOOR,
        min_trial_timeout_s: float = 10.0,
    ) -> None:
        self._switcher = switcher
        self._budget = budget
        self._budget_s = budget_s
        self._reset_meter = reset_meter
        self._clock = clock
        self._say = say
        self._worker_memory = worker_memory
        self._floor = floor
        self._min_timeout = min_trial_timeout_s
        self.state = "before"
        self._pending: WindowStats | None = None
        self._search: LoaderSearch | None = None
        self._trial: LoaderSettings | None = None
        self._started: float | None = None
        self._afters: list[WindowStats] = []
        self.before: WindowStats | None = None
        self.after: WindowStats | None = None
        self.chosen: Trial | None = None
        self.changes: list[Change] = []
        self.notes: list[str] = []
        self.suggestion: str | None = None

    # -- events ---------------------------------------------------------------------------------------------
    def on_window(self, stats: WindowStats) -> None:
        self._pending = stats

    def on_step_end(self) -> None:
        if self.state == "trial" and self._switcher.failed is not None:
            err, self._switcher.failed = self._switcher.failed, None
            self._trial_failed(err)
            return
        if self._pending is None or self.state == "done":
            return
        stats, self._pending = self._pending, None
        {"before": self._on_before, "trial": self._on_trial, "after": self._on_after}[self.state](stats)

    # -- phases ---------------------------------------------------------------------------------------------
    def _on_before(self, stats: WindowStats) -> None:
        self.before = stats
        baseline = self._trial_of(self._switcher.user_settings, stats)
        self._search = LoaderSearch(baseline, self._budget, floor=self._floor)
        self._started = self._clock()
        self._next_trial()

    def _on_trial(self, stats: WindowStats) -> None:
        search = self._search
        if search is None or self._trial is None:
            raise RuntimeError("pipeopt: a trial window arrived without a trial")
        trial = self._trial_of(self._trial, stats)
        search.record(trial)
        self._say(f"trial {len(search.trials) - 1}: {trial.settings.describe()} -> "
                  f"{trial.rate.value:,.1f} samples/s, data wait {trial.data_wait_frac:.0%}")  # type: ignore[union-attr]
        self._next_trial()

    def _trial_failed(self, err: BaseException) -> None:
        if self._search is None or self._trial is None:
            raise RuntimeError("pipeopt: a trial failure arrived without a trial") from err
        self._search.record(Trial(self._trial, None, error=f"{type(err).__name__}: {err}".splitlines()[0]))
        self._say(f"trial {len(self._search.trials) - 1}: {self._trial.describe()} failed ({err}); "
                  f"continuing with {self._switcher.current.describe()}")
        self._pending = None
        self._next_trial()

    def _next_trial(self) -> None:
        search = self._search
        if search is None:
            return
        over_budget = self._started is not None and self._clock() - self._started > self._budget_s
        candidate = None if over_budget else search.propose()
        if over_budget:
            self.notes.append(f"the tuning budget ({self._budget_s:g} s) ran out; chose among the trials so far")
        if candidate is not None:
            self._apply(candidate, label="trial", timeout_s=self._trial_timeout())
            self._trial = candidate
            self.state = "trial"
            return
        self._choose()

    def _choose(self) -> None:
        search = self._search
        if search is None:
            return
        if search.stop_reason:
            self.notes.append(f"loader search stopped: {search.stop_reason}")
        self.chosen = search.choice()
        user = self._switcher.user_settings
        if self.chosen.settings == user:
            if self._switcher.current != user:
                self._apply(user, label="user settings", timeout_s=None)
            self._switcher.settle()
            self.notes.append(f"kept your loader settings ({user.describe()}): no trial was faster beyond noise")
            self.state = "done"
            return
        if self._switcher.current != self.chosen.settings:
            self._apply(self.chosen.settings, label="after", timeout_s=None)
        else:
            self._reset_meter("after", 0, 2 * _in_flight(self.chosen.settings))
        self._switcher.settle()
        self.state = "after"

    def _on_after(self, stats: WindowStats) -> None:
        self._afters.append(stats)
        before = Rate.of(self.before)  # type: ignore[arg-type]
        after = Rate.pooled(self._afters)
        self.after = stats
        if faster(after, before, self._floor):
            self._keep()
            return
        if len(self._afters) < 2:  # within noise: measure once more before giving up
            self._reset_meter("after", 0, 2 * _in_flight(self._switcher.current))
            return
        reverted_from = self._switcher.current
        self._switcher.restore_user()
        self._reset_meter("reverted", _in_flight(reverted_from) + 1, 0)
        self.notes.append(
            f"reverted to your loader settings: after the change {after.value:,.1f} samples/s against "
            f"{before.value:,.1f} before - not faster beyond noise"
        )
        self.state = "done"

    def _keep(self) -> None:
        chosen = self.chosen
        if chosen is None or self.before is None:
            raise RuntimeError("pipeopt: nothing was chosen to keep")
        user = self._switcher.user_settings
        trial_rate = chosen.rate.value if chosen.rate else float("nan")
        before_rate = Rate.of(self.before).value
        for knob, old in user.as_kwargs().items():
            new = getattr(chosen.settings, knob)
            if new == old:
                continue
            if knob == "persistent_workers":
                reason = "workers would otherwise restart at every remaining epoch boundary"
            elif knob == "prefetch_factor" and user.num_workers == 0:
                reason = "comes with worker processes (torch's default)"
            else:
                reason = (f"{before_rate:,.1f} -> {trial_rate:,.1f} samples/s in its trial; the cheapest setting "
                          "within noise of the fastest")
            self.changes.append(Change(knob, old, new, reason))
        args = ", ".join(f"{c.knob}={c.after!r}" for c in self.changes)
        self.suggestion = f"DataLoader(..., {args})"
        self.state = "done"

    # -- helpers --------------------------------------------------------------------------------------------
    def _apply(self, settings: LoaderSettings, *, label: str, timeout_s: float | None) -> None:
        """Switch, then skip the old loader's in-flight batches and the new loader's first queue-full (prefetched
        while the old one drained, it would flatter the new setting), and measure a window at least twice that
        queue long, so the queue's state at either end of the window moves the rate by little."""
        previous = self._switcher.current
        self._switcher.switch(settings, timeout_s=timeout_s)
        self._reset_meter(f"{label}: {settings.describe()}", _in_flight(previous) + _in_flight(settings),
                          2 * _in_flight(settings))

    def _trial_timeout(self) -> float:
        step = self.before.step_time_s if self.before else 0.0
        return max(self._min_timeout, 20.0 * step)

    def _trial_of(self, settings: LoaderSettings, stats: WindowStats) -> Trial:
        res = stats.resources
        return Trial(
            settings=settings,
            rate=Rate.of(stats),
            data_wait_frac=stats.data_wait_frac,
            transfer_frac=stats.transfer_frac,
            cpu_main_pct=res.cpu_main_pct,
            cpu_workers_pct=res.cpu_workers_pct,
            worker_mem_bytes=self._worker_memory() if settings.num_workers else None,
        )

    # -- for the report -------------------------------------------------------------------------------------
    @property
    def predicted_speedup(self) -> float | None:
        if self.chosen is None or self.chosen.rate is None or self.before is None or not self.changes:
            return None
        return self.chosen.rate.value / Rate.of(self.before).value

    def report_trials(self) -> list[ReportTrial]:
        if self._search is None:
            return []
        out = []
        for trial in self._search.trials:
            out.append(ReportTrial(
                settings=trial.settings.as_kwargs(),
                samples_per_s=trial.rate.value if trial.rate else None,
                data_wait_frac=trial.data_wait_frac,
                status="ok" if trial.ok else "failed",
                error=trial.error,
            ))
        return out
