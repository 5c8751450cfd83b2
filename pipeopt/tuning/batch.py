"""Choosing micro-batch x gradient accumulation (pure decision: no torch, no Lightning).

The effective batch - samples per optimizer step, ``micro x accumulate`` on each rank - is the user's and stays
so. A plan either splits each of the user's batches into ``k`` micro-batches (accumulating ``k`` times more) or
folds ``k`` of the user's accumulated batches into one micro-batch: the same samples, in the same order, reach
each optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeopt.tuning.noise import DEFAULT_FLOOR, Rate, faster


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
class BatchProbe:
    plan: BatchPlan
    peak_bytes: int | None = None  # device memory at the probe's peak (None: not measured, e.g. on CPU)
    oom: bool = False
    rate: Rate | None = None  # samples/s of the probe


@dataclass(frozen=True)
class BatchChoice:
    plan: BatchPlan
    reason: str


def fits(probe: BatchProbe, budget_bytes: int | None) -> bool:
    if probe.oom:
        return False
    return budget_bytes is None or probe.peak_bytes is None or probe.peak_bytes <= budget_bytes


def choose_batch(user: BatchPlan, probes: list[BatchProbe], *, budget_bytes: int | None, batchnorm: bool,
                 floor: float = DEFAULT_FLOOR) -> BatchChoice:
    """The fastest plan that fits the memory budget. The user's plan stays unless another fits and is faster beyond
    noise - or the user's does not fit. A model with batch norm keeps its micro-batch (its statistics depend on
    it) unless the user's does not fit at all."""
    by_plan = {p.plan: p for p in probes}
    mine = by_plan.get(user)
    fitting = [p for p in probes if fits(p, budget_bytes) and p.rate is not None]
    budget = "the memory budget" if budget_bytes is None else f"{budget_bytes / 2**30:.2f} GiB"
    if mine is not None and not fits(mine, budget_bytes):
        if not fitting:
            return BatchChoice(user, f"no plan fits {budget}; kept yours")
        best = max(fitting, key=lambda p: (p.plan.micro, p.rate.value))  # type: ignore[union-attr]
        why = "out of memory" if mine.oom else f"a peak of {mine.peak_bytes / 2**30:.2f} GiB"  # type: ignore[operator]
        note = " (your model has batch norm: its statistics now see the smaller micro-batch)" if batchnorm else ""
        return BatchChoice(best.plan, f"your batch does not fit ({why} against {budget}); the largest micro-batch "
                                      f"that does, with the same effective batch{note}")
    if batchnorm:
        return BatchChoice(user, "kept your micro-batch: the model has batch norm, whose statistics depend on it")
    if mine is None or mine.rate is None or not fitting:
        return BatchChoice(user, "kept yours: it could not be compared")
    best = max(fitting, key=lambda p: p.rate.value)  # type: ignore[union-attr]
    if best.plan != user and faster(best.rate, mine.rate, floor):  # type: ignore[arg-type]
        return BatchChoice(best.plan, f"{best.rate.value / mine.rate.value:.2f}x the samples/s of yours in its probe, "  # type: ignore[union-attr]
                                      f"within {budget}")
    return BatchChoice(user, "kept yours: no other plan was faster beyond noise")
