"""Choosing micro-batch x gradient accumulation on the live run (pure decision: no torch, no Lightning).

The effective batch - samples per optimizer step, ``micro x accumulate`` on each rank - is the user's and stays
so. A plan either splits each of the user's batches into ``k`` micro-batches (accumulating ``k`` times more) or
folds ``k`` of the user's accumulated batches into one micro-batch: the same samples, in the same order, reach
each optimizer step.

``BatchSearch`` asks for windows of real training steps: first one under the user's plan, then at most a few
candidates, each judged on what its own window measured (samples/s, and on CUDA the allocator's peak). What it
tries follows from the first window:

- the user's plan peaked above the memory budget: the largest split whose peak, predicted from the measured one,
  fits - kept once its own window's peak is within the budget, a smaller split tried otherwise;
- it fits and accumulates: the largest fold predicted to fit (on CPU, where there is no device memory to budget,
  one micro-batch of the whole effective batch) - kept only when faster beyond noise and within the budget;
- a model with batch norm keeps its micro-batch when it fits (its statistics depend on it); a plan that
  accumulates nothing has no larger micro-batch with the same effective batch: nothing is tried.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeopt.tuning.noise import DEFAULT_FLOOR, Rate, faster, measured

#: Splits go down to the user's micro-batch divided by this (a smaller split only ever buys memory, and one that
#: fits is found before).
MAX_SPLIT = 8


@dataclass(frozen=True, order=True)
class BatchPlan:
    micro: int
    accumulate: int

    @property
    def effective(self) -> int:
        return self.micro * self.accumulate

    def describe(self) -> str:
        return f"micro-batch {self.micro} x accumulate {self.accumulate}"


def plans(user: BatchPlan) -> list[BatchPlan]:
    """Every plan with the user's effective batch whose micro-batch splits a user batch evenly or folds whole
    accumulated batches, largest micro-batch first."""
    out = []
    for micro in range(user.effective, 0, -1):
        if user.effective % micro:
            continue
        splits = micro <= user.micro and user.micro % micro == 0
        folds = micro > user.micro and micro % user.micro == 0
        if splits or folds:
            out.append(BatchPlan(micro, user.effective // micro))
    return out


@dataclass(frozen=True)
class PlanWindow:
    """What a window of real training steps under ``plan`` measured (agreed across ranks)."""

    plan: BatchPlan
    rate: Rate | None  # samples/s; None when the window failed
    peak_bytes: int | None = None  # device memory at the window's peak (None: not measured, e.g. on CPU)
    error: str | None = None


@dataclass(frozen=True)
class BatchChoice:
    plan: BatchPlan
    reason: str


class BatchSearch:
    """Ask/tell over plans: ``propose()`` the plan whose window to measure next (None: decided), ``record()`` what
    it measured, ``choice`` once decided. The first proposal is the user's plan."""

    def __init__(self, user: BatchPlan, *, budget_bytes: int | None, static_bytes: int | None, batchnorm: bool,
                 may_fold: bool, floor: float = DEFAULT_FLOOR) -> None:
        self.user = user
        self._budget = budget_bytes
        self._static = static_bytes or 0
        self._batchnorm, self._may_fold, self._floor = batchnorm, may_fold, floor
        self.windows: list[PlanWindow] = []
        self.choice: BatchChoice | None = None
        self._queue: list[BatchPlan] = [user]
        self._goal: str | None = None  # "fit" (shrink below the budget) or "speed" (one fold, beyond noise)
        if budget_bytes is None:  # no memory to budget: the user's window could only lead to a fold, if any
            why = self._why_no_fold()
            if why is not None:
                self._decide(user, why)

    def _why_no_fold(self) -> str | None:
        """Why no larger micro-batch is tried for a plan within budget (None: one may be)."""
        if self._batchnorm:
            return "kept your micro-batch: the model has batch norm, whose statistics depend on it"
        if self.user.accumulate == 1:
            return "kept yours: it accumulates no batches, so no larger micro-batch keeps your effective batch"
        if not self._may_fold:
            return "kept yours: the loader has its own collate_fn, whose batches pipeopt does not join"
        return None

    @property
    def budget_text(self) -> str:
        return "the memory budget" if self._budget is None else f"{self._budget / 2**30:.2f} GiB"

    def propose(self) -> BatchPlan | None:
        return None if self.choice is not None or not self._queue else self._queue[0]

    def record(self, window: PlanWindow) -> None:
        self._queue.pop(0)
        self.windows.append(window)
        if window.plan == self.user:
            self._after_baseline(window)
        elif self._goal == "fit":
            self._after_split(window)
        else:
            self._after_fold(window)

    # -- the steps -------------------------------------------------------------------------------------------
    def _after_baseline(self, mine: PlanWindow) -> None:
        user = self.user
        if mine.rate is None:
            self._decide(user, f"kept yours: its window failed ({mine.error})")
        elif not self._fits(mine):
            self._goal = "fit"
            self._queue = [p for p in plans(user) if p.micro < user.micro and p.micro * MAX_SPLIT >= user.micro
                           and self._fits_predicted(p, mine)]
            if not self._queue:
                self._decide(user, f"yours peaked at {_gib(mine.peak_bytes)} against {self.budget_text} and no "
                                   "smaller micro-batch is predicted to fit; kept yours (it runs)")
        elif (why := self._why_no_fold()) is not None:
            self._decide(user, why)
        else:
            self._goal = "speed"
            folds = [p for p in plans(user) if p.micro > user.micro and self._fits_predicted(p, mine)]
            self._queue = folds[:1]
            if not folds:
                self._decide(user, f"kept yours: no larger micro-batch is predicted to fit {self.budget_text}")

    def _after_split(self, window: PlanWindow) -> None:
        if window.rate is not None and self._fits(window):
            note = " (your model has batch norm: its statistics now see the smaller micro-batch)" \
                if self._batchnorm else ""
            mine = self.windows[0]
            self._decide(window.plan, f"yours peaked at {_gib(mine.peak_bytes)} against {self.budget_text}; "
                                      f"the largest micro-batch that fits, with the same effective batch{note}")
        elif not self._queue:
            self._decide(self.user, f"no smaller micro-batch fitted {self.budget_text}; kept yours (it runs)")

    def _after_fold(self, window: PlanWindow) -> None:
        mine = self.windows[0]
        if window.rate is None:
            self._decide(self.user, f"kept yours: {window.plan.describe()} failed ({window.error})")
        elif not self._fits(window):
            self._decide(self.user, f"kept yours: {window.plan.describe()} peaked at {_gib(window.peak_bytes)}, "
                                    f"over {self.budget_text}")
        elif faster(window.rate, measured(mine.rate), self._floor):
            speed = window.rate.value / measured(mine.rate).value
            self._decide(window.plan, f"{speed:.2f}x the samples/s of yours in its live window, within "
                                      f"{self.budget_text}")
        else:
            self._decide(self.user, f"kept yours: {window.plan.describe()} was not faster beyond noise")

    # -- memory ----------------------------------------------------------------------------------------------
    def _fits(self, window: PlanWindow) -> bool:
        return self._budget is None or window.peak_bytes is None or window.peak_bytes <= self._budget

    def _fits_predicted(self, plan: BatchPlan, mine: PlanWindow) -> bool:
        """The peak of ``plan`` predicted from the user's measured one: what the step keeps between steps
        (parameters, gradients, optimizer state) stays, the rest grows with the micro-batch."""
        if self._budget is None or mine.peak_bytes is None:
            return True
        per_micro = max(0, mine.peak_bytes - self._static)
        return self._static + per_micro * plan.micro / self.user.micro <= self._budget

    def _decide(self, plan: BatchPlan, reason: str) -> None:
        self.choice = BatchChoice(plan, reason)
        self._queue = []


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"
