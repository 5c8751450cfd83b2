"""Which DataLoader settings to try next, and which win - decided from windows measured on the live run.

The search (a plan, fed one measured trial at a time):
1. Compute-bound (data wait below 10 %): stop; more workers would only take CPU from the step.
2. Predict, then verify (``capacity``): a capacity model fitted to the before-window (the step's input-free rate,
   what the main process delivers loading between steps, what loading a sample costs in CPU) picks the worker
   count; one trial verifies it; the model, refitted on every trial (now with what a worker delivers and costs in
   CPU and memory), picks again while it predicts a gain beyond noise over the best measured setting (beyond the
   floor, where that setting's loop still waited with no batch ready: ``worth_a_trial``) - at most
   ``MODEL_TRIALS`` trials in all (one fewer where DALI is tried after them). Every proposal carries its predicted
   rate; the trial records it beside the measured one. A close call (the fastest ahead of the user's settings by
   more than the floor, within noise) measures the user's settings once more, then - still close - the fastest
   once more: each side on two windows.
3. Fallback, when a pick fails or the first pick measures slower than the user's settings beyond noise (the model
   has this pipeline wrong; a refit's pick slower than the best so far is refitted on instead): grow
   ``num_workers`` geometrically from the fastest count so far while each step is faster than the best beyond noise
   (a count too close to call is measured once more and judged on both windows), until the data wait is gone
   (< 5 %), a trial fails, or the next count would not fit the budget: two workers per CPU this rank
   may use always fit; beyond that the measured CPU per worker times the count must fit those CPUs (workers that
   mostly wait on storage use little CPU and may outnumber the cores), and their measured private memory must fit
   the memory available. Then refine: the midpoints between the best count and its tried neighbours.
4. The choice: the cheapest setting (fewest workers) that no other measured setting beats beyond noise, among those
   whose workers' measured memory fits - or, where more workers of the same settings climb beyond the floor over
   it, the fewest within the floor of the fastest (``more_workers_on_a_trend``) - given the model's headroom
   (``with_headroom``): when the refitted model picks more workers than it has (a trial that reached the step's
   pace with no supply to spare) and they fit the budget, those are kept, and the after-window measures them.
5. DALI (when it may be tried: the ``"dali"`` group, DALI installed, a dataset it can rebuild): one more
   candidate, measured like the others (once more when too close to call). It is chosen only when it beats every
   DataLoader setting beyond noise: at a tie the DataLoader, the user's own machinery, wins.
6. Extras on a DataLoader choice, each kept only if faster beyond noise: ``pin_memory=True`` on CUDA when transfers
   take time; after the fallback, ``prefetch_factor=4`` when some wait remains (where the model held, ``n``
   workers with two batches each in flight cover what the step consumes while one batch is made: a deeper queue
   is predicted to add nothing). ``persistent_workers`` is set where workers would otherwise restart at every
   remaining epoch boundary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeopt.tuning import capacity
from pipeopt.tuning.noise import DEFAULT_FLOOR, Rate, ahead, combine, faster, measured, within_noise

#: Below this data-wait fraction the run is compute-bound: no search.
COMPUTE_BOUND_WAIT = 0.10
#: Below this data-wait fraction after a change, the input pipeline no longer limits the step.
INPUT_SOLVED_WAIT = 0.05
#: Never more workers than this, whatever the budget says.
MAX_WORKERS = 64
#: Trials the model's picks may take (its pick and the refits' picks), before DALI and the extras - one fewer
#: where DALI is a candidate too, so that the worker counts and DALI take three trials in all.
MODEL_TRIALS = 3
#: Batches a DALI loader feeds its pipeline ahead of the step.
DALI_PREFETCH = 2


@dataclass(frozen=True)
class LoaderSettings:
    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory: bool
    dali: str | None = None  # DALI decodes instead of a DataLoader: on "cpu" or "mixed" (GPU); the rest unused
    cache: bool = False  # the workers read the deterministic part of each sample from pipeopt's sample store
    give_way: bool = False  # the workers run below the training process's CPU priority (``apply.loader.GiveWay``)

    @classmethod
    def of(cls, loader: Any) -> LoaderSettings:
        workers = int(loader.num_workers)
        return cls(
            num_workers=workers,
            prefetch_factor=loader.prefetch_factor if workers > 0 else None,
            persistent_workers=bool(loader.persistent_workers),
            pin_memory=bool(loader.pin_memory),
        )

    def with_workers(self, n: int, *, persistent: bool) -> LoaderSettings:
        return dataclasses.replace(
            self,
            num_workers=n,
            prefetch_factor=(self.prefetch_factor or 2) if n > 0 else None,
            persistent_workers=persistent and n > 0,
            give_way=self.give_way and n > 0,
        )

    def as_kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def dali_on(cls, device: str) -> LoaderSettings:
        return cls(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False, dali=device)

    @property
    def in_flight(self) -> int:
        """Batches a loader with these settings may hold when replaced (delivered before the new one's)."""
        return (DALI_PREFETCH if self.dali else self.num_workers * (self.prefetch_factor or 0)) + 1

    def describe(self) -> str:
        if self.dali:
            return f"DALI ({self.dali}, reading the sample cache)" if self.cache else f"DALI ({self.dali} decoding)"
        parts = [f"num_workers={self.num_workers}"]
        if self.num_workers > 0:
            parts += [f"prefetch_factor={self.prefetch_factor}", f"persistent_workers={self.persistent_workers}"]
        parts.append(f"pin_memory={self.pin_memory}")
        if self.cache:
            parts.append("sample cache")
        if self.give_way and self.num_workers > 0:
            parts.append("workers giving way")
        return ", ".join(parts)


@dataclass(frozen=True)
class Trial:
    """A measured candidate. ``rate`` is None when it failed (``error`` says how)."""

    settings: LoaderSettings
    rate: Rate | None
    data_wait_frac: float | None = None
    transfer_frac: float | None = None
    cpu_main_pct: float | None = None
    cpu_workers_pct: float | None = None
    worker_mem_bytes: int | None = None  # private memory of one worker
    error: str | None = None
    repeats: int = 1  # windows pooled into this trial
    predicted: float | None = None  # the capacity model's rate for these settings when they were proposed
    load_cpu_s: float | None = None  # CPU seconds a sample costs to load (``session.cpu_per_sample``)
    step_cpu_s: float | None = None  # CPU seconds per sample of the step: the process's, outside the fetch
    supply_wait_frac: float | None = None  # the share of the step waited with no batch ready (None: not measured)
    headroom_from: int | None = None  # a choice given the model's headroom: the worker count its rate was measured with
    climbed_from: int | None = None  # a choice of more workers on a climb: the cheapest unbeaten count's

    @property
    def ok(self) -> bool:
        return self.rate is not None


@dataclass(frozen=True)
class Budget:
    """What this rank may spend on workers."""

    cpus: int  # CPUs this rank may use (its share of the node)
    memory_bytes: int | None = None  # memory workers may take; None: unknown
    cuda: bool = False
    more_epochs: bool = False  # the fit will cross at least one more epoch boundary
    may_change_workers: bool = True
    dali: str | None = None  # the DALI device to try ("cpu" or "mixed"); None: no DALI candidate
    training_mem_bytes: int | None = None  # the training process's private memory: a worker's, until one is measured


def over_budget(n: int, trials: list[Trial], budget: Budget) -> tuple[bool, str | None]:
    """Whether ``n`` workers exceed the budget, and why (None: a cap or an unmeasured cost, no finding). Up to two
    workers per CPU always fit (the trial measures whether they pay); beyond, the measured CPU per worker times the
    count must fit the rank's CPUs, and their measured memory the memory available."""
    if n > MAX_WORKERS:
        return True, None
    if n <= 2 * budget.cpus:
        return False, None
    with_cpu = [t for t in trials if t.ok and t.settings.num_workers > 0 and t.cpu_workers_pct is not None]
    if not with_cpu:
        return True, None
    last = with_cpu[-1]
    per_worker = max((last.cpu_workers_pct or 0.0) / last.settings.num_workers, 0.1)
    if n * per_worker > 100.0 * budget.cpus:
        return True, (f"{n} workers would need about {n * per_worker:.0f} % CPU (measured {per_worker:.0f} % per "
                      f"worker); this rank may use {budget.cpus} CPUs")
    mem = last.worker_mem_bytes
    if mem and budget.memory_bytes is not None and n * mem > budget.memory_bytes:
        return True, f"{n} workers would need {n * mem / 2**30:.1f} GiB of memory"
    return False, None


def within_memory(trial: Trial, baseline: Trial, budget: Budget) -> bool:
    """``trial``'s workers' measured memory fits what workers may take (the baseline always does: it is the user's)."""
    mem, most = trial.worker_mem_bytes, budget.memory_bytes
    return trial is baseline or not mem or most is None or trial.settings.num_workers * mem <= most


class LoaderSearch:
    """A plan of candidates. ``propose()`` gives the next (None when done); ``record()`` feeds its measurement."""

    def __init__(self, baseline: Trial, budget: Budget, *, floor: float = DEFAULT_FLOOR) -> None:
        if baseline.rate is None:
            raise ValueError("the baseline must be a measured trial")
        self.baseline = baseline
        self.budget = budget
        self.floor = floor
        self.trials: list[Trial] = [baseline]
        self.stop_reason: str | None = None
        self.predictions: dict[LoaderSettings, float] = {}  # what the model predicted for each proposal
        self.fell_back: str | None = None  # why the search left the model for geometric growth (None: it did not)
        self.first_held: str | None = None  # what held the model's first pick below its aim (``Capacity.held_back``)
        self._plan = self._steps()
        self._waiting = False

    # -- protocol -----------------------------------------------------------------------------------------
    def propose(self) -> LoaderSettings | None:
        if self._waiting:
            raise RuntimeError("record() the last proposal before asking for another")
        candidate = next(self._plan, None)
        self._waiting = candidate is not None
        if candidate is not None and not candidate.dali and candidate not in self.predictions:
            self.predictions[candidate] = self.predict(candidate)  # checked when it is measured
        return candidate

    def predict(self, settings: LoaderSettings) -> float:
        """The rate the model fitted to every trial so far predicts for a DataLoader setting."""
        return self._model().rate(settings.num_workers)

    def record(self, trial: Trial) -> None:
        """Add a measured trial (with the prediction made for it); a repeat of a trial's settings is pooled with
        it, and so is a second window of the user's settings with the baseline."""
        self._waiting = False
        trial = dataclasses.replace(trial, predicted=self.predictions.get(trial.settings))
        again = next((k for k in range(len(self.trials) - 1, 0, -1) if self.trials[k].settings == trial.settings),
                     None)
        if len(self.trials) > 1 and trial.settings == self.baseline.settings and trial.ok:
            self.trials[0] = self.baseline = _pooled(self.baseline, trial)
        elif again is not None and self.trials[again].ok and trial.ok:
            self.trials[again] = _pooled(self.trials[again], trial)
        else:
            self.trials.append(trial)

    def choice(self) -> Trial:
        """The cheapest measured setting that no other measured setting beats beyond noise (the baseline if
        nothing beat it). A setting that failed even once is never chosen."""
        failed = {t.settings for t in self.trials if not t.ok}
        ok = [t for t in self.trials
              if t.ok and t.settings not in failed and within_memory(t, self.baseline, self.budget)]
        unbeaten = [t for t in ok if not any(faster(measured(u.rate), measured(t.rate), self.floor) for u in ok)]

        return more_workers_on_a_trend(min(unbeaten or ok, key=_cost), ok, self.baseline, self.floor)

    def with_headroom(self, chosen: Trial) -> Trial:
        """``chosen`` with the refitted model's worker count when that is more and fits the budget: its trial reached
        the step's pace with no supply to spare. Predicted, not measured (``docs/loader-tuning.md``)."""
        s, model = chosen.settings, self._model()
        n = model.best(MAX_WORKERS)
        if (chosen is self.baseline or not chosen.ok or s.dali or not 0 < s.num_workers < n or self.fell_back
                or not self.budget.may_change_workers or capacity.supply_wait(chosen) >= capacity.SUPPLY_BOUND_WAIT
                or over_budget(n, self.trials, self.budget)[0]):
            return chosen  # (a trial its supply limited: the search tries more workers itself, where it may)
        settings, predicted = dataclasses.replace(s, num_workers=n), model.rate(n)
        self.predictions[settings] = predicted  # the after-window is sized at this pace
        return dataclasses.replace(chosen, settings=settings, predicted=predicted, headroom_from=s.num_workers)

    def best_dataloader(self, *, filling: bool = False) -> Trial:
        """The fastest DataLoader setting measured that may be chosen (its workers fit their memory; the baseline at
        least): where the model is refitted from. ``filling``: what fills a sample cache under DALI - the fastest of
        pipeopt's own loaders, which filled the store while they were measured (the user's, the baseline, did not:
        its rate leaves out what filling costs); the baseline only when none of them was measured."""
        ok = [t for t in self.trials if t.ok and not t.settings.dali and within_memory(t, self.baseline, self.budget)]
        filled = [t for t in ok if t is not self.baseline] if filling else []
        return max(filled or ok, key=lambda t: measured(t.rate).value)

    def summary(self) -> list[str]:
        """How the search went, as report notes: where it left the model, why it stopped."""
        notes = [f"loader model's first pick: {self.first_held}"] if self.first_held else []
        notes += [f"loader model: {self.fell_back}; searched geometrically from there"] if self.fell_back else []
        return notes + ([f"loader search stopped: {self.stop_reason}"] if self.stop_reason else [])

    # -- the plan ---------------------------------------------------------------------------------------
    def _tried(self, settings: LoaderSettings) -> Trial | None:
        return next((t for t in self.trials if t.settings == settings), None)

    def _steps(self) -> Iterator[LoaderSettings]:
        base = self.baseline
        if (base.data_wait_frac or 0.0) < COMPUTE_BOUND_WAIT:
            self.stop_reason = (f"compute-bound: the loop waited for data {base.data_wait_frac or 0:.0%} of each "
                                "step; more workers would only take CPU from the step")
            return
        if self.budget.may_change_workers:
            yield from self._predicted()
            if close_call(self.best_dataloader(), self.baseline, self.floor):
                yield self.baseline.settings  # the user's settings once more: the choice is made on both windows
                best = self.best_dataloader()
                if still_close(best, self.baseline, self.floor):
                    yield best.settings  # ... and the fastest once more: each side decided on two windows
        else:
            self.stop_reason = "num_workers left as is (\"loader\" is not among the groups to tune)"
        yield from self._dali()
        yield from self._extras()

    def _persistent(self) -> bool:
        return self.budget.more_epochs or self.baseline.settings.persistent_workers

    def _fits(self, n: int) -> bool:
        over, why = over_budget(n, self.trials, self.budget)
        self.stop_reason = why or self.stop_reason
        return not over

    def _model(self) -> capacity.Capacity:
        model = capacity.fit(self.trials, cpus=self.budget.cpus, memory_bytes=self.budget.memory_bytes,
                             training_mem_bytes=self.budget.training_mem_bytes)
        if model is None:  # the baseline always has a rate
            raise RuntimeError("pipeopt: no measured trial to fit the loader model to")
        return model

    def _predicted(self) -> Iterator[LoaderSettings]:
        """The model's pick, verified by a trial; then the refitted model's pick while it predicts a gain beyond
        noise over the fastest setting measured, ``MODEL_TRIALS`` trials at most. A pick that fails, or a first pick
        slower than the user's settings beyond noise, hands the search to geometric growth (``_fallback``); a
        refit's pick slower than the fastest so far is one more point the next refit is fitted to."""
        trials = MODEL_TRIALS - (self.budget.dali is not None)
        for attempt in range(trials):
            model = self._model()
            n = model.best(MAX_WORKERS)
            candidate = self.baseline.settings.with_workers(n, persistent=self._persistent())
            predicted, best = model.rate(n), self.best_dataloader()
            if self._tried(candidate) is not None:
                self.stop_reason = (f"the loader model, refitted on the trials, picks {_workers(n)} again "
                                    f"(predicted {predicted:,.1f} samples/s){_held(model)}")
                return
            if attempt and not worth_a_trial(predicted, best, self.floor):
                self.stop_reason = no_gain(best, n, predicted, self.floor) + _held(model)
                return
            self.predictions[candidate] = predicted  # computed here: propose() need not refit the model for it
            if not attempt and (held := model.held_back(MAX_WORKERS)):
                self.first_held = f"{_workers(n)}: {held}"
            yield candidate
            trial = self.trials[-1]
            if not trial.ok:
                self.fell_back = f"its pick, {_workers(n)}, failed: {trial.error}"
                yield from self._fallback(max(1, n // 2), failed_at=(n, trial.error))
                return
            if faster(measured(best.rate), measured(trial.rate), self.floor):
                if attempt:  # a refit's pick slower than the best: noise or contention on the plateau; refit on it
                    continue
                self.fell_back = (f"its pick, {_workers(n)}, measured {measured(trial.rate).value:,.1f} samples/s "
                                  f"(predicted {predicted:,.1f}), slower than "
                                  f"{_workers(best.settings.num_workers)} ({measured(best.rate).value:,.1f})")
                yield from self._fallback()
                return
        self.stop_reason = f"tried the loader model's pick and its refits' ({trials} trials){_held(self._model())}"

    def _fallback(self, n: int | None = None,
                  failed_at: tuple[int, str | None] | None = None) -> Iterator[LoaderSettings]:
        """Geometric growth from ``n`` (default: twice the fastest count so far), then the midpoints."""
        best = self.best_dataloader()
        yield from self._grow(max(1, 2 * best.settings.num_workers if n is None else n), best, failed_at)
        yield from self._refine()

    def _grow(self, n: int, best: Trial, failed_at: tuple[int, str | None] | None = None) -> Iterator[LoaderSettings]:
        """Double the workers from ``n`` while it pays; the first count that does not beat ``best`` beyond noise
        (measured twice when too close to call) ends it. Only the step from the main process to one worker is
        forgiven a tie: a single worker merely overlaps loading with the step. A first count that fails is halved
        (the jump may have overshot what the machine survives), and growth stays below it (and below
        ``failed_at``)."""
        while True:
            if failed_at is not None and n >= failed_at[0]:
                self.stop_reason = f"{_workers(failed_at[0])} failed: {failed_at[1]}"
                return
            if not self._fits(n):
                if self.stop_reason is None:
                    self.stop_reason = f"{n} workers exceed the budget ({self.budget.cpus} CPUs, cap {MAX_WORKERS})"
                return
            candidate = self.baseline.settings.with_workers(n, persistent=self._persistent())
            tried = self._tried(candidate)  # a count the model already tried is judged on its window
            if tried is not None and tried.settings == best.settings:
                n *= 2
                continue
            if tried is None:
                yield candidate
            trial = tried or self.trials[-1]
            if not trial.ok and best is self.baseline and n > 1:
                failed_at, n = (n, trial.error), n // 2
                continue
            if not trial.ok:
                self.stop_reason = f"{_workers(n)} failed: {trial.error}"
                return
            if within_noise(measured(trial.rate), measured(best.rate), self.floor):
                yield candidate  # too close to call: measure it once more and decide on both windows
                trial = self.trials[-1]
                if not trial.ok:
                    self.stop_reason = f"{_workers(n)} failed: {trial.error}"
                    return
            if faster(measured(trial.rate), measured(best.rate), self.floor):
                best = trial
                if (trial.data_wait_frac or 0.0) < INPUT_SOLVED_WAIT:
                    self.stop_reason = (f"with {_workers(n)} the loop waits for data "
                                        f"{trial.data_wait_frac:.0%} of a step")
                    return
            elif not (n == 1 and best is self.baseline):
                self.stop_reason = (f"{_workers(n)} were not faster than {_workers(best.settings.num_workers)} "
                                    "beyond noise")
                return
            n *= 2

    def _refine(self) -> Iterator[LoaderSettings]:
        best = self.choice().settings.num_workers
        counts = sorted({t.settings.num_workers for t in self.trials if t.ok})  # never toward a failed count
        above = [c for c in counts if c > best]
        below = [c for c in counts if c < best]
        for neighbour in (above[:1] + below[-1:]):
            mid = (best + neighbour) // 2
            if mid in (best, neighbour) or not self._fits(mid):
                continue
            settings = self.baseline.settings.with_workers(mid, persistent=self._persistent())
            if self._tried(settings) is None:
                yield settings

    def _dali(self) -> Iterator[LoaderSettings]:
        """DALI, once - and once more when it is too close to the best to call."""
        if self.budget.dali is None:
            return
        candidate = LoaderSettings.dali_on(self.budget.dali)
        yield candidate
        trial, best = self.trials[-1], self.choice()
        if trial.ok and best is not trial and within_noise(measured(trial.rate), measured(best.rate), self.floor):
            yield candidate

    def _extras(self) -> Iterator[LoaderSettings]:
        chosen = self.choice()
        s = chosen.settings
        if s.dali:
            return
        deeper_queue_may_pay = self.fell_back is not None or not self.budget.may_change_workers  # see 6. above
        if (deeper_queue_may_pay and s.num_workers > 0 and (chosen.data_wait_frac or 0.0) >= INPUT_SOLVED_WAIT
                and (s.prefetch_factor or 2) < 4):
            candidate = dataclasses.replace(s, prefetch_factor=4)
            yield candidate
            chosen = self.choice()
            s = chosen.settings
        if self.budget.cuda and not s.pin_memory and (chosen.transfer_frac or 0.0) >= 0.01:
            yield dataclasses.replace(s, pin_memory=True)


def _cost(t: Trial) -> tuple:
    s = t.settings
    return (s.dali is not None, s.num_workers, s.prefetch_factor or 0, s.pin_memory, -measured(t.rate).value)


def worth_a_trial(predicted: float, best: Trial, floor: float) -> bool:
    """The refitted model's pick is worth its trial: it predicts a gain beyond noise over ``best`` - beyond the
    floor alone where ``best``'s loop still waited with no batch ready (``capacity.SUPPLY_BOUND_WAIT``): there only
    more workers can take that wait away, and a noisy window must not stop the search short of measuring them."""
    if _supply_bound(best):
        return ahead(Rate(predicted, 0.0), measured(best.rate), floor)
    return faster(Rate(predicted, 0.0), measured(best.rate), floor)


def _supply_bound(trial: Trial) -> bool:
    return capacity.supply_wait(trial) >= capacity.SUPPLY_BOUND_WAIT


def _held(model: capacity.Capacity) -> str:
    """What held the model's pick below the count it aims for (``Capacity.held_back``), to end a stop reason with."""
    held = model.held_back(MAX_WORKERS)
    return f"; {held}" if held else ""


def no_gain(best: Trial, n: int, predicted: float, floor: float) -> str:
    """Why the search stopped where ``worth_a_trial`` said no: by which of its two rules."""
    beyond, waited = (f"the {floor:.0%} floor", ", whose loop still waited with no batch ready") \
        if _supply_bound(best) else ("noise", "")
    return (f"the loader model predicts no gain beyond {beyond} over {_workers(best.settings.num_workers)}{waited} "
            f"({_workers(n)}: {predicted:,.1f} samples/s against {measured(best.rate).value:,.1f} measured)")


def more_workers_on_a_trend(chosen: Trial, ok: list[Trial], baseline: Trial, floor: float) -> Trial:
    """``chosen`` (the cheapest no trial beats beyond noise), or - where more workers of the same DataLoader
    settings, each faster than your settings beyond noise, read faster than it by more than the floor - the fewest
    of them within the floor of the fastest. Windows of several workers on a busy machine read with standard errors
    of 5-10 %, so counts whose rates climb 15-20 % from one to the next can all sit within each other's noise; the
    after-window then measures the choice against your settings."""
    if chosen.settings.dali or chosen is baseline:
        return chosen
    same = dataclasses.replace(chosen.settings, num_workers=0)
    more = [t for t in ok if not t.settings.dali and t.settings.num_workers > chosen.settings.num_workers
            and dataclasses.replace(t.settings, num_workers=0) == same
            and faster(measured(t.rate), measured(baseline.rate), floor)]
    top = max([chosen, *more], key=lambda t: measured(t.rate).value)
    near = [t for t in [chosen, *more] if not ahead(measured(top.rate), measured(t.rate), floor)]
    fewest = min(near, key=_cost)
    return fewest if fewest is chosen else dataclasses.replace(fewest, climbed_from=chosen.settings.num_workers)


def close_call(best: Trial, baseline: Trial, floor: float) -> bool:
    """The fastest setting is ahead of the user's (measured once) by more than the floor, but within noise: worth a
    second window of the user's settings, late in the search as the trials were - a drift of the machine's pace is
    then in both sides of the comparison."""
    return baseline.repeats == 1 and _ahead_within_noise(best, baseline, floor)


def still_close(best: Trial, baseline: Trial, floor: float) -> bool:
    """After the user's second window, the fastest setting (measured once) is still ahead by more than the floor
    and within noise: worth its own second window. One window of a few workers reads with a standard error of
    8-9 % on a 2-CPU machine (their batches come in bursts), so a gain under ~18 % cannot show in it; two
    windows a side show ~12 %."""
    return best.repeats == 1 and _ahead_within_noise(best, baseline, floor)


def _ahead_within_noise(best: Trial, baseline: Trial, floor: float) -> bool:
    if best is baseline or best.rate is None:
        return False
    fast, base = measured(best.rate), measured(baseline.rate)
    return ahead(fast, base, floor) and not faster(fast, base, floor)


def _pooled(first: Trial, again: Trial) -> Trial:
    """Two windows of the same settings as one trial: the second's figures, the rates combined, waits averaged."""
    return dataclasses.replace(again, rate=combine(measured(first.rate), measured(again.rate)),
                               data_wait_frac=_mean(first.data_wait_frac, again.data_wait_frac),
                               supply_wait_frac=_mean(first.supply_wait_frac, again.supply_wait_frac),
                               transfer_frac=_mean(first.transfer_frac, again.transfer_frac),
                               repeats=first.repeats + 1, predicted=first.predicted)


def _mean(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else (a + b) / 2


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"
