"""One way for ranks to agree: each field by its rule, whatever the order of fields (a fake two-rank reduction)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pipeopt.tuning.agreement import ANY, MAX, MIN, agree, agreed


@dataclass(frozen=True)
class Figures:
    rate: float = agreed(MIN)
    wait: float = agreed(MAX)
    peak: int | None = agreed(MAX, default=None)
    failed: bool = agreed(ANY, default=False)


def two_ranks(other):
    """The element-wise maximum over this rank and ``other`` (already encoded by the other rank)."""
    return lambda mine: [max(a, b) for a, b in zip(mine, other)]


def encoded(figures):
    seen = []
    agree(figures, lambda vector: seen.append(vector) or vector)
    return seen[0]


def test_the_slowest_rate_the_largest_wait_and_peak_and_any_failure_win():
    mine, theirs = Figures(300.0, 0.1, 100, False), Figures(200.0, 0.4, None, True)
    both = agree(mine, two_ranks(encoded(theirs)))
    assert both == Figures(200.0, 0.4, 100, True)
    assert agree(theirs, two_ranks(encoded(mine))) == both  # every rank agrees on the same figures
    assert isinstance(both.peak, int) and isinstance(both.failed, bool)


def test_one_process_agrees_with_itself():
    assert agree(Figures(1.5, 0.0, None, False), lambda v: v) == Figures(1.5, 0.0, None, False)


def test_an_unknown_rule_is_refused_with_the_rules_named():
    with pytest.raises(ValueError, match="'max', 'min' or 'any'"):
        agreed("median")
