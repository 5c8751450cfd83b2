"""Choosing the training precision from windows of the live run (pure decision: no torch, no Lightning).

Each candidate is measured over a window of real training steps, against a window in fp32 just before it. A
candidate replaces ``32-true`` only when it is faster beyond noise *and* its training stays healthy: every step's
loss finite, and its mean loss not above fp32's window by more than ``LOSS_TOLERANCE`` (relative, with an absolute
floor for losses near zero) or, when the windows' losses are noisier than that, by more than twice the standard
error of the difference. The windows hold different batches, so a lower loss is never held against a candidate
(training goes on); a higher one beyond that allowance means the model does something precision-sensitive (large
logits, tiny variances), and pipeopt stays in fp32.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from pipeopt.tuning.noise import DEFAULT_FLOOR, Rate, faster, measured

FP32 = "32-true"
BF16, FP16 = "bf16-mixed", "16-mixed"
LOSS_TOLERANCE = 0.02
LOSS_ABS_FLOOR = 1e-3


def candidates(device_type: str, bf16_supported: bool) -> list[str]:
    """Precisions worth probing on this accelerator, fp32 (the baseline) first."""
    if device_type == "cuda":
        return [FP32, *(["bf16-mixed"] if bf16_supported else []), "16-mixed"]
    if device_type == "cpu":
        return [FP32, "bf16-mixed"]
    return [FP32]


@dataclass(frozen=True)
class PrecisionTrial:
    precision: str
    rate: Rate | None  # samples (or steps) per second of its window, with its noise
    losses: tuple[float, ...] = ()  # the loss of every step of its window
    error: str | None = None

    @property
    def mean_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None

    @property
    def loss_se(self) -> float:
        """Standard error of the mean loss (0 for fewer than two steps)."""
        return statistics.stdev(self.losses) / math.sqrt(len(self.losses)) if len(self.losses) > 1 else 0.0

    @property
    def finite(self) -> bool:
        return bool(self.losses) and all(math.isfinite(x) for x in self.losses)


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str
    reason: str


def loss_gap(trial: PrecisionTrial, baseline: PrecisionTrial) -> float | None:
    """How far the trial's mean loss is above the baseline's, relative (negative when below; None if either is
    missing)."""
    a, b = trial.mean_loss, baseline.mean_loss
    if a is None or b is None:
        return None
    return (a - b) / max(abs(b), LOSS_ABS_FLOOR)


def loss_allowance(trial: PrecisionTrial, baseline: PrecisionTrial) -> float:
    """The relative rise of the mean loss a candidate may show: the tolerance, or twice the standard error of the
    difference of the two windows' means when their batches vary more than that."""
    scale = max(abs(baseline.mean_loss or 0.0), LOSS_ABS_FLOOR)
    return max(LOSS_TOLERANCE, 2.0 * math.hypot(trial.loss_se, baseline.loss_se) / scale)


def choose_precision(trials: list[PrecisionTrial], *, floor: float = DEFAULT_FLOOR) -> PrecisionChoice:
    """The fastest safe candidate that beats fp32 beyond noise; fp32 otherwise - each rejection with its reason.
    Between the two half precisions bf16 is kept unless fp16 is faster than it beyond noise: fp16's narrower range
    leans on a gradient scaler for the rest of the fit, where a window's health check cannot look."""
    baseline = next((t for t in trials if t.precision == FP32), None)
    if baseline is None or baseline.rate is None or not baseline.finite:
        return PrecisionChoice(FP32, "fp32 itself could not be measured; precision left as is")
    safe: list[PrecisionTrial] = []
    why: list[str] = []
    for trial in trials:
        if trial is baseline:
            continue
        gap = loss_gap(trial, baseline)
        if trial.error is not None or trial.rate is None:
            why.append(f"{trial.precision} failed ({trial.error})")
        elif not trial.finite:
            why.append(f"{trial.precision} gave a non-finite loss")
        elif gap is None or gap > loss_allowance(trial, baseline):
            why.append(f"{trial.precision}'s loss was {gap:.1%} above fp32's (allowed "
                       f"{loss_allowance(trial, baseline):.1%})" if gap is not None else
                       f"{trial.precision}'s loss could not be compared with fp32's")
        elif not faster(trial.rate, baseline.rate, floor):
            why.append(f"{trial.precision} was not faster beyond noise ({trial.rate.value / baseline.rate.value:.2f}x)")
        else:
            safe.append(trial)
    if not safe:
        return PrecisionChoice(FP32, "kept fp32: " + ("; ".join(why) if why else "no other precision to try"))
    best = max(safe, key=lambda t: measured(t.rate).value)
    bf16 = next((t for t in safe if t.precision == BF16), None)
    preferred = ""
    if best.precision == FP16 and bf16 is not None and not faster(measured(best.rate), measured(bf16.rate), floor):
        best, preferred = bf16, f"; preferred to 16-mixed, not faster beyond noise ({_ratio(best, bf16):.2f}x)"
    gap = loss_gap(best, baseline) or 0.0
    return PrecisionChoice(best.precision, f"{_ratio(best, baseline):.2f}x the fp32 rate in its live trial window, "
                                           f"mean loss {gap:+.1%} against the fp32 window before it{preferred}")


def _ratio(trial: PrecisionTrial, other: PrecisionTrial) -> float:
    return measured(trial.rate).value / measured(other.rate).value
