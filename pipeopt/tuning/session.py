"""Loader tuning on the live run, start to finish: before-window, trials, choice, after-window, keep or revert.

Every trial step is a real training step on the user's data in the user's order; only the loader's worker
settings differ. Decisions are made between steps (``on_step_end``), never inside a fetch, and only when a window
closes - at the same step on every rank. There each rank's figures are agreed (``agree``: an element-wise
maximum across ranks; the slowest rank's rate, the largest wait, any failure, any rank over budget), so every
rank runs the same search on the same numbers and applies the same settings at the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from pipeopt.measure.window import WindowStats
from pipeopt.tuning import noise
from pipeopt.tuning.agreement import ANY, MAX, MIN, ReduceMax, agree, agreed
from pipeopt.tuning.findings import Change
from pipeopt.tuning.loader_search import Budget, LoaderSearch, LoaderSettings, Trial
from pipeopt.tuning.noise import DEFAULT_FLOOR, Rate, combine, faster, measured


class Switcher(Protocol):
    user_settings: LoaderSettings
    current: LoaderSettings
    fallback: LoaderSettings

    def take_failure(self) -> BaseException | None: ...

    def switch(self, settings: LoaderSettings, *, timeout_s: float | None = None, take_back: bool = False) -> None: ...

    def settle(self) -> None: ...

    def restore_user(self) -> None: ...


#: A cached configuration verifies when its measured rate reaches the cached one within this share (one window, or
#: two when the first falls short: a shared machine's windows vary, and re-tuning costs far more than a few percent).
VERIFY_TOLERANCE = 0.20


@dataclass(frozen=True)
class Agreed:
    """One window's figures as all ranks agree on them: the slowest rate, the largest wait and use, any failure."""

    samples_per_s: float = agreed(MIN)
    rel_se: float = agreed(MAX)
    step_time_s: float = agreed(MAX)
    data_wait_frac: float = agreed(MAX)
    transfer_frac: float = agreed(MAX)
    cpu_main_pct: float | None = agreed(MAX)
    cpu_workers_pct: float | None = agreed(MAX)
    worker_mem_bytes: int | None = agreed(MAX)
    failed: bool = agreed(ANY)
    over_budget: bool = agreed(ANY)
    store_cold: bool = agreed(ANY, default=True)  # a rank's sample store does not hold an epoch yet (or has none)
    load_cpu_s: float | None = agreed(MAX, default=None)  # CPU seconds a sample costs to load (``cpu_per_sample``)
    step_cpu_s: float | None = agreed(MAX, default=None)  # ... and the step: the process's CPU outside the fetch
    supply_wait_frac: float | None = agreed(MAX, default=None)  # the wait with no batch ready (``window_supply_wait``)
    beside: bool = agreed(ANY, default=False)  # work of pipeopt's ran beside the window on a rank (a sample backfill)
    read_in: int | None = agreed(MAX, default=None)  # steps until the store is read (``cache_start.steps_to_read``)

    @classmethod
    def of(cls, stats: WindowStats, settings: LoaderSettings, mem: int | None, failed: bool,
           over_budget: bool, store_cold: bool = True, beside: bool = False, read_in: int | None = None) -> Agreed:
        """This rank's figures for a window measured under ``settings`` (``beside``: with work of pipeopt's beside it
        on this rank)."""
        rate, wait, res = noise.window_rate(stats, settings), noise.window_wait(stats, settings), stats.resources
        load_cpu, step_cpu = cpu_per_sample(stats, settings)
        return cls(rate.value, rate.rel_se, stats.step_time_s, wait, stats.transfer_frac,
                   res.cpu_main_pct, res.cpu_workers_pct, mem, failed, over_budget, store_cold, load_cpu, step_cpu,
                   noise.window_supply_wait(stats, settings), beside, read_in)

    @property
    def rate(self) -> Rate:
        return Rate(self.samples_per_s, self.rel_se)


def cpu_per_sample(stats: WindowStats, settings: LoaderSettings) -> tuple[float | None, float | None]:
    """CPU seconds per sample (None where not measured): what loading a sample costs - the training thread's CPU
    inside the fetch when it loads (no workers), the workers' CPU when they do - and the training process's CPU
    outside the fetch (the step's share, intra-op threads included). Not the process's CPU while it waits: its
    intra-op threads spin then, which reads as load it is not."""
    if not stats.samples or settings.dali:
        return None, None
    per_step = stats.steps / stats.samples
    step_cpu = stats.step_cpu_s * per_step
    if settings.num_workers == 0:
        return stats.fetch_cpu_s * per_step, step_cpu
    workers_pct, rate = stats.resources.cpu_workers_pct, stats.samples_per_s
    return (None if workers_pct is None or not rate else workers_pct / 100.0 / rate), step_cpu


class Phase(str, Enum):
    """Where the session is: measuring the user's settings, a trial, the chosen settings (after), a cached
    configuration (verify), or done. A ``str`` enum: ``session.state == "done"`` reads as before."""

    BEFORE = "before"
    TRIAL = "trial"
    AFTER = "after"
    VERIFY = "verify"
    DONE = "done"


@dataclass
class TrialWindows:
    """How the session's windows are cut: ``reset_meter(label, skip, steps, blocks)`` starts one. A trial's
    window holds at least ``window`` steps, its loader's queue, and ``min_window_s`` at the last measured pace (a
    shared machine's second-to-second wobble averages out; a trial close to the best costs little); with epochs
    that short, whole epochs, so each window holds as many epoch starts."""

    reset_meter: Callable[[str, int, int, int], None]
    window: int = 20
    min_window_s: float = 0.0
    epoch_steps: int | None = None
    last_step_s: float | None = None
    last_rate: float | None = None  # samples/s of the last window, whose steps took ``last_step_s``
    predicted: Callable[[LoaderSettings], float | None] = lambda settings: None  # the loader model's rate
    steps_left: Callable[[], int | None] = lambda: None  # optimizer steps the fit has left (None: unbounded)
    horizon: int | None = None  # ... or fewer, within which windows end (agreed: ``LoaderSession``, a sample store)

    def left(self) -> int | None:
        """The steps left for windows: the fit's, or the ``horizon`` where it comes first."""
        fit = self.steps_left()
        return self.horizon if fit is None or (self.horizon is not None and self.horizon < fit) else fit

    def measure(self, label: str, skip: int, settings: LoaderSettings | None = None) -> None:
        """Skip ``skip`` steps, then measure windows shaped for ``settings`` (None: the default window). A window
        paced in seconds takes at most a third of the steps the fit has left after the skip (a trial and two
        after-windows; never under ``window`` steps): where a trial ran much faster than the window before it, its
        after-window - ``min_window_s`` at the new pace - could otherwise outlast the fit and verify nothing."""
        if settings is None:
            self.reset_meter(label, skip, 0, 5)
            return
        self.reset_meter(label, skip, *self._sized(settings, skip))

    def measure_parts(self, label: str, skip: int, settings: LoaderSettings, parts: int, *,
                      even: bool = False) -> tuple[int, int, int]:
        """``measure``'s window for ``settings`` cut into up to ``parts`` windows, so that it can be judged before its
        end: the first of ``window`` steps, the fewest a window holds (a trial far slower than what it must beat
        costs that much), the rest of the window in equal parts of at least ``window`` steps - or, ``even``, every
        part of the same length, at least ``window`` steps (a first look that already spans a share of the window's
        seconds); together as many steps as the window (fewer than a step more a part). A window too short for two
        parts, or of whole epochs, is one. The first part is measured now, the rest by ``measure_part``. The first
        part's steps, each later part's, and how many parts in all."""
        length, blocks = self._sized(settings, skip)
        if even:
            count = 1 if blocks != 5 else max(1, min(parts, length // self.window))
            first = later = -(-length // count)
        else:
            rest = length - self.window
            count = 1 if blocks != 5 or rest < self.window else 1 + min(parts - 1, rest // self.window)
            first, later = (length, 0) if count == 1 else (self.window, -(-rest // (count - 1)))
        self.reset_meter(label, skip, first, blocks)
        return first, later, count

    def measure_part(self, label: str, steps: int) -> None:
        """The next part of a window cut by ``measure_parts``: ``steps`` more, at once."""
        self.reset_meter(label, 0, steps, 5)

    def _sized(self, settings: LoaderSettings, skip: int) -> tuple[int, int]:
        return self._cut(settings, skip, self.left())

    def _cut(self, settings: LoaderSettings, skip: int, left: int | None) -> tuple[int, int]:
        """``_shape`` cut to a third of the ``left`` steps after ``skip`` (None: an unbounded fit, not cut)."""
        length, blocks = self._shape(settings)
        if left is not None and blocks == 5:  # (whole-epoch windows are sized by epochs, not seconds)
            length = max(self.window, settings.in_flight, min(length, (left - skip) // 3))
        return length, blocks

    def trial_steps(self, applied: LoaderSettings, candidate: LoaderSettings,
                    tried: Iterable[LoaderSettings] = ()) -> int:
        """Optimizer steps a trial of ``candidate`` and the after-windows that may follow it take, ``applied`` being
        in place: both loaders' in-flight batches skipped and a window shaped for the candidate; then, for whichever
        is chosen - the candidate or a setting ``tried`` before it - the switch back to it (both loaders'
        in-flight batches again) and two windows shaped for it (the second when the first is too close to call).
        Each window as ``measure`` will cut it, from the steps left then: where the fit is bounded, a window paced in
        seconds is shortened to fit rather than the trial refused."""
        left = self.left()
        skip = applied.in_flight + candidate.in_flight
        trial = skip + self._cut(candidate, skip, left)[0]

        def after(chosen: LoaderSettings) -> int:
            switch = 0 if chosen == candidate else candidate.in_flight + chosen.in_flight
            rest = None if left is None else left - trial
            first = self._cut(chosen, switch, rest)[0]
            return switch + first + self._cut(chosen, 0, None if rest is None else rest - switch - first)[0]

        return trial + max(after(chosen) for chosen in (candidate, *tried))

    def short_of(self, applied: LoaderSettings, candidate: LoaderSettings,
                 tried: Iterable[LoaderSettings] = ()) -> tuple[int, int] | None:
        """(steps left, steps needed) where the fit has too few for a trial of ``candidate`` and its after-windows
        (``trial_steps``); None where it has room (an unbounded fit always has)."""
        left, need = self.left(), self.trial_steps(applied, candidate, tried)
        return (left, need) if left is not None and left < need else None

    def _step_s(self, settings: LoaderSettings) -> float | None:
        """The step time to size a window by: the last window's, or shorter where the loader model predicts a
        faster rate for ``settings`` (a trial of a much faster setting would otherwise get a window far shorter
        than ``min_window_s``)."""
        last, expected = self.last_step_s, self.predicted(settings)
        if last and self.last_rate and expected and expected > self.last_rate:
            return last * self.last_rate / expected
        return last

    def _shape(self, settings: LoaderSettings) -> tuple[int, int]:
        step_s = self._step_s(settings)
        paced = int(self.min_window_s / step_s) if step_s else 0
        length = max(self.window, settings.in_flight, paced)
        epoch = self.epoch_steps
        if epoch and epoch <= length:
            epochs = max(2, -(-length // epoch))
            return epochs * epoch, epochs
        return length, 5


def settled(rates: list[Rate]) -> Rate | None:
    """Windows of one setting measured one after another: the first one's rate, or the first two's combined (the
    second is measured only when the first is too close to call); None before any."""
    return combine(*rates[:2]) if len(rates) > 1 else (rates[0] if rates else None)


def after_verdict(rates: list[Rate], before: Rate | None, floor: float) -> str:
    """A change's after-windows so far (``rates``) against the window before it (None: nothing to beat): "kept"
    when their rate (``settled``) is faster beyond noise, else "again" (one more window) after the first and "not"
    after the second."""
    after = settled(rates)
    if before is None or (after is not None and faster(after, before, floor)):
        return "kept"
    return "again" if len(rates) < 2 else "not"


def not_faster(after: Rate, before: Rate) -> str:
    """Why a change whose after-windows read ``after`` was not kept."""
    return f"after the change {after.value:,.1f} samples/s against {before.value:,.1f} before - not faster beyond noise"


@dataclass
class CachedCheck:
    """A configuration cached by an earlier run of this fit, checked against the rate it had then: it verifies when
    one window's rate - or two windows' pooled, when the first falls short - reaches ``expected`` within
    ``VERIFY_TOLERANCE``."""

    settings: LoaderSettings
    expected: Rate
    rates: list[Rate] = field(default_factory=list)
    failed: bool = False

    def judge(self, rate: Rate | None) -> str:
        """After a window that measured ``rate`` (None: it failed): "verified", "again" (one more window) or
        "failed"."""
        self.failed = rate is None
        if rate is not None:
            self.rates.append(rate)
        measured = self.measured
        if measured is not None and not faster(self.expected, measured, VERIFY_TOLERANCE):
            return "verified"
        return "again" if rate is not None and len(self.rates) < 2 else "failed"

    @property
    def measured(self) -> Rate | None:
        return settled(self.rates)

    @property
    def shortfall(self) -> str:
        measured = self.measured
        if self.failed or measured is None:
            return "its workers failed"
        return f"{measured.value:,.1f} samples/s against {self.expected.value:,.1f} when cached"

    def __str__(self) -> str:
        measured = self.measured
        return f"{measured.value if measured else float('nan'):,.1f} samples/s, {self.expected.value:,.1f} when cached"


class LoaderSession:
    """The loader search on the live run: a window of the user's settings, trials the search proposes, the chosen
    settings confirmed by an after-window (or the user's restored) - or a cached configuration verified."""

    def __init__(self, switcher: Switcher, *, budget: Budget, budget_s: float, windows: TrialWindows,
                 clock: Callable[[], float], say: Callable[[str], None] = lambda line: None,
                 worker_memory: Callable[[], int | None] = lambda: None, agree: ReduceMax = lambda values: values,
                 floor: float = DEFAULT_FLOOR, min_trial_timeout_s: float = 10.0) -> None:
        self._switcher, self._budget, self._budget_s, self._windows = switcher, budget, budget_s, windows
        self._clock, self._say, self._worker_memory, self._agree = clock, say, worker_memory, agree
        self._floor, self._min_timeout = floor, min_trial_timeout_s
        self.state = Phase.BEFORE
        self._pending: WindowStats | None = None
        self.search: LoaderSearch | None = None
        self._trial: LoaderSettings | None = None
        self._started: float | None = None
        self._after_rates: list[Rate] = []
        self.before_rate: Rate | None = None  # the agreed rate of the before-window
        self._failure: BaseException | None = None
        # What this session put in place, the same on every rank (the switcher's differs where a trial failed)
        self._applied: LoaderSettings = switcher.user_settings
        self.before: WindowStats | None = None
        self.after: WindowStats | None = None
        self.chosen: Trial | None = None
        self.changes, self.notes = list[Change](), list[str]()
        self.from_cache = False
        self._cached: CachedCheck | None = None
        self.store_warm: Callable[[], bool] = lambda: False  # the sample cache's store holds an epoch (this rank)
        self.store_warm_agreed = False  # ... on every rank: the search stops (the cache may remove the work)
        self.store_read_in: Callable[[], int | None] = lambda: None  # steps until the store is read (``_no_room``)
        self.measured: list[tuple[LoaderSettings, Rate, float, float]] = []  # every window: settings, rate, s, wait

    def on_window(self, stats: WindowStats) -> None:
        self._pending = stats

    def on_step_end(self) -> None:
        failure = self._switcher.take_failure()
        if failure is not None:  # a loader failed and was replaced; judged when the window closes
            self._failure = failure
            if self.state is Phase.DONE:
                self.notes.append(f"after tuning, the loader's workers failed ({first_line(self._failure)}); "
                                  f"the run continued with {self._switcher.current.describe()}")
                self._failure = None
        if self._pending is None or self.state is Phase.DONE:
            return
        stats, self._pending = self._pending, None
        over_budget = self._elapsed() > self._budget_s
        mem = self._worker_memory() if self._switcher.current.num_workers else None
        agreed = agree(Agreed.of(stats, self._applied, mem, self._failure is not None, over_budget,
                                 not self.store_warm(), read_in=self.store_read_in()), self._agree)
        self.store_warm_agreed, self._windows.horizon = not agreed.store_cold, agreed.read_in
        if not agreed.failed:
            self.measured.append((self._applied, agreed.rate, agreed.step_time_s * stats.steps, agreed.data_wait_frac))
        failure, self._failure = self._failure, None
        self._windows.last_step_s, self._windows.last_rate = agreed.step_time_s, agreed.samples_per_s
        handle = {Phase.BEFORE: self._on_before, Phase.TRIAL: self._on_trial, Phase.AFTER: self._on_after,
                  Phase.VERIFY: self._on_verify}[self.state]
        handle(stats, agreed, failure)

    def _on_before(self, stats: WindowStats, agreed: Agreed, failure: BaseException | None) -> None:
        self.before, self.before_rate = stats, agreed.rate
        baseline = _trial_of(self._switcher.user_settings, agreed)
        self.search = LoaderSearch(baseline, self._budget, floor=self._floor)
        self._windows.predicted = self.search.predictions.get  # trials are sized at their predicted pace
        self._started = self._clock()
        self._next_trial()

    def _on_trial(self, stats: WindowStats, agreed: Agreed, failure: BaseException | None) -> None:
        search = self.search
        if search is None or self._trial is None:
            raise RuntimeError("pipeopt: a trial window arrived without a trial")
        if agreed.failed:
            error = first_line(failure) if failure is not None else "a loader worker failed on another rank"
            search.record(Trial(self._trial, None, error=error))
            self._say(f"trial {len(search.trials) - 1}: {self._trial.describe()} failed ({error}); "
                      f"continuing with {self._switcher.fallback.describe()}")
        else:
            search.record(_trial_of(self._trial, agreed))
            self._say(f"{_trial_line(search, self._trial)} [{self._elapsed():.1f} of {self._budget_s:g} s budget]")
        if agreed.over_budget:
            self.notes.append(f"the tuning budget ({self._budget_s:g} s) ran out; chose among the trials so far")
            self._choose()
        else:
            self._next_trial()

    def _next_trial(self) -> None:
        search = self.search
        if search is None:
            return
        if self.store_warm_agreed and len(search.trials) > 1:  # the cache may remove the work more workers share
            search.stop_reason = "the sample cache's store holds an epoch: reading from it is tried (last)"
            return self._choose()
        candidate = search.propose()
        crowded = None if candidate is None else _no_room(candidate, self._applied, self._windows, search.trials,
                                                          self._switcher.user_settings)
        if crowded:  # a trial the fit cannot finish measures nothing: choose now
            self.notes.append(crowded)
            candidate = None
        if candidate is not None:
            if candidate == self._trial:  # a repeat: keep the loader, measure another window
                self._windows.measure(f"trial (repeat): {candidate.describe()}", 0, candidate)
            elif candidate == self._switcher.user_settings:  # a close call: the user's own loader, measured again
                self._back_to_user("your settings, measured again")
            else:
                step_s = self.before.step_time_s if self.before else 0.0  # a trial's timeout: 20 steps before
                self._apply(candidate, label="trial", timeout_s=max(self._min_timeout, 20.0 * step_s))
            self._trial = candidate
            self.state = Phase.TRIAL
            return
        self._choose()

    def _choose(self) -> None:
        search = self.search
        if search is None:
            return
        self.notes.extend(search.summary())
        self.chosen, self.before_rate = search.with_headroom(search.choice()), search.baseline.rate  # pooled if again
        user = self._switcher.user_settings
        if self.chosen.settings == user:
            self._back_to_user("your settings")
            self._switcher.settle()
            self.notes.append(f"kept your loader settings ({user.describe()}): no trial was faster beyond noise")
            self.state = Phase.DONE
            return
        self._say(f"chose {self.chosen.settings.describe()}; measuring it against the before-window")
        if self._applied != self.chosen.settings:
            self._apply(self.chosen.settings, label="after", timeout_s=None)
        else:
            self._windows.measure("after", 0, self.chosen.settings)
        self._switcher.settle()
        self.state = Phase.AFTER

    def _on_after(self, stats: WindowStats, agreed: Agreed, failure: BaseException | None) -> None:
        self.after = stats
        if agreed.failed:
            self._revert(f"the chosen loader's workers failed in the after-window "
                         f"({first_line(failure) if failure else 'on another rank'})")
            return
        self._after_rates.append(agreed.rate)
        verdict = after_verdict(self._after_rates, self.before_rate, self._floor)
        if verdict == "kept":
            self._keep()
        elif verdict == "again":  # within noise: measure once more before giving up
            self._windows.measure("after", 0, self._applied)
        else:
            self._revert(not_faster(measured(settled(self._after_rates)), measured(self.before_rate)))

    def _revert(self, why: str) -> None:
        self._back_to_user("reverted")
        self.notes.append(f"reverted to your loader settings: {why}")
        self._say(f"reverted to your loader settings: {why}")
        self.state = Phase.DONE

    def _keep(self) -> None:
        chosen = self.chosen
        if chosen is None or self.before is None:
            raise RuntimeError("pipeopt: nothing was chosen to keep")
        self._set_changes(chosen.settings, _kept_reasons(self._switcher.user_settings, self.before_rate, chosen))
        self._say(f"kept {chosen.settings.describe()}")
        self.state = Phase.DONE

    def _back_to_user(self, label: str) -> bool:
        """Back to the user's settings (and own loader from the next epoch); False when they were in place."""
        reverted_from, user = self._applied, self._switcher.user_settings
        if reverted_from == user:
            return False
        self._switcher.restore_user()
        self._applied = user
        self._windows.measure(label, reverted_from.in_flight + user.in_flight)
        return True

    def _apply(self, settings: LoaderSettings, *, label: str, timeout_s: float | None) -> None:
        """Switch, skip both loaders' in-flight batches, measure a window shaped for ``settings`` (``TrialWindows``;
        a stock of ready batches the window draws down is taken out of its rate: ``WindowStats.sustained_per_s``)."""
        previous, self._applied = self._applied, settings
        self._switcher.switch(settings, timeout_s=timeout_s)
        self._windows.measure(f"{label}: {settings.describe()}", previous.in_flight + settings.in_flight, settings)

    def _elapsed(self) -> float:
        return 0.0 if self._started is None else self._clock() - self._started

    def finish(self) -> None:  # the fit ended mid-trial: a failure already seen is still recorded
        failure, self._failure = self._failure or self._switcher.take_failure(), None
        if self.state is Phase.TRIAL and failure is not None and self.search is not None and self._trial is not None:
            self.search.record(Trial(self._trial, None, error=first_line(failure)))

    def verify_cached(self, settings: LoaderSettings | None, expected_rate: float) -> None:
        """Apply a configuration cached by an earlier run and check it with one window against the rate it had
        then; only if it falls short is the run tuned afresh."""
        user = self._switcher.user_settings
        self.from_cache, self._cached = True, CachedCheck(settings or user, Rate(expected_rate, 0.0))
        self.chosen = Trial(settings or user, None)
        if settings is not None and settings != user:
            self._apply(settings, label="cached", timeout_s=None)
            self._switcher.settle()
        else:
            self._windows.measure("cached: your settings", 0)
        self.state = Phase.VERIFY

    def _on_verify(self, stats: WindowStats, agreed: Agreed, failure: BaseException | None) -> None:
        self.after = stats
        check = self._cached
        if check is None:
            raise RuntimeError("pipeopt: a cached configuration's window arrived without one")
        verdict = check.judge(None if agreed.failed else agreed.rate)
        if verdict == "again":
            self._windows.measure("cached (again)", 0, self._applied)
            return
        if verdict == "verified":
            self._set_changes(check.settings, f"cached by an earlier run of this fit; verified on this run ({check})")
            self.notes.append("applied the cached loader configuration: no trials")
            self.state = Phase.DONE
            return
        self.notes.append(f"the cached loader configuration did not verify ({check.shortfall}); tuned afresh")
        self.from_cache, self.chosen, self._cached = False, None, None
        if not self._back_to_user("before"):
            self._windows.measure("before", 0)
        self.state = Phase.BEFORE

    def _set_changes(self, settings: LoaderSettings, reason: str | Callable[[str], str]) -> None:
        self.changes = _changes(self._switcher.user_settings, settings, reason)

    def restore(self, settings: LoaderSettings | None) -> None:
        """Resume: apply the settings an earlier run of this fit kept (None: it kept the user's), without trials."""
        user = self._switcher.user_settings
        self.state = Phase.DONE
        if settings is None or settings == user:
            self.notes.append("resumed from a checkpoint whose tuning kept your loader settings; no trials")
            return
        self._switcher.switch(settings)
        self._switcher.settle()
        self._applied = settings
        self._windows.measure("restored", user.in_flight + settings.in_flight)
        self.chosen = Trial(settings, None)
        self._set_changes(settings, "kept by the run this one resumes (from its checkpoint)")
        self.notes.append("resumed from a checkpoint: applied its tuned loader settings without trials")

    @property
    def after_rate(self) -> float | None:
        """The agreed rate of the last after-window (what a cache entry expects of its configuration)."""
        return self._after_rates[-1].value if self._after_rates else None

    @property
    def kept(self) -> LoaderSettings | None:
        """The settings tuning kept (None: the user's), once it is done."""
        return self.chosen.settings if self.state is Phase.DONE and self.changes and self.chosen else None


def started_from(session: LoaderSession) -> LoaderSettings | None:
    """The settings an earlier run kept (the tuning cache's, or the checkpoint's a resumed fit applies) that ran from
    the fit's start in place of the user's, so no window measured the user's; None where theirs ran first."""
    chosen = session.chosen.settings if session.chosen is not None and session.before is None else None
    return None if chosen == session._switcher.user_settings else chosen


def _no_room(candidate: LoaderSettings, applied: LoaderSettings, windows: TrialWindows, trials: list[Trial],
             user: LoaderSettings) -> str | None:
    """Why the fit has no room for a trial of ``candidate`` and the after-windows of whichever of it and the
    settings measured in ``trials`` is chosen (None: it has room, or the fit is unbounded). The user's settings,
    chosen, need no after-window. Nor before a sample cache's store of whole items is read (the windows'
    ``horizon``: ``cache_start.steps_to_read``): a window running into that epoch, at a decoding loader's pace, would
    put off the cached trials, which may take every sample's work away."""
    short = windows.short_of(applied, candidate, [t.settings for t in trials if t.ok and t.settings != user])
    if short is None:
        return None
    left = (f"the sample cache's store is read in {short[0]} optimizer steps (the next epoch, less the steps making "
            "what it misses)" if short[0] == windows.horizon else f"the fit has {short[0]} optimizer steps left")
    return (f"{left}: too few for another trial ({candidate.describe()}) and its after-windows ({short[1]}); chose "
            "among the trials so far")


def _trial_line(search: LoaderSearch, settings: LoaderSettings) -> str:
    """The trial of ``settings`` (the last, or the user's measured again) in one line: its settings, the rate it
    measured (and the model's prediction), its wait."""
    index = max(i for i, t in enumerate(search.trials) if t.settings == settings)
    trial = search.trials[index]
    again = f" (pooled over {trial.repeats} windows)" if trial.repeats > 1 else ""
    predicted = f" (predicted {trial.predicted:,.1f})" if trial.predicted is not None else ""
    starved = trial.supply_wait_frac
    ready = (f" ({starved:.0%} with no batch ready)" if starved is not None and trial.settings.num_workers
             and trial.data_wait_frac is not None and trial.data_wait_frac - starved >= 0.01 else "")
    return (f"trial {index}: {trial.settings.describe()} -> {measured(trial.rate).value:,.1f} "
            f"samples/s{again}{predicted}, data wait {trial.data_wait_frac:.0%}{ready}")


def _trial_of(settings: LoaderSettings, agreed: Agreed) -> Trial:
    return Trial(settings=settings, rate=agreed.rate, data_wait_frac=agreed.data_wait_frac,
                 transfer_frac=agreed.transfer_frac, cpu_main_pct=agreed.cpu_main_pct,
                 cpu_workers_pct=agreed.cpu_workers_pct, worker_mem_bytes=agreed.worker_mem_bytes,
                 load_cpu_s=agreed.load_cpu_s, step_cpu_s=agreed.step_cpu_s,
                 supply_wait_frac=agreed.supply_wait_frac)


def _changes(user: LoaderSettings, settings: LoaderSettings, reason: str | Callable[[str], str]) -> list[Change]:
    """The knobs where ``settings`` differ from the user's, each with its reason."""
    why = reason if callable(reason) else (lambda knob: reason)
    if settings.dali:  # DALI replaces the DataLoader: its worker knobs no longer apply
        return [Change("dali", None, settings.dali, why("dali"))]
    return [Change(knob, old, getattr(settings, knob), why(knob))
            for knob, old in user.as_kwargs().items() if getattr(settings, knob) != old]


def _kept_reasons(user: LoaderSettings, before: Rate | None, chosen: Trial) -> Callable[[str], str]:
    """Why each knob of a kept change was turned, from the measured rates."""
    trial_rate = chosen.rate.value if chosen.rate else float("nan")
    before_rate = before.value if before else float("nan")
    measured_gain = f"{before_rate:,.1f} -> {trial_rate:,.1f} samples/s in its trial"

    def reason(knob: str) -> str:
        if knob == "dali":
            return f"{measured_gain}; faster than every DataLoader setting tried, beyond noise"
        if knob == "persistent_workers":
            return "workers would otherwise restart at every remaining epoch boundary"
        if knob == "prefetch_factor" and user.num_workers == 0:
            return "comes with worker processes (torch's default)"
        if knob == "num_workers" and chosen.headroom_from is not None:
            return (f"{before_rate:,.1f} -> {trial_rate:,.1f} samples/s with {chosen.headroom_from} in their trial, "
                    f"the cheapest no other trial beat beyond noise; {chosen.settings.num_workers} give their supply "
                    f"the loader model's headroom over the step (predicted {chosen.predicted or 0:,.1f})")
        if knob == "num_workers" and chosen.climbed_from is not None:
            return (f"{measured_gain}; the fewest workers within the noise floor of the fastest, where more workers "
                    f"than {chosen.climbed_from} (the cheapest no other trial beat beyond noise) read faster by more "
                    "than the floor")
        return f"{measured_gain}; the cheapest setting no other trial beat beyond noise"

    return reason


def first_line(err: BaseException | None) -> str:
    """An error in one line: its first, and - for errors re-raised from a worker, whose message is a
    traceback - the original exception on its last."""
    if err is None:
        return ""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    text = f"{type(err).__name__}: {lines[0] if lines else ''}"
    return f"{text} ... {lines[-1]}" if len(lines) > 1 else text
