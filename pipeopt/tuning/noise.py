"""Comparing measured throughputs with their noise.

A window's rate carries two kinds of noise: the spread within it (the standard error of its block means) and
drift between windows on a shared machine. Two rates differ only when the gap exceeds both twice their combined standard
error and a floor for the drift (5 % unless told otherwise: the same setting measured twice on a shared machine
differed by about that much, and by more while other work ran).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeopt.measure.window import WindowStats

DEFAULT_FLOOR = 0.05


@dataclass(frozen=True)
class Rate:
    """Throughput of one or more windows (samples/s where known, else steps/s) and its relative standard error."""

    value: float
    rel_se: float

    @classmethod
    def of(cls, window: WindowStats) -> Rate:
        """The rate the window's loader sustains (``WindowStats.sustained_per_s``), with the window's noise."""
        return cls(value=window.sustained_per_s, rel_se=window.rate_rel_se)


def window_rate(stats: WindowStats, in_place: object) -> Rate:
    """The rate a window measured while ``in_place`` was tried (loader settings, a precision). The one seam between
    the measured world and the decisions: tests replace it (``pipeopt.tuning.noise.window_rate``) to put a live fit
    in a controlled world - DALI ten times faster, say - so that what is kept does not depend on how busy the
    machine is."""
    return Rate.of(stats)


def window_wait(stats: WindowStats, in_place: object) -> float:
    """The share of each step the loop waited for data in a window measured while ``in_place`` was tried: what
    judges a run compute-bound. The seam beside ``window_rate``: tests replace it to fix that judgement, however
    busy the machine is."""
    return stats.data_wait_frac


def window_supply_wait(stats: WindowStats, in_place: object) -> float:
    """The share of each step the loop waited with no finished batch ready (``WindowStats.starved_wait_frac``;
    the whole wait where the loader's stock cannot be read): the wait more loaders could take away, what the loader
    model is fitted to. A seam like ``window_wait``, replaced beside it."""
    starved = stats.starved_wait_frac
    return stats.data_wait_frac if starved is None else min(starved, stats.data_wait_frac)


def measured(rate: Rate | None) -> Rate:
    """The rate of a window that did not fail (a failed one has none: asking for it is a bug)."""
    if rate is None:
        raise ValueError("pipeopt: a failed window has no rate")
    return rate


def combine(a: Rate, b: Rate) -> Rate:
    """Two measurements of the same setting: their mean, with a standard error that also counts their disagreement."""
    value = (a.value + b.value) / 2
    rel_se = max(math.hypot(a.rel_se, b.rel_se) / 2, abs(a.value - b.value) / value / 2 if value else 0.0)
    return Rate(value=value, rel_se=rel_se)


def threshold(a: Rate, b: Rate, floor: float = DEFAULT_FLOOR) -> float:
    """Relative gap two rates must exceed to differ."""
    return max(floor, 2.0 * math.hypot(a.rel_se, b.rel_se))


def ahead(a: Rate, b: Rate, floor: float = DEFAULT_FLOOR) -> bool:
    """``a`` is ahead of ``b`` by more than the floor, whatever their standard errors (a gap worth measuring again,
    not yet a difference)."""
    return a.value > b.value * (1.0 + floor)


def faster(a: Rate, b: Rate, floor: float = DEFAULT_FLOOR) -> bool:
    """``a`` is faster than ``b`` beyond noise."""
    return a.value > b.value * (1.0 + threshold(a, b, floor))


def clearly_faster(a: Rate, b: Rate, floor: float = DEFAULT_FLOOR) -> bool:
    """``a`` is faster than ``b`` by twice the gap ``faster`` asks: what a window judged in parts may stop at, at an
    early look (each look is one more chance for the noise to pass ``faster``'s gap; a real gain of that size shows
    at the first)."""
    return a.value > b.value * (1.0 + 2.0 * threshold(a, b, floor))


def within_noise(a: Rate, b: Rate, floor: float = DEFAULT_FLOOR) -> bool:
    return abs(a.value - b.value) <= max(a.value, b.value) * threshold(a, b, floor)
