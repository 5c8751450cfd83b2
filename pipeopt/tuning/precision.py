"""Choosing the training precision from measured probes (pure decision: no torch, no Lightning).

A candidate replaces ``32-true`` only when it is faster beyond noise *and* numerically safe on the same batches:
every probe loss finite, and the mean loss within ``LOSS_TOLERANCE`` of fp32's (relative, with an absolute floor for
losses near zero). bf16 keeps 8 bits of mantissa, so a loss computed in it differs from fp32 by a few parts in a
thousand on ordinary models; a difference beyond 2 % means the model does something precision-sensitive (large
logits, tiny variances), and pipeopt stays in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeopt.tuning.noise import DEFAULT_FLOOR, Rate, faster

FP32 = "32-true"
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
    rate: Rate | None  # probe steps per second, with its noise
    losses: tuple[float, ...] = ()
    error: str | None = None

    @property
    def mean_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None

    @property
    def finite(self) -> bool:
        return bool(self.losses) and all(math.isfinite(x) for x in self.losses)


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str
    reason: str


def loss_gap(trial: PrecisionTrial, baseline: PrecisionTrial) -> float | None:
    """Relative difference of the two mean losses on the same batches (None if either is missing)."""
    a, b = trial.mean_loss, baseline.mean_loss
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(b), LOSS_ABS_FLOOR)


def choose_precision(trials: list[PrecisionTrial], *, floor: float = DEFAULT_FLOOR) -> PrecisionChoice:
    """The fastest safe candidate that beats fp32 beyond noise; fp32 otherwise - each rejection with its reason."""
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
        elif gap is None or gap > LOSS_TOLERANCE:
            why.append(f"{trial.precision}'s loss differs from fp32's by {gap:.1%} (tolerance {LOSS_TOLERANCE:.0%})")
        elif not faster(trial.rate, baseline.rate, floor):
            why.append(f"{trial.precision} was not faster beyond noise ({trial.rate.value / baseline.rate.value:.2f}x)")
        else:
            safe.append(trial)
    if not safe:
        return PrecisionChoice(FP32, "kept fp32: " + ("; ".join(why) if why else "no other precision to try"))
    best = max(safe, key=lambda t: t.rate.value)  # type: ignore[union-attr]
    gap = loss_gap(best, baseline) or 0.0
    return PrecisionChoice(best.precision, f"{best.rate.value / baseline.rate.value:.2f}x the fp32 step in its probe, "  # type: ignore[union-attr]
                                           f"loss within {gap:.2%} of fp32's on the same batches")
