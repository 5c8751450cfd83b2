"""The sample cache on the live run: a candidate like any loader setting, measured once the store is warm.

Every DataLoader pipeopt builds fills the store as a side effect of loading (``apply.sample_cache``). Once the other
groups are done, this session makes sure the loader in place is one of those (the same settings), then waits - on
every rank - until the store holds the samples an epoch needs (``warm``: what it still misses made ahead, too; the
windows measured beside that work on any rank are not ``quiet`` and are not pooled, so that every rank pools the
same windows) - asked at each window's end, at each epoch's end and at the first step end of each epoch, so that an
epoch whose start finds the store complete reads it from its first batch on, instead of one batch of the loader in
place (which may be one of slow storage) and a window of the slow settings (one whose start finds what the store
misses being made ahead, past the epoch that made it, fills reading what it holds: ``_Cold``). Then, on the live
run:

1. a window of the settings in place (``before``), not reading from the store: the last windows measured of them -
   by the loader search, then while waiting (filling it) - pooled until they span a trial's length, so the warm
   epoch is not spent on one more window of the slow settings. When they span less, the cached trials go first,
   judged against all of them pooled, and a window of its own is measured after the trials only when none of them
   was clearly faster (``WindowBefore``); when there are none, before the trials. Under DALI (whose loader does not
   fill the store: a DataLoader does, reading the samples stored already - it is not the window before) only the
   loader search's windows of DALI count, and DALI comes back for a window of its own where the settings in place
   would. Nothing is tried when the loop waited for data under 5 % of its steps there
   (taking that away could not beat the noise floor) - pooled windows that say so are confirmed by a window measured
   now (the host may have run the step slower while they were measured); the user's own settings under 10 % (the
   loader search's before-window) skip the whole session (``begin``);
2. under DALI on the CPU, where DALI can be fed the stored images (``dali_reads``: decoded, a random step still to
   come), first a trial of DALI reading the store - no decode left (``first_trial``); then, as below, unless the loop
   no longer waits;
   a trial reading from the store with the same workers (at most ``max_workers``, one per CPU where the store is in
   memory: what is left per sample is CPU work then; workers beyond the CPUs hid a latency the store removed;
   ``capped``) - giving way to the training process (below its CPU priority: ``apply.loader.GiveWay``), as every
   cached trial's workers do until the last: with little left to do per sample, they take the CPU time the step
   leaves, where at the usual priority, on oversubscribed CPUs, the step's intra-op threads wait out their time
   slices (measured: the same cached workers read 1.2-1.5x faster giving way, ``benchmarks/results/README.md``; the
   fit may have room for one cached trial only);
3. a trial reading from the store in the main process alone (no workers: the cache may have removed all the work
   they were there for, and worker processes cost CPU and IPC); when the cache paid but the main process alone is
   slower beyond noise, trials halving the workers while each keeps pace with the best cached trial (at most
   three). Where the store holds whole items (``alone_first``: nothing left to do per sample but read it), the
   main process alone is tried first - and alone, when the loop then waits for data less than a compute-bound
   run does (workers could only share a wait that is no longer there), or the training process left fewer CPUs
   idle than its loading kept busy (``cpu_room``: workers could only take CPU time from the step). Last, the
   cached setting that would be chosen, where it has workers, once more at the usual priority (kept at a tie:
   nothing changes that need not).
   A switch to a cached setting (a trial, the choice) takes back what the loader in place dispatched and did not
   deliver (``Handover.take_back``): the new loader makes it from the store, instead of the old one at its pace
   (slow storage: hundreds of batches in flight).
   Each cached trial's window is measured in parts (``TRIAL_PARTS``), the first as short as a window may be; a
   trial whose parts so far are slower beyond noise than ``before`` or another cached trial stops there: it could
   not be chosen, and on a window sized at the pace of the trial before it (``TrialWindows``), a slow trial's
   remaining parts would only cost the fit time;
4. the choice - only when a cached trial beat ``before`` beyond noise: the cheapest cached setting (fewest workers,
   then workers not giving way) no other cached trial beats beyond noise, confirmed by an after-window against
   ``before`` (once more when too close to call); otherwise the settings in place stay. The after-window is
   measured in even parts (``AFTER_PARTS``) and ends at the first whose parts so far are clearly faster than
   ``before`` (twice the gap ``faster`` asks: ``noise.clearly_faster``) - on a fast step the window, a trial's
   length at the new pace, would otherwise hold a second or two of epochs to confirm a gain its first third shows.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

from pipeopt.measure.window import WindowStats
from pipeopt.tuning.agreement import ANY, MAX, ReduceMax, agree, agreed
from pipeopt.tuning.findings import Change, Outcome
from pipeopt.tuning.loader_search import COMPUTE_BOUND_WAIT, INPUT_SOLVED_WAIT, LoaderSettings
from pipeopt.tuning.noise import DEFAULT_FLOOR, Rate, clearly_faster, faster, measured
from pipeopt.tuning.session import Agreed, Switcher, TrialWindows, after_verdict, first_line, not_faster, settled

#: At most this many trials between the workers in place and the main process alone.
MAX_FEWER = 3
#: A cached trial's window is measured in up to this many parts, judged at the end of each (``CacheSession``).
TRIAL_PARTS = 5
#: An after-window is measured in up to this many even parts; it ends at the first whose parts so far are clearly
#: faster than the window before (``noise.clearly_faster``).
AFTER_PARTS = 3


class CachePhase(str, Enum):
    WAIT = "wait"
    BEFORE = "before"
    TRIAL = "trial"
    AFTER = "after"
    DONE = "done"


@dataclass(frozen=True)
class CacheTrial:
    settings: LoaderSettings
    rate: Rate | None  # None: its loader failed
    data_wait_frac: float | None = None
    error: str | None = None
    stopped: str | None = None  # why it stopped before its window's end (``PartedTrial``)
    cpu_room: float | None = None  # CPUs left for workers to load beside the step (``cpu_room``; None: not known)

    def describe(self) -> str:
        return (f"cache trial: {self.settings.describe()} -> "
                + (f"{self.rate.value:,.1f} samples/s" if self.rate else f"failed ({self.error})"))


@dataclass(frozen=True)
class _Cold:
    """At an epoch's first step while waiting. Past the epoch that made the store (on every rank), while what it
    misses is made ahead (on any), the filling loader reads what the store holds and makes only the rest: making
    it all again would take the CPUs from that work, which the trials wait for (on 2 CPUs, 832 samples took 6 s
    beside a loader decoding every sample). Its windows read from the store: none is pooled into the window
    before."""

    cold: bool = agreed(ANY)  # a rank's store may not be read yet
    making: bool = agreed(ANY, default=False)  # a rank is still in the epoch that made its store
    ahead: bool = agreed(ANY, default=False)  # a rank is making what its store misses (``apply.backfill``)


@dataclass(frozen=True)
class _ToWarm:
    """The steps left in the epoch that made the store, the most over the ranks: it is read from the next one. A node's
    store may be warm already (kept by an earlier run) where another's was made in this epoch."""

    steps: int = agreed(MAX)


class CacheSession:
    """Fed windows (``on_window``) and step ends (``on_step_end``) once ``begin()`` was called."""

    def __init__(self, switcher: Switcher, *, windows: TrialWindows, warm: Callable[[], bool],
                 fills: Callable[[], bool], agree: ReduceMax = lambda v: v, floor: float = DEFAULT_FLOOR,
                 say: Callable[[str], None] = lambda _: None, prepare: Callable[[], str | None] = lambda: None,
                 alone_first: bool = False, to_warm: Callable[[], int] = lambda: 0, max_workers: int | None = None,
                 quiet: Callable[[], bool] = lambda: True, making_ahead: Callable[[], bool] = lambda: False,
                 dali_reads: bool = False) -> None:
        self._switcher, self._windows, self.warm, self._fills = switcher, windows, warm, fills
        # ``quiet``: nothing of pipeopt's ran beside the settings in place in the window just ended, on this rank
        self._quiet, self._alone_first, self._max_workers = quiet, alone_first, max_workers
        # ``making_ahead``: what the store misses is being made (``apply.backfill``), on this rank
        self._making_ahead, self._dali_reads = making_ahead, dali_reads
        self._prepare: Callable[[], str | None] | None = prepare
        self.refused: str | None = None  # why the dataset may not be cached (found when first prepared)
        self._agree, self._floor, self._say, self._to_warm = agree, floor, say, to_warm  # (the steps left: windows')
        self.state, self.started, self._epoch_began = CachePhase.WAIT, False, False
        self.baseline = self._cached_base = self._applied = switcher.current  # (cached: under DALI, the filler)
        self._pending: WindowStats | None = None
        self._trial: PartedTrial | None = None  # the trial in place
        self._window_before = WindowBefore()  # the windows of the settings in place, the window before's makings
        self._failure: BaseException | None = None
        self.before: Rate | None = None
        self.after: WindowStats | None = None  # the after-window of a kept cache: measured after every change
        self.trials = list[CacheTrial]()
        self._after_windows: AfterWindows | None = None  # the chosen setting's, against the window before
        self.chosen: CacheTrial | None = None
        self.outcome = Outcome()

    # -- the loop ---------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Check the dataset and make the store, once: at pipeopt's first loader switch, or when this begins."""
        if self._prepare is not None:
            self.refused, self._prepare = self._prepare(), None

    def begin(self, data_wait_frac: float | None = None, filler: LoaderSettings | None = None,
              measured: Iterable[tuple[Rate, float, float]] = ()) -> None:
        """The other groups are done: fill with the settings in place (on a loader of pipeopt's; under DALI with
        ``filler``, the fastest DataLoader of pipeopt's measured, reading what is stored), then wait - unless the
        loader search found the run compute-bound (``data_wait_frac``; ``measured``: its windows of them)."""
        self.started, self.baseline, self._window_before = True, self._switcher.current, WindowBefore(measured)
        self._applied = self._cached_base = self.baseline
        if data_wait_frac is not None and data_wait_frac < COMPUTE_BOUND_WAIT:
            return self._finish(_compute_bound(data_wait_frac))
        self.prepare()
        if self.refused is not None:  # in the report's skipped groups
            self.state = CachePhase.DONE
            return
        if self.baseline.dali and filler is None:  # DALI reads the files itself: a DataLoader fills the store
            return self._finish("DALI is in place and no DataLoader setting was measured to fill the store with")
        self._cached_base = (filler or self.baseline) if self.baseline.dali else self.baseline
        if not self._room(agree(_ToWarm(self._to_warm()), self._agree).steps):  # no fill it cannot try after that
            return
        if self._cached_base != self.baseline:  # under DALI: the filler, reading what the store holds already
            self._apply(dataclasses.replace(self._cached_base, cache=True), "filling the sample cache")
            self._switcher.settle()
            return
        if not self._fills():
            self._switcher.switch(self.baseline)
            self._switcher.settle()
        self._windows.measure("filling the sample cache", self.baseline.in_flight)
        self.epoch_started()

    def epoch_started(self) -> None:
        """At an epoch's (and the wait's) start: ``warm`` now, starting what it waits for (``apply.backfill``)."""
        if self.started and self.state is CachePhase.WAIT:
            self._epoch_began = True
            self.warm()

    def epoch_ended(self) -> None:
        """At an epoch's end, before the next starts its loader (and an epoch's or the wait's first step end), once the
        window the epoch's end closed is judged (its last step is timed then; a trial started now would take it for
        its own): where every rank's store may be read, the trials begin - the next epoch's first batch read from the
        store; else, maybe, a filler reading what it holds (``_Cold``). Not at the fit's end."""
        if self._pending is not None:
            self.on_step_end()
        if not self.started or self.state is not CachePhase.WAIT or self._windows.steps_left() == 0:
            return
        now = agree(_Cold(not self.warm(), self._to_warm() > 0, self._making_ahead()), self._agree)
        if not now.cold and self._room():
            self._ready()
        elif now.cold and now.ahead and not now.making and self._applied == self.baseline:  # (``_Cold``)
            self._apply(dataclasses.replace(self.baseline, cache=True), "filling the sample cache")
            self._switcher.settle()

    def on_window(self, stats: WindowStats) -> None:
        if self.started and self.state is not CachePhase.DONE:
            self._pending = stats

    def on_step_end(self) -> None:
        self._failure = self._switcher.take_failure() or self._failure
        began, self._epoch_began = self._epoch_began, False
        if began and self._pending is None and self.state is CachePhase.WAIT:
            return self.epoch_ended()
        if self._pending is None or self.state is CachePhase.DONE:
            return
        stats, self._pending = self._pending, None
        beside = not self._quiet()  # asked before ``warm``, which may start work beside the run; any rank's counts
        figures = agree(Agreed.of(stats, self._applied, None, self._failure is not None, False, not self.warm(),
                                  beside), self._agree)
        error, self._failure, self._windows.last_step_s = self._failure, None, figures.step_time_s
        measured = None if figures.failed else figures.rate
        if self.state is CachePhase.WAIT:
            if measured is not None and self._applied == self.baseline and not figures.beside:  # quiet: pooled
                self._window_before.add(measured, figures.step_time_s * stats.steps, figures.data_wait_frac)
            if not figures.store_cold and self._room():
                self._ready()
        elif self.state is CachePhase.BEFORE:
            self._on_before(measured, figures.data_wait_frac)
        elif self.state is CachePhase.TRIAL:
            self._on_trial(measured, figures, stats.steps, error)
        else:
            self.after = stats
            self._on_after(measured, figures.step_time_s * stats.steps, figures.data_wait_frac)

    # -- the phases -------------------------------------------------------------------------------------------
    def _ready(self) -> None:
        """The store may be read on every rank: the window before, from the windows waited, else measured now."""
        self.state = CachePhase.BEFORE
        if (pooled := self._window_before.pooled(self._windows.min_window_s)) is not None:
            self._on_before(*pooled)
        else:  # a window of its own (under DALI, filled by a DataLoader: DALI again)
            self._apply(self.baseline, "cache: before")

    def _room(self, to_warm: int = 0) -> bool:
        """Steps for a cached trial and an after-window (and DALI's window before) after ``to_warm``; else done."""
        left = self._windows.steps_left()
        cached = dataclasses.replace(capped(self._cached_base, self._max_workers), cache=True)
        need = self._windows.trial_steps(self._applied, cached) + (self._windows.window if self.baseline.dali else 0)
        if left is not None and left < need + to_warm:
            self._finish(no_room(left, to_warm, need))
        return left is None or left >= need + to_warm

    def _on_before(self, rate: Rate | None, data_wait_frac: float) -> None:
        if rate is None:  # the settings in place failed: nothing to compare with
            return self._finish("the loader's workers failed in the window before the cache trial")
        if data_wait_frac < INPUT_SOLVED_WAIT:  # the settings in place: removing their wait could not pay (floor)
            return self._finish(_compute_bound(data_wait_frac))
        self.before = rate
        if self.trials:  # measured after the trials (``WindowBefore.judged``): the choice, against it
            return self._choose()
        self._try(first_trial(self.baseline, capped(self._cached_base, self._max_workers), self._alone_first,
                              self._dali_reads, lambda settings: self._windows.short_of(self._applied, settings)))

    def _on_trial(self, rate: Rate | None, figures: Agreed, steps: int, error: BaseException | None) -> None:
        """A part of the trial in place ended: its next part (``PartedTrial``), or the next trial, or the choice."""
        room = cpu_room(figures, self._max_workers)  # (whether workers may be tried after the main process alone)
        trial = self._trial.ended(rate, figures.step_time_s * steps, figures.data_wait_frac, error, self.before,
                                  self.trials, self._floor, room) if self._trial else None
        if trial is None:
            return
        self.trials.append(trial)
        self.outcome.notes.extend([trial.stopped] if trial.stopped else [])
        self._say(trial.describe())
        following = next_trial(self.trials, self.before, capped(self._cached_base, self._max_workers), self._floor)
        tried = [t.settings for t in self.trials if t.rate is not None]  # any may be chosen: its after-windows count
        if following is None or self._windows.short_of(self._applied, following, tried):
            self._choose()
        else:
            self._try(following)

    def _choose(self) -> None:
        before = self.before
        ok = [t for t in self.trials if t.rate is not None]
        if before is not None and not self._window_before.judged(ok, before, self._floor):
            self.state = CachePhase.BEFORE  # short windows before, no cached trial clearly faster: one of its own
            return self._apply(self.baseline, "cache: before")
        if before is None or not any(t.rate is not None and faster(t.rate, before, self._floor) for t in ok):
            return self._finish(f"reading from it was not faster beyond noise than {self.baseline.describe()}")
        self.chosen = cheapest_unbeaten(ok, self._floor)
        self._say(f"chose {self.chosen.settings.describe()}; measuring it against the window before")
        skip = self._switch(self.chosen.settings, take_back=True)
        self._after_windows = AfterWindows(self._windows, self._applied, skip, before, self._floor)
        self._switcher.settle()
        self.state = CachePhase.AFTER

    def _on_after(self, rate: Rate | None, seconds: float, wait: float) -> None:
        """A part of an after-window ended: the next part or window (``AfterWindows``), or the verdict."""
        before, chosen, windows = self.before, self.chosen, self._after_windows
        if rate is None or before is None or chosen is None or chosen.rate is None or windows is None:
            self.after = None
            return self._finish("the chosen loader's workers failed in the after-window")
        if (verdict := windows.ended(rate, seconds, wait)) is None:
            return
        self.outcome.notes.extend(windows.notes)
        if verdict != "kept":
            self.after = None
            return self._finish(not_faster(windows.rate, before))
        self.outcome.changes = kept_changes(chosen, self.baseline, windows.rate, before, self.trials)
        self.outcome.notes.append(f"sample cache kept: {chosen.settings.describe()}")
        self._say(f"kept {chosen.settings.describe()}")
        self.state = CachePhase.DONE

    def _finish(self, why: str) -> None:
        """Not kept: the settings in place before the cache session, again (the user's own loader, where theirs); the
        fit's windows from here on say so (after a window before too: they measure no more of it)."""
        back = self._applied != self.baseline or (self.baseline == self._switcher.user_settings and self._fills())
        if back:
            _put_back(self._switcher, self.baseline)
        if back or self.state is CachePhase.BEFORE:
            self._windows.measure("cache not kept", self._applied.in_flight + self.baseline.in_flight if back else 0)
        self._applied = self.baseline
        self.outcome.notes.append(f"sample cache not kept: {why}")
        self._say(f"sample cache not kept: {why}")
        self.state = CachePhase.DONE

    def _try(self, settings: LoaderSettings) -> None:
        self._trial = PartedTrial(self._windows, settings, self._switch(settings, take_back=True))
        self.state = CachePhase.TRIAL

    def _apply(self, settings: LoaderSettings, label: str) -> None:
        self._windows.measure(label, self._switch(settings), settings)

    def _switch(self, settings: LoaderSettings, *, take_back: bool = False) -> int:
        """``settings`` in place (a switch where others were): the steps to skip, both loaders' in-flight batches."""
        previous, self._applied = self._applied, settings
        if previous == settings:
            return 0
        self._switcher.switch(settings, take_back=take_back)
        return previous.in_flight + settings.in_flight

    # -- resume and the end ------------------------------------------------------------------------------------
    def restore(self, settings: LoaderSettings | None) -> None:
        """Resume: the settings an earlier run kept (None: not the cache), without trials; the store fills again."""
        self.started, self.state = True, CachePhase.DONE
        if settings is None or not settings.cache:
            self.outcome.notes.append("resumed from a checkpoint whose tuning did not keep the sample cache")
            return
        self.prepare()
        if self.refused is not None:
            return
        self._switch(settings)
        self._switcher.settle()
        self.chosen = CacheTrial(settings, None)
        self.outcome.changes = [Change("cache", False, True, "kept by the run this one resumes (from its checkpoint)")]

    def report(self) -> Outcome:
        """The outcome, saying so when the fit ended while the cache was still being measured."""
        if not self.measuring:
            return self.outcome
        return Outcome(list(self.outcome.changes), list(self.outcome.suggestions),
                       [ended_early(self.state, self.chosen, self._applied), *self.outcome.notes])

    measuring = property(lambda self: self.started and self.state is not CachePhase.DONE)

    @property
    def kept(self) -> LoaderSettings | None:
        return self.chosen.settings if self.state is CachePhase.DONE and self.outcome.changes and self.chosen else None


class WindowBefore:
    """The window before of a cache session (its step 1): the settings in place, not reading from the store - the
    windows measured of them (``windows``: the loader search's, then the quiet ones while waiting; rate, seconds and
    data wait) pooled until they span a trial's length. Where they span less, yet say the loop waited, the cached
    trials go first, judged against them (``provisional``); a window of its own is measured only when no cached
    trial turns out clearly faster than them (``noise.clearly_faster``, the bar an early look must clear). On a
    fast step, a window of the slow settings measured first could take most of the warm epoch: seen on 2 CPUs, 2.4 s
    of a 3.8 s epoch that the cached trials, 8x faster, then read from the store."""

    def __init__(self, measured: Iterable[tuple[Rate, float, float]] = ()) -> None:
        self.windows = list(measured)
        self.provisional = False

    def add(self, rate: Rate, seconds: float, wait: float) -> None:
        self.windows.append((rate, seconds, wait))

    def pooled(self, seconds: float) -> tuple[Rate, float] | None:
        """The window before (rate, wait) from the windows: those spanning ``seconds``, or provisionally all of them
        where they span less; None - a window of its own - where none are, or where they say the loop hardly
        waited (it may have run the step slower while they were measured: a window now confirms it)."""
        full = pool_recent(self.windows, seconds)
        if full is not None:
            return full if full[1] >= INPUT_SOLVED_WAIT else None
        short = pool(self.windows) if self.windows else None
        self.provisional = short is not None and short[1] >= INPUT_SOLVED_WAIT
        return short if self.provisional else None

    def judged(self, trials: list[CacheTrial], before: Rate, floor: float) -> bool:
        """Whether ``trials`` may be judged against ``before`` now: not when it is provisional and none of them (one
        measured at least) is clearly faster - then it no longer is: the window of its own measured next is."""
        rates = [t.rate for t in trials if t.rate is not None]
        if not self.provisional or not rates or any(clearly_faster(rate, before, floor) for rate in rates):
            return True
        self.provisional = False
        return False


class PartedTrial:
    """A cached trial's window measured in parts (``TrialWindows.measure_parts``, the first at once), judged at the
    end of each: it ends with its window, or as soon as its parts so far are slower beyond noise than a rate it must
    beat (it could not be chosen: the rest of its window would only cost the fit time)."""

    def __init__(self, windows: TrialWindows, settings: LoaderSettings, skip: int) -> None:
        self.settings, self._windows, self.label = settings, windows, f"cache trial: {settings.describe()}"
        self.first, self.later, self.count = windows.measure_parts(self.label, skip, settings, TRIAL_PARTS)
        self.parts: list[tuple[Rate, float, float]] = []  # each part's rate, seconds and data wait

    def ended(self, rate: Rate | None, seconds: float, wait: float, error: BaseException | None, before: Rate | None,
              trials: list[CacheTrial], floor: float, room: float | None = None) -> CacheTrial | None:
        """A part ended (``rate`` over ``seconds``, waiting ``wait`` of them; None: it failed, with ``error`` where
        this rank saw it). None while the next part is measured; else the trial: its parts as one (``pool``), and
        why it stopped before its window's end - slower beyond noise than ``before`` or one of the cached
        ``trials``. ``room``: the part's ``cpu_room``."""
        if rate is None:
            failed = first_line(error) if error else "a loader worker failed on another rank"
            return CacheTrial(self.settings, None, wait, failed)
        self.parts.append((rate, seconds, wait))
        rate, wait = pool(self.parts)
        done = len(self.parts)
        why = beaten_by(rate, before, trials, floor) if done < self.count else None
        if done < self.count and why is None:
            self._windows.measure_part(self.label, self.later)
            return None
        steps, window = self.first + (done - 1) * self.later, self.first + (self.count - 1) * self.later
        stopped = why and (f"cache trial {self.settings.describe()} stopped after {done} of its {self.count} parts "
                           f"({steps} of {window} steps): {rate.value:,.1f} samples/s, slower beyond noise than {why}")
        return CacheTrial(self.settings, rate, wait, stopped=stopped, cpu_room=room)


class AfterWindows:
    """The after-windows of a chosen setting against the window before (``before``), each measured in even parts
    (``TrialWindows.measure_parts``, the first at once) and judged at the end of each. A window ends with its last
    part, or at the first part whose parts so far are clearly faster than the window before (``noise.clearly_faster``:
    a gain that large, measured after the change, the rest of the window could not undo; on a fast step a window - a
    trial's length at the new pace - would hold a second or two of epochs to confirm what its first third shows).
    Then ``after_verdict``: kept, one window more when too close to call, or not."""

    def __init__(self, windows: TrialWindows, settings: LoaderSettings, skip: int, before: Rate, floor: float) -> None:
        self.settings, self._windows, self._before, self._floor = settings, windows, before, floor
        self.rates: list[Rate] = []  # each window's: its parts as one (``pool``)
        self.notes: list[str] = []  # the windows that ended before their last part
        self._measure(skip)

    def _measure(self, skip: int) -> None:
        self.parts: list[tuple[Rate, float, float]] = []  # each part's rate, seconds and data wait
        self.steps, _, self.count = self._windows.measure_parts("cache: after", skip, self.settings, AFTER_PARTS,
                                                                even=True)

    def ended(self, rate: Rate, seconds: float, wait: float) -> str | None:
        """A part ended (``rate`` over ``seconds``, waiting ``wait`` of them): None while another part or window is
        measured; else "kept" or "not" (the windows' rate: the property ``rate``)."""
        self.parts.append((rate, seconds, wait))
        pooled, done = pool(self.parts)[0], len(self.parts)
        if done < self.count:
            if not clearly_faster(pooled, self._before, self._floor):
                self._windows.measure_part("cache: after", self.steps)
                return None
            self.notes.append(f"after-window of {self.settings.describe()} ended after {done} of its {self.count} "
                              f"parts ({done * self.steps} of {self.count * self.steps} steps): {pooled.value:,.1f} "
                              f"samples/s, clearly faster than the window before ({self._before.value:,.1f})")
        self.rates.append(pooled)
        verdict = after_verdict(self.rates, self._before, self._floor)
        if verdict == "again":
            self._measure(0)
            return None
        return verdict

    @property
    def rate(self) -> Rate:
        return measured(settled(self.rates))


def capped(base: LoaderSettings, most: int | None) -> LoaderSettings:
    """``base`` with at most ``most`` workers (None: as it is): the settings the cached trials vary - one worker per
    CPU the rank may use where the store is in memory (what is left per sample is CPU work)."""
    if most is None or base.num_workers <= most:
        return base
    return base.with_workers(most, persistent=base.persistent_workers)


def ended_early(state: CachePhase, chosen: CacheTrial | None, applied: LoaderSettings) -> str:
    """What the report says of a fit that ended while the cache session was in ``state``."""
    if state is CachePhase.WAIT:
        return "the fit ended before the store held an epoch: the cache was not tried"
    if state is CachePhase.AFTER and chosen is not None:
        return (f"the fit ended before the after-window of {chosen.settings.describe()} closed: it was in place for "
                "the end of the fit, unverified, and is not reported as kept")
    return f"the fit ended while the cache was being tried; it ended on {applied.describe()}"


def no_room(left: int, to_warm: int, need: int) -> str:
    fill = f"to fill the store until the next epoch ({to_warm}), then " if to_warm else ""
    return f"the fit has {left} optimizer steps left: too few {fill}for a cached trial and an after-window ({need})"


def kept_changes(chosen: CacheTrial, baseline: LoaderSettings, after: Rate, before: Rate,
                 trials: list[CacheTrial]) -> list[Change]:
    """The report's changes for a kept cache: the cache (its trial's and after-window's speedups over ``before``),
    DALI given up, the worker count, the workers giving way (against the same workers at the usual priority, where
    ``trials`` measured them)."""
    predicted, measured = (chosen.rate.value / before.value if chosen.rate else None), after.value / before.value
    why = (f"{before.value:,.1f} -> {after.value:,.1f} samples/s reading each sample's deterministic part from "
           "the store (trial, then after-window)")
    changes = [Change("cache", False, True, why, predicted, measured)]
    if baseline.dali and not chosen.settings.dali:
        changes.append(Change("dali", baseline.dali, None, "the cached DataLoader was faster"))
    if chosen.settings.num_workers != baseline.num_workers:
        room = chosen.cpu_room if not any(t.settings.num_workers for t in trials) else None
        changes.append(Change("num_workers", baseline.num_workers, chosen.settings.num_workers,
                              "the cheapest worker count no other cached trial beat beyond noise" if room is None
                              or room >= 0 else "the main process alone read from the store; workers were not "
                              "tried: the training process left fewer CPUs idle than its loading kept busy (room "
                              f"{room:+.2f} CPUs)"))
    if chosen.settings.give_way:
        usual = [t for t in trials if t.settings == dataclasses.replace(chosen.settings, give_way=False)]
        at_it = ("the fit had no room to try them at it" if not usual else "at it, they failed" if not usual[0].rate
                 else "at it, another cached trial beat them beyond noise")
        changes.append(Change("give_way", False, True, "the cached trials' workers ran below the training "
                              f"process's CPU priority (os.nice); {at_it}"))
    return changes


def pool_recent(windows: list[tuple[Rate, float, float]], seconds: float) -> tuple[Rate, float] | None:
    """The most recent of ``windows`` (rate, seconds, data wait) that together span ``seconds``, as one
    (``pool``); None when all of them span less."""
    taken: list[tuple[Rate, float, float]] = []
    for window in reversed(windows):
        taken.append(window)
        if sum(d for _, d, _ in taken) >= seconds:
            break
    total = sum(d for _, d, _ in taken)
    return pool(taken) if taken and total >= seconds and total > 0 else None


def pool(taken: list[tuple[Rate, float, float]]) -> tuple[Rate, float]:
    """Windows (rate, seconds, data wait) as one: their time-weighted rate and wait, with the larger of their
    pooled standard error and their spread's."""
    total = sum(d for _, d, _ in taken)
    value = sum(r.value * d for r, d, _ in taken) / total
    pooled_se = math.sqrt(sum((r.value * d * r.rel_se) ** 2 for r, d, _ in taken)) / (value * total)
    spread = statistics.stdev(r.value for r, _, _ in taken) / math.sqrt(len(taken)) / value if len(taken) > 1 else 0.0
    return Rate(value, max(pooled_se, spread)), sum(w * d for _, d, w in taken) / total


def beaten_by(rate: Rate, before: Rate | None, trials: list[CacheTrial], floor: float) -> str | None:
    """What is faster beyond noise than ``rate``: the window before, or a cached trial (named); None when nothing
    is."""
    if before is not None and faster(before, rate, floor):
        return "the window before"
    return next((f"the cached trial {t.settings.describe()}" for t in trials
                 if t.rate is not None and faster(t.rate, rate, floor)), None)


def following(trials: list[CacheTrial], before: Rate | None, in_place: int, floor: float) -> int | None:
    """The worker count of the next cached trial, after ``trials`` (the first one made, the workers ``in_place``
    or the main process alone); None when done. After the workers in place, the main process alone (the cache may
    have removed all their work); after the main process alone, the workers in place - unless the loop then
    waited (almost) not at all. Then, when the cache paid but the main process alone is slower, halving the
    workers while the cache keeps pace (at most ``MAX_FEWER``)."""
    ok = [t for t in trials if t.rate is not None]
    if before is None or not ok or in_place == 0:
        return None
    if len(trials) == 1:
        first = trials[0]
        if first.settings.num_workers > 0:
            return 0
        wait, room = first.data_wait_frac, first.cpu_room
        return None if (wait is not None and wait < COMPUTE_BOUND_WAIT) or (room is not None and room < 0) else in_place
    best = max(ok, key=lambda t: t.rate.value if t.rate else 0.0)
    alone = next((t for t in ok if t.settings.num_workers == 0), None)
    if best.rate is None or not faster(best.rate, before, floor):
        return None  # the cache did not pay, with the workers in place or without any
    if alone is not None and alone.rate is not None and not faster(best.rate, alone.rate, floor):
        return None  # the main process alone keeps pace: nothing cheaper to find
    last = trials[-1]
    if len(trials) > 2 and (last.rate is None or faster(best.rate, last.rate, floor)):
        return None  # the last cut made it slower
    fewer = (in_place if len(trials) == 2 else last.settings.num_workers) // 2
    return fewer if fewer > 0 and len(trials) < 2 + MAX_FEWER else None


def cpu_room(figures: Agreed, cpus: int | None) -> float | None:
    """The CPUs of the rank's ``cpus`` the training process left idle over a window, less those its loading kept
    busy: the room workers would have to take that loading over beside the step. Below zero, they could only take
    CPU time from it - with the store in memory what is left to load is CPU work, and a step whose intra-op threads
    use every CPU leaves none idle (on 2 CPUs, the main process alone reading whole items from the store used
    199-201 % of them; every cached trial with workers there read slower beyond noise:
    ``benchmarks/results/README.md``). None where not known (no CPU count: a store on disk, ``sample_cache_dir``,
    may wait on the disk, not on the CPUs)."""
    if cpus is None or figures.cpu_main_pct is None or figures.load_cpu_s is None:
        return None
    return cpus - figures.cpu_main_pct / 100.0 - figures.load_cpu_s * figures.samples_per_s


def first_trial(baseline: LoaderSettings, base: LoaderSettings, alone_first: bool, dali_reads: bool,
                short_of: Callable[[LoaderSettings], object]) -> LoaderSettings:
    """The first cached trial. Under DALI on the CPU, where it can be fed the stored images (``dali_reads``): DALI
    reading the store - no decode left, its threads run the rest of the chain, and a trial of cached workers after
    it that it beats beyond noise stops after its first part. Else the workers ``base`` (those in place; under DALI,
    the DataLoader that filled the store) reading the store - or first the main process alone, where the store holds
    whole items (``alone_first``) and the fit has room for it (``short_of``)."""
    if dali_reads and baseline.dali == "cpu":
        return dataclasses.replace(baseline, cache=True)
    alone, same = cached_with(base, 0), cached_with(base, base.num_workers)
    return alone if alone_first and base.num_workers > 0 and not short_of(alone) else same


def cached_with(base: LoaderSettings, workers: int) -> LoaderSettings:
    """``base`` with ``workers``, reading from the store - the workers giving way to the training process."""
    if workers != base.num_workers:
        base = base.with_workers(workers, persistent=base.persistent_workers)
    return dataclasses.replace(base, cache=True, give_way=workers > 0)


def next_trial(trials: list[CacheTrial], before: Rate | None, base: LoaderSettings,
               floor: float) -> LoaderSettings | None:
    """The cached trial after ``trials``: ``following``'s worker count; then, last, the cached setting that would be
    chosen (``cheapest_unbeaten``) once more, where it has workers, at the usual priority; None when done."""
    if any(t.settings.num_workers > 0 and not t.settings.give_way for t in trials):
        return None
    workers = following(trials, before, base.num_workers, floor)
    if workers is not None:
        return cached_with(base, workers)
    ok = [t for t in trials if t.rate is not None]
    choice = cheapest_unbeaten(ok, floor).settings if ok else None
    return dataclasses.replace(choice, give_way=False) if choice is not None and choice.num_workers > 0 else None


def cheapest_unbeaten(options: list[CacheTrial], floor: float) -> CacheTrial:
    """The fewest workers (then no cache, then workers not giving way) among the measured options no other beats
    beyond noise; the first option (the settings in place) when none is measured."""
    unbeaten = [t for t in options if t.rate is not None
                and not any(u.rate is not None and faster(u.rate, t.rate, floor) for u in options)]
    return min(unbeaten or options[:1], key=lambda t: (t.settings.num_workers, t.settings.cache, t.settings.give_way))


def best_speedup(trials: list[CacheTrial], before: Rate | None) -> float | None:
    """The best cached trial's rate over the window before the trials."""
    rates = [t.rate.value for t in trials if t.rate is not None]
    return max(rates) / before.value if rates and before else None


def _put_back(switcher: Switcher, settings: LoaderSettings) -> None:
    """``settings`` in place again, settled: the user's own loader where they are the user's."""
    if settings == switcher.user_settings:
        switcher.restore_user()
    else:
        switcher.switch(settings)
        switcher.settle()


def _compute_bound(wait: float) -> str:
    return (f"the run is compute-bound (the loop waited for data {wait:.0%} of each step): a cache would have nothing "
            "to take away")
