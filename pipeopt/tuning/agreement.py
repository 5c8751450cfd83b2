"""What the ranks of a distributed fit must agree on, and the one way they agree.

A group's figures are a dataclass whose fields each carry their rule (``agreed(MIN)``...): ``MAX`` - the largest
over the ranks that measured it (a peak, a wait), ``MIN`` - the smallest (a rate: the slowest rank decides), ``ANY``
- true when true on any rank (a failure). ``agree(figures, reduce_max)`` returns the same dataclass as every rank
agrees on it; ``reduce_max`` is the one collective: an element-wise maximum of a list of floats over all ranks
(identity on one process). ``None`` means "not measured here" and is left out of the maximum or minimum.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

MAX, MIN, ANY = "max", "min", "any"

#: The element-wise maximum of a list of floats over all ranks.
ReduceMax = Callable[[list[float]], list[float]]
T = TypeVar("T")


def agreed(rule: str, **kwargs: Any) -> Any:
    """A dataclass field agreed by ``rule`` (``MAX``, ``MIN`` or ``ANY``)."""
    if rule not in (MAX, MIN, ANY):
        raise ValueError(f"unknown agreement rule {rule!r}: expected {MAX!r}, {MIN!r} or {ANY!r}")
    return dataclasses.field(metadata={"agree": rule}, **kwargs)


def agree(figures: T, reduce_max: ReduceMax) -> T:
    """``figures`` as every rank agrees on them (each field by its rule)."""
    specs = dataclasses.fields(figures)  # type: ignore[arg-type]  # a dataclass instance, by contract
    local = [getattr(figures, f.name) for f in specs]
    out = reduce_max([_encode(value, f.metadata["agree"]) for f, value in zip(specs, local)])
    return dataclasses.replace(figures, **{  # type: ignore[type-var]  # a dataclass instance, by contract
        f.name: _decode(v, f.metadata["agree"], "int" in str(f.type) and "float" not in str(f.type))
        for f, v in zip(specs, out)})


def _encode(value: Any, rule: str) -> float:
    if rule == ANY:
        return float(bool(value))
    if value is None:
        return -math.inf
    return float(value) if rule == MAX else -float(value)


def _decode(value: float, rule: str, integer: bool) -> Any:
    if rule == ANY:
        return value > 0
    if value == -math.inf:
        return None
    out = value if rule == MAX else -value
    return int(out) if integer else out


@dataclasses.dataclass(frozen=True)
class WindowFigures:
    """A trial window's figures: the slowest rank's samples/s (with the largest noise), the largest peak of memory,
    and whether it failed on any rank."""

    samples_per_s: float = agreed(MIN)
    rel_se: float = agreed(MAX)
    failed: bool = agreed(ANY, default=False)
    peak_bytes: int | None = agreed(MAX, default=None)


@dataclasses.dataclass(frozen=True)
class Pick:
    """The index each rank picked from the same list of candidates: the ranks agree when lowest == highest."""

    lowest: int = agreed(MIN)
    highest: int = agreed(MAX)


@dataclasses.dataclass(frozen=True)
class Held:
    """Bytes a rank holds (the largest over the ranks; None where not measured)."""

    bytes: int | None = agreed(MAX)
