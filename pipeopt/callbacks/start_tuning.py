"""The groups beside the loader search, tried on the live run once the loader is settled: micro-batch x
accumulation, then precision. Each measures windows of real training steps, agrees across ranks, applies, and says
in the report what it changed and why; a resumed run applies what its checkpoint kept without trying again."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from pipeopt import _lightning
from pipeopt.apply import batch as batch_apply
from pipeopt.apply import precision as precision_apply
from pipeopt.apply.batch import PlanSwitch
from pipeopt.measure.window import WindowStats
from pipeopt.tuning import noise
from pipeopt.tuning.agreement import Held, Pick, ReduceMax, WindowFigures, agree
from pipeopt.tuning.batch import BatchChoice, BatchPlan, BatchSearch, PlanWindow
from pipeopt.tuning.findings import Change, Outcome
from pipeopt.tuning.noise import Rate
from pipeopt.tuning.precision import (
    FP32,
    PrecisionChoice,
    PrecisionTrial,
    candidates,
    choose_precision,
)

Agree = ReduceMax
RESUMED = "kept by the run this one resumes (from its checkpoint)"


class _LiveGroup:
    """What the batch plan and precision share: a state (``waiting`` -> ... -> ``done``), the windows they measure
    while ``baseline`` or ``trial``, and windows cut at least ``window`` steps and ``min_window_s`` long at the
    last measured pace."""

    def __init__(self, *, agree: Agree, say: Callable[[str], None], reset_meter: Callable[..., None], window: int,
                 min_window_s: float) -> None:
        self._agree, self._say, self._reset_meter = agree, say, reset_meter
        self._window, self._min_window_s = window, min_window_s
        self.state = "waiting"
        self.after_from: int | None = None  # windows measured before the decision (the next one is after it)
        self._pending: WindowStats | None = None
        self._windows = 0
        self._step_s: float | None = None

    @property
    def decided(self) -> bool:
        return self.state == "done"

    @property
    def measuring(self) -> bool:
        return self.state in ("baseline", "trial", "verify")

    def on_window(self, stats: WindowStats) -> None:
        self._pending = stats
        self._windows += 1

    def _measure(self, label: str, skip: int = 0) -> None:
        paced = int(self._min_window_s / self._step_s) if self._step_s else 0
        self._reset_meter(label, skip, max(self._window, paced))


class BatchTuning(_LiveGroup):
    """Micro-batch x accumulation, tried on the live run once the loader is settled: a window of real training
    steps under the user's plan, then under at most a few candidates (``BatchSearch``); what is kept trains the
    rest of the fit, otherwise the user's plan is restored. Switches happen between optimizer steps where the
    accumulation lines up (``PlanSwitch``), on every rank at the same step: every optimizer step sees the user's
    effective batch, every sample is trained once, and pipeopt calls no ``training_step`` of its own."""

    def __init__(self, *, memory_fraction: float, agree: Agree, say: Callable[[str], None],
                 reset_meter: Callable[..., None], window: int, min_window_s: float) -> None:
        super().__init__(agree=agree, say=say, reset_meter=reset_meter, window=window, min_window_s=min_window_s)
        self._fraction = memory_fraction
        self.user: BatchPlan | None = None
        self.choice: BatchChoice | None = None
        self.search: BatchSearch | None = None
        # state: "waiting" -> "baseline" -> "trial" (one per candidate) -> "done"; "switching" in between
        self._switch: PlanSwitch | None = None
        self._wanted: tuple[BatchPlan, str, str] | None = None  # a switch waiting for its step: plan, label, state
        self._no_loss = False
        self._module: Any = None
        self.verified: PlanWindow | None = None  # the window after a change
        self._peak_from_start = False  # the next window must read its own device-memory peak

    def leave_alone(self) -> None:
        """Nothing is tried in this fit (the reason is in the report)."""
        self.state, self.user = "done", None

    def start(self, trainer: Any, module: Any, restored: dict[str, Any] | None) -> str | None:
        """At train start: the reason the run's batch cannot be planned (None when it can)."""
        combined = _lightning.train_combined_loader(trainer)
        loaders = list(combined.flattened) if combined is not None else []
        reason = (f"the fit has {len(loaders)} train loaders; pipeopt plans a single one" if len(loaders) != 1
                  else batch_apply.unsupported(trainer, module, loaders[0]))
        if reason is not None:
            self.state = "done"
            return reason
        self.user = BatchPlan(loaders[0].batch_size, _lightning.accumulation(trainer))
        if restored is not None and "batch" in restored:
            self.choice = BatchChoice(BatchPlan(**restored["batch"]) if restored["batch"] else self.user, RESUMED)
        self._module = module
        return None

    def begin(self, trainer: Any, windows_so_far: int) -> str | None:
        """The loader is settled (or not tuned): a window under the user's plan, or the checkpoint's plan applied;
        the reason when the installed loader cannot be re-cut (None otherwise)."""
        self._windows = windows_so_far
        loader = _lightning.train_combined_loader(trainer).flattened[0]
        user = self.user
        if user is None:  # start() found the run's batch unplannable
            self.state = "done"
            return None
        if not batch_apply.recuttable(loader, user.micro):
            self.state = "done"
            return f"the loader tuning kept a loader pipeopt does not re-cut ({type(loader).__name__})"
        self._switch = PlanSwitch(trainer, loader, user)
        if self.choice is not None:  # resumed
            self._request(trainer, self.choice.plan, "after", "done")
            return None
        device = trainer.strategy.root_device
        budget = batch_apply.MEMORY.budget(device, self._fraction)
        static = agree(Held(batch_apply.MEMORY.between_steps(device)), self._agree).bytes
        self.search = BatchSearch(user, budget_bytes=budget, static_bytes=static,
                                  batchnorm=batch_apply.has_batchnorm(self._module),
                                  may_fold=batch_apply.may_join(loader))
        if self.search.choice is not None:  # nothing to try, known without a window (no memory to budget)
            self.choice, self.state = self.search.choice, "done"
            return None
        self.state = "baseline"
        self._measure(f"batch: {user.describe()}")
        return None

    def peak_window_begins(self) -> bool:
        """A measurement window begins: whether it needs its own device-memory peak, so CUDA's peak statistics
        (which are the user's too) are reset. Only the plan's windows do - the user's plan, each trial, the window
        after the decision (which must not carry a rolled-back plan's peak), and the one that begins as that window
        closes - never before them or after."""
        needed = self._peak_from_start or self.state in ("baseline", "switching", "trial", "verify")
        self._peak_from_start = False
        return needed

    def _measure(self, label: str, skip: int = 0) -> None:
        self._peak_from_start = True
        super()._measure(label, skip)

    # -- the loop -------------------------------------------------------------------------------------------
    def on_batch_end(self, outputs: Any) -> None:
        if self.measuring and precision_apply.skipped_step(outputs):
            self._no_loss = True  # training_step skipped this batch: its batches are the user's to choose

    def on_step_end(self, trainer: Any) -> None:
        """Between optimizer steps, the same step on every rank: make a waiting switch, or judge a window."""
        if self._wanted is not None:
            plan, label, state = self._wanted
            if self._switch is not None and self._switch.aligned(plan):
                self._wanted = None
                self._switch.switch(plan)
                self.state = state
                if state in ("done", "verify"):
                    self.after_from = self._windows
                self._measure(label, skip=1)
            return
        if self._pending is None or not self.measuring or self.search is None:
            return
        stats, self._pending = self._pending, None
        self._step_s = stats.step_time_s
        plan = self._switch.current  # type: ignore[union-attr]  # measuring: begin() made the switch
        rate = noise.window_rate(stats, plan)
        peak = batch_apply.MEMORY.window_peak(stats, plan)
        both = agree(WindowFigures(rate.value, rate.rel_se, self._no_loss, peak), self._agree)
        failed = both.failed
        window = PlanWindow(plan, None if failed else Rate(both.samples_per_s, both.rel_se), both.peak_bytes,
                            "training_step returned no loss for some batches" if failed else None)
        if self.state == "verify":
            self._verify(trainer, window)
            return
        self.search.record(window)
        if self.state == "trial":
            self._say(f"batch trial: {plan.describe()} -> "
                      + (f"failed ({window.error})" if failed else f"{both.samples_per_s:,.1f} samples/s"))
        self._next(trainer)

    def _next(self, trainer: Any) -> None:
        search = self.search
        if search is None:  # only a search's windows get here
            return
        plan = search.propose()
        if plan is not None:
            self._request(trainer, plan, f"batch trial: {plan.describe()}", "trial")
            return
        choice = self.choice = search.choice
        if choice is None:
            raise RuntimeError("pipeopt: the batch search ended without a choice")
        self._say(f"batch: {choice.plan.describe()} ({choice.reason})")
        self._request(trainer, choice.plan, "after", "done" if choice.plan == self.user else "verify")

    def _verify(self, trainer: Any, after: PlanWindow) -> None:
        """The window after a change: a fold (kept for speed) must still beat the user's plan beyond noise, a split
        (kept for memory) must have run; otherwise the user's plan again."""
        self.verified, user, base = after, self.user, self._rate_of(self.user)
        fold = user is not None and after.plan.micro > user.micro
        if after.rate is not None and (not fold or (base is not None and noise.faster(after.rate, base))):
            self.state = "done"
            return
        what = (f"its after-window failed ({after.error})" if after.rate is None or base is None else
                f"its after-window measured {after.rate.value:,.1f} samples/s against your plan's {base.value:,.1f}: "
                "not faster beyond noise")
        self.choice = BatchChoice(user or after.plan, f"rolled back {after.plan.describe()}: {what}")
        self._say(f"batch: {self.choice.reason}")
        self._request(trainer, user or after.plan, "after", "done")

    def _rate_of(self, plan: BatchPlan | None) -> Rate | None:
        """The rate ``plan``'s window measured in the search (None: not measured)."""
        windows = self.search.windows if self.search is not None else []
        return next((w.rate for w in windows if w.plan == plan and w.rate is not None), None)

    def _request(self, trainer: Any, plan: BatchPlan, label: str, state: str) -> None:
        """Switch to ``plan`` at this step boundary, or at the first one where its accumulation lines up."""
        self.state = "switching"
        self._no_loss = False
        self._wanted = (plan, label, state)
        self.on_step_end(trainer)

    def epoch_started(self) -> None:
        if self._switch is not None:
            self._switch.epoch_started()

    # -- the report and checkpoints -------------------------------------------------------------------------
    def outcome(self) -> Outcome:
        out = Outcome(notes=[_describe_batch_windows(self.search)] if self.search and self.search.windows else [])
        user, choice = self.user, self.choice
        if choice is None or user is None:
            if self.state not in ("waiting", "done") and self._switch is not None:
                out.notes.insert(0, f"the fit ended while batch plans were being tried; it ended on "
                                    f"{self._switch.current.describe()}")
            return out
        if choice.plan == user:
            out.notes.insert(0, f"batch: {choice.reason}")
            return out
        plan, base, trial = choice.plan, self._rate_of(user), self._rate_of(choice.plan)
        after = self.verified.rate if self.verified is not None and self.verified.plan == plan else None
        speedups = ((trial.value / base.value if trial and base else None),
                    (after.value / base.value if after and base else None))
        out.changes = [Change("batch_size", user.micro, plan.micro, choice.reason, *speedups),
                       Change("accumulate_grad_batches", user.accumulate, plan.accumulate, choice.reason, *speedups)]
        if self.state == "verify":
            out.notes.insert(0, f"the fit ended before {plan.describe()}'s after-window closed: the change is "
                                "unverified")
        out.suggestions = [f"DataLoader(..., batch_size={plan.micro}) with "
                           f"Trainer(..., accumulate_grad_batches={plan.accumulate})"]
        return out

    def state_dict(self) -> dict[str, Any]:
        if self.user is None or self.choice is None:
            return {}
        return {"batch": None if self.choice.plan == self.user else dataclasses.asdict(self.choice.plan)}


class PrecisionTuning(_LiveGroup):
    """Mixed precision, tried on the live run once the loader is settled (an input-bound step cannot show what a
    faster compute buys): a window of real training steps in fp32, then a window under each candidate; the fastest
    candidate that beat fp32 beyond noise with its loss in line is kept, otherwise fp32 is restored. Every step
    measured is a step the model trains on: pipeopt calls no ``training_step`` of its own.

    A candidate whose step loss turns non-finite, or whose gradient scaler skips ``SCALER_SKIPS`` steps in a row, is
    reverted on that rank at once; its window still closes at the same step on every rank, where the ranks agree
    (any failure fails the trial everywhere)."""

    #: Consecutive optimizer steps a ``16-mixed`` candidate's gradient scaler may skip before it is reverted at once.
    SCALER_SKIPS = 10

    def __init__(self, *, agree: Agree, say: Callable[[str], None], reset_meter: Callable[..., None],
                 window: int, min_window_s: float) -> None:
        super().__init__(agree=agree, say=say, reset_meter=reset_meter, window=window, min_window_s=min_window_s)
        self.choice: PrecisionChoice | None = None
        self.skipped = False
        # state: "waiting" -> "baseline" (fp32 window) -> "trial" (one per candidate) -> "verify" (the window after
        # a change, against fp32's) -> "done"
        self.trials: list[PrecisionTrial] = []
        self.verified: PrecisionTrial | None = None  # the window after the change, judged against fp32's
        self._candidates: list[str] = []
        self._trying: str = FP32
        self._losses: list[float] = []
        self._failure: str | None = None
        self._scale: float | None = None
        self._skips = 0

    def leave_alone(self) -> None:
        """Nothing is tried in this fit (the reason is in the report)."""
        self.skipped, self.state = True, "done"

    def start(self, trainer: Any, module: Any, restored: dict[str, Any] | None) -> str | None:
        """At train start: apply what a checkpoint kept, or get ready to try; the reason when precision is left
        alone (None otherwise)."""
        if restored is not None and restored.get("precision") is not None:
            self.choice = PrecisionChoice(restored["precision"], RESUMED)
            if self.choice.precision != _lightning.precision_of(trainer):
                precision_apply.apply_precision(trainer, self.choice.precision)
            self.state = "done"
            return None
        reason = precision_apply.unsupported(trainer, module)
        if reason is not None:
            self.skipped, self.state = True, "done"
            return reason
        device = trainer.strategy.root_device
        bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported()
        self._candidates = [p for p in candidates(device.type, bf16) if p != FP32]
        if not self._candidates:
            self.skipped, self.state = True, "done"
            return f"no mixed precision to try on {device.type}"
        return None

    def begin(self, windows_so_far: int) -> None:
        """Take the measurement windows over: first a window in fp32."""
        self.state = "baseline"
        self._measure(f"precision: {FP32}", skip=0)
        self._windows = windows_so_far

    # -- the loop -------------------------------------------------------------------------------------------
    def on_batch_end(self, trainer: Any, outputs: Any) -> None:
        """Each trained batch: its loss; under a candidate, a non-finite loss or a scaler that keeps skipping steps
        reverts this rank to fp32 at once (the window is judged a failure when it closes)."""
        if not self.measuring:
            return
        loss = precision_apply.step_loss(outputs)
        if loss is not None:
            self._losses.append(loss)
        if self.state not in ("trial", "verify") or self._failure is not None:
            return
        scale = precision_apply.scaler_scale(trainer)
        self._skips = self._skips + 1 if scale is not None and self._scale is not None and scale < self._scale else 0
        self._scale = scale
        if loss is not None and not math.isfinite(loss):
            self._fail_here(trainer, f"its loss turned {loss}")
        elif self._skips >= self.SCALER_SKIPS:
            self._fail_here(trainer, f"its gradient scaler skipped {self._skips} optimizer steps in a row")

    def on_step_end(self, trainer: Any) -> None:
        """Between optimizer steps, the same step on every rank: judge a window that closed."""
        if self._pending is None or not self.measuring:
            return
        stats, self._pending = self._pending, None
        self._step_s = stats.step_time_s
        rate = noise.window_rate(stats, self._trying)
        failed, failure = self._failure is not None, self._failure
        both = agree(WindowFigures(rate.value, rate.rel_se, failed), self._agree)
        error = (failure or "it failed on another rank") if both.failed else None
        trial = PrecisionTrial(self._trying, None if both.failed else Rate(both.samples_per_s, both.rel_se),
                               tuple(self._losses), error=error)
        if self.state == "verify":
            self._verify(trainer, trial)
            return
        self.trials.append(trial)
        if self.state == "trial":
            self._say(f"precision trial: {self._trying} -> "
                      + (f"failed ({trial.error})" if trial.error else f"{both.samples_per_s:,.1f} samples/s"))
        self._next(trainer)

    # -- steps of the plan ----------------------------------------------------------------------------------
    def _next(self, trainer: Any) -> None:
        if self._candidates:
            self._trying = self._candidates.pop(0)
            self.state = "trial"
            self._failure, self._scale, self._skips = None, None, 0
            precision_apply.apply_precision(trainer, self._trying)
            self._measure(f"precision trial: {self._trying}", skip=1)  # its first step settles (autocast caches)
            return
        self.choice = self._agreed_choice(choose_precision(self.trials))
        if self.choice.precision != _lightning.precision_of(trainer):
            precision_apply.apply_precision(trainer, self.choice.precision)
        self._say(f"precision: {self.choice.precision} ({self.choice.reason})")
        self.after_from = self._windows
        self.state = "verify" if self.choice.precision != FP32 else "done"  # a kept change is checked once more
        self._trying, self._failure = self.choice.precision, None
        self._measure("after" if self.state == "done" else f"after: {self.choice.precision}", skip=1)

    def _verify(self, trainer: Any, after: PrecisionTrial) -> None:
        """The window after the change: kept when it is still faster than fp32's beyond noise, else fp32 again."""
        self.verified = after
        base = next((t for t in self.trials if t.precision == FP32 and t.rate is not None), None)
        if after.rate is not None and base is not None and base.rate is not None and noise.faster(after.rate,
                                                                                                   base.rate):
            self.state = "done"
            return
        precision_apply.apply_precision(trainer, FP32)
        what = (f"its after-window failed ({after.error})" if after.rate is None or base is None or base.rate is None
                else f"its after-window measured {after.rate.value:,.1f} samples/s against fp32's "
                     f"{base.rate.value:,.1f}: not faster beyond noise")
        self.choice = PrecisionChoice(FP32, f"rolled back {after.precision}: {what}")
        self._say(f"precision: {self.choice.reason}")
        self.state, self.after_from = "done", self._windows
        self._measure("after", skip=1)

    def _agreed_choice(self, local: PrecisionChoice) -> PrecisionChoice:
        """Every rank decides on the agreed rates and its own losses; a choice the ranks do not share keeps fp32."""
        names = [FP32, *[t.precision for t in self.trials if t.precision != FP32]]
        index = names.index(local.precision)
        both = agree(Pick(index, index), self._agree)
        if both.lowest != both.highest:
            return PrecisionChoice(FP32, "the ranks' windows disagreed on the losses; kept fp32")
        return local

    def _fail_here(self, trainer: Any, why: str) -> None:
        self._failure = why
        precision_apply.apply_precision(trainer, FP32)

    def _measure(self, label: str, skip: int = 0) -> None:
        self._losses = []
        super()._measure(label, skip)

    # -- the report and checkpoints -------------------------------------------------------------------------
    def outcome(self) -> Outcome:
        out = Outcome(notes=[_describe_precision_trials(self.trials)] if self.trials else [])
        choice = self.choice
        if choice is None:
            if self.measuring:
                out.notes.insert(0, f"the fit ended while precision was being tried ({self._trying}); it ended in "
                                    f"{self._trying if self._failure is None else FP32}")
            return out
        if choice.precision == FP32:
            out.notes.insert(0, f"precision: {choice.reason}")
            return out
        if self.state == "verify":
            out.notes.insert(0, f"the fit ended before {choice.precision}'s after-window closed: the change is "
                                "unverified")
        out.changes = [Change("precision", FP32, choice.precision, choice.reason, *self._speedups())]
        out.suggestions = [f"Trainer(..., precision={choice.precision!r})"]
        return out

    def _speedups(self) -> tuple[float | None, float | None]:
        """The kept precision's speedup over fp32 as its trial predicted it and as its after-window measured it."""
        rates = {t.precision: t.rate.value for t in self.trials if t.rate is not None}
        base, kept = rates.get(FP32), self.choice.precision if self.choice else None
        after = self.verified.rate.value if self.verified is not None and self.verified.rate is not None else None
        if not base or kept is None:
            return None, None
        return (rates[kept] / base if kept in rates else None), (after / base if after is not None else None)

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.choice.precision} if self.choice is not None else {}


def _describe_precision_trials(trials: list[PrecisionTrial]) -> str:
    base = next((t for t in trials if t.precision == FP32 and t.rate is not None), None)
    parts = []
    for t in trials:
        if t.rate is None:
            parts.append(f"{t.precision} failed ({t.error})")
            continue
        speed = f", {t.rate.value / base.rate.value:.2f}x fp32" if base and base.rate and t is not base else ""
        loss = f", mean loss {t.mean_loss:.4g}" if t.mean_loss is not None else ""
        parts.append(f"{t.precision} {t.rate.value:,.1f} samples/s{speed}{loss}")
    return "precision windows on the live run: " + "; ".join(parts)


def _describe_batch_windows(search: BatchSearch) -> str:
    parts = []
    for w in search.windows:
        if w.rate is None:
            parts.append(f"{w.plan.micro} x {w.plan.accumulate}: failed ({w.error})")
            continue
        peak = "" if w.peak_bytes is None else f", peak {w.peak_bytes / 2**30:.2f} GiB"
        parts.append(f"{w.plan.micro} x {w.plan.accumulate}: {w.rate.value:,.1f} samples/s{peak}")
    budget = "no device memory to budget" if search.budget_text == "the memory budget" else \
        f"budget {search.budget_text}"
    return f"batch windows on the live run (micro-batch x accumulation; {budget}): " \
           + "; ".join(parts)
