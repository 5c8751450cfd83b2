"""The groups decided once, at the start of a fit, from sandboxed probes: micro-batch x accumulation (before the
first epoch) and precision (on the first batch). Each probes, agrees across ranks, applies, and says in the report
what it changed and why; a resumed run applies what its checkpoint kept without probing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeopt import _compat
from pipeopt.apply import batch as batch_apply
from pipeopt.apply import precision as precision_apply
from pipeopt.report.model import Change
from pipeopt.tuning.batch import BatchChoice, BatchPlan, BatchProbe, choose_batch
from pipeopt.tuning.noise import Rate
from pipeopt.tuning.precision import (
    FP32,
    PrecisionChoice,
    PrecisionTrial,
    choose_precision,
)

Agree = Callable[[list[float]], list[float]]
RESUMED = "kept by the run this one resumes (from its checkpoint)"


@dataclass
class Outcome:
    """What a group adds to the report."""

    changes: list[Change] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class BatchTuning:
    """Micro-batch x accumulation: probed on samples of the dataset before the first epoch, applied from it."""

    def __init__(self, *, memory_fraction: float, agree: Agree, say: Callable[[str], None]) -> None:
        self._fraction = memory_fraction
        self._agree = agree
        self._say = say
        self.user: BatchPlan | None = None
        self.choice: BatchChoice | None = None
        self._probes_note: str | None = None
        self._recut: Any = None

    def start(self, trainer: Any, module: Any, restored: dict[str, Any] | None) -> str | None:
        """Decide and apply; the reason when the run's batch cannot be planned (None when it was)."""
        combined = _compat.train_combined_loader(trainer)
        loaders = list(combined.flattened) if combined is not None else []
        if len(loaders) != 1:
            return f"the fit has {len(loaders)} train loaders; pipeopt plans a single one"
        loader = loaders[0]
        reason = batch_apply.unsupported(trainer, module, loader)
        if reason is not None:
            return reason
        user = self.user = BatchPlan(loader.batch_size, _compat.accumulation(trainer))
        if restored is not None and "batch" in restored:
            self.choice = BatchChoice(BatchPlan(**restored["batch"]) if restored["batch"] else user, RESUMED)
        else:
            sample = batch_apply.sample_batch(trainer, loader, user.effective)
            probes = self._agreed(batch_apply.probe_plans(trainer, module, sample, user))
            budget = batch_apply.MEMORY.budget(trainer.strategy.root_device, self._fraction)
            self.choice = choose_batch(user, probes, budget_bytes=budget, batchnorm=batch_apply.has_batchnorm(module))
            self._probes_note = _describe_batch_probes(probes, budget)
            self._say(f"batch: {self.choice.plan.describe()} ({self.choice.reason})")
        if self.choice.plan != user:
            self._recut = batch_apply.apply_plan(trainer, loader, self.choice.plan)
        return None

    def _agreed(self, probes: list[BatchProbe]) -> list[BatchProbe]:
        """Every rank's probes of the same plans, agreed: the largest peak, any OOM, the slowest rate."""
        vector: list[float] = []
        for p in probes:
            vector += [-1.0 if p.peak_bytes is None else float(p.peak_bytes), float(p.oom),
                       -(p.rate.value if p.rate else 0.0), p.rate.rel_se if p.rate else 0.0]
        agreed = self._agree(vector)
        out = []
        for i, p in enumerate(probes):
            peak, oom, rate, se = agreed[4 * i: 4 * i + 4]
            out.append(BatchProbe(p.plan, None if peak < 0 else int(peak), oom > 0,
                                  None if oom > 0 or p.rate is None else Rate(-rate, se)))
        return out

    def close(self) -> None:
        """End of fit: stop the workers of the first epoch's re-cut loader, if any."""
        if self._recut is not None:
            _compat.shutdown_iterator(self._recut)
            self._recut = None

    def outcome(self) -> Outcome:
        out = Outcome(notes=[self._probes_note] if self._probes_note else [])
        user, choice = self.user, self.choice
        if user is None or choice is None:
            return out
        if choice.plan == user:
            out.notes.insert(0, f"batch: {choice.reason}")
            return out
        plan = choice.plan
        out.changes = [Change("batch_size", user.micro, plan.micro, choice.reason),
                       Change("accumulate_grad_batches", user.accumulate, plan.accumulate, choice.reason)]
        out.suggestions = [f"DataLoader(..., batch_size={plan.micro}) with "
                           f"Trainer(..., accumulate_grad_batches={plan.accumulate})"]
        return out

    def state(self) -> dict[str, Any]:
        if self.user is None or self.choice is None:
            return {}
        return {"batch": None if self.choice.plan == self.user else dataclasses.asdict(self.choice.plan)}


class PrecisionTuning:
    """Mixed precision: probed on the first batch of the fit, the strategy's plugin swapped before its step."""

    def __init__(self, *, agree: Agree, say: Callable[[str], None]) -> None:
        self._agree = agree
        self._say = say
        self.choice: PrecisionChoice | None = None
        self.skipped = False
        self._probes_note: str | None = None

    @property
    def decided(self) -> bool:
        return self.choice is not None or self.skipped

    def first_batch(self, trainer: Any, module: Any, batch: Any, batch_idx: int,
                    restored: dict[str, Any] | None) -> str | None:
        """Decide and apply; the reason when the run's precision is left alone (None when it was tuned)."""
        if restored is not None and restored.get("precision") is not None:
            self.choice = PrecisionChoice(restored["precision"], RESUMED)
        else:
            reason = precision_apply.unsupported(trainer, module)
            if reason is not None:
                self.skipped = True
                return reason
            trials = precision_apply.probe_precisions(trainer, module, batch, batch_idx)
            self.choice = self._agreed(trainer, trials, choose_precision(trials))
            self._probes_note = _describe_precision_trials(trials)
            self._say(f"precision: {self.choice.precision} ({self.choice.reason})")
        if self.choice.precision != _compat.precision_of(trainer):
            precision_apply.apply_precision(trainer, self.choice.precision)
        return None

    def _agreed(self, trainer: Any, trials: list[PrecisionTrial], choice: PrecisionChoice) -> PrecisionChoice:
        """Rank zero's choice on every rank; fp32 if any rank's probe failed."""
        names = [t.precision for t in trials]
        local = [float(trainer.is_global_zero and t.precision == choice.precision) for t in trials]
        failed_here = any(t.error is not None for t in trials)
        agreed = self._agree([*local, float(failed_here)])
        if agreed[-1] > 0 and not failed_here:
            return PrecisionChoice(FP32, "a precision probe failed on another rank; kept fp32")
        return PrecisionChoice(names[max(range(len(names)), key=lambda i: agreed[i])], choice.reason)

    def outcome(self) -> Outcome:
        out = Outcome(notes=[self._probes_note] if self._probes_note else [])
        choice = self.choice
        if choice is None:
            return out
        if choice.precision == FP32:
            out.notes.insert(0, f"precision: {choice.reason}")
            return out
        out.changes = [Change("precision", FP32, choice.precision, choice.reason)]
        out.suggestions = [f"Trainer(..., precision={choice.precision!r})"]
        return out

    def state(self) -> dict[str, Any]:
        return {"precision": self.choice.precision} if self.choice is not None else {}


def _describe_precision_trials(trials: list[PrecisionTrial]) -> str:
    base = next((t for t in trials if t.precision == FP32 and t.rate is not None), None)
    parts = []
    for t in trials:
        if t.rate is None:
            parts.append(f"{t.precision} failed ({t.error})")
            continue
        speed = f", {t.rate.value / base.rate.value:.2f}x fp32" if base and base.rate and t is not base else ""
        loss = f", loss {t.mean_loss:.4g}" if t.mean_loss is not None else ""
        parts.append(f"{t.precision} {t.rate.value:,.1f} probe steps/s{speed}{loss}")
    return "precision probes on the first batch (sandboxed: no trace left): " + "; ".join(parts)


def _describe_batch_probes(probes: list[BatchProbe], budget: int | None) -> str:
    parts = []
    for p in probes:
        if p.oom:
            parts.append(f"{p.plan.micro} x {p.plan.accumulate}: out of memory")
            continue
        peak = "" if p.peak_bytes is None else f", peak {p.peak_bytes / 2**30:.2f} GiB"
        rate = "" if p.rate is None else f"{p.rate.value:,.1f} samples/s"
        parts.append(f"{p.plan.micro} x {p.plan.accumulate}: {rate}{peak}")
    limit = ("no device memory (CPU): plans compared by speed only" if budget is None
             else f"budget {budget / 2**30:.2f} GiB")
    return f"batch probes (micro-batch x accumulation, sandboxed; {limit}): " + "; ".join(parts)
