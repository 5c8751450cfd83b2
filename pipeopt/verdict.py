"""Decide from a measured window whether the run is input-bound, compute-bound or balanced.

The estimate is differential (DS-Analyzer, VLDB'21): how fast would the step be if every batch were already
waiting? ``input_free_speedup = step time / input-free step time``, where the input-free step time is what the
window measured minus the data wait - but never less than the device's own compute + transfer time (on CUDA the
host may wait while the device is still busy, and removing that wait buys nothing).

It is an estimate, not a bound: it assumes the rest of the step keeps its before-window time. Once the main
process no longer loads data, that rest often runs faster too (its CPU caches and cores are no longer shared with
decoding), so a measured speedup can exceed it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pipeopt.measure.window import WindowStats

#: data-wait fraction at or above which the run is input-bound.
INPUT_BOUND_AT = 0.30
#: data-wait fraction below which the run is compute-bound.
COMPUTE_BOUND_BELOW = 0.10

INPUT_BOUND = "input-bound"
COMPUTE_BOUND = "compute-bound"
BALANCED = "balanced"


@dataclass(frozen=True)
class Verdict:
    kind: str
    data_wait_frac: float
    input_free_speedup: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge(window: WindowStats) -> Verdict:
    wait = window.data_wait_frac
    estimate = window.step_time_s / window.input_free_step_s
    share = f"the loop waited for data {wait:.0%} of each step"
    if wait >= INPUT_BOUND_AT:
        kind, why = INPUT_BOUND, f"{share}; the input pipeline limits throughput"
    elif wait < COMPUTE_BOUND_BELOW:
        kind, why = COMPUTE_BOUND, f"{share}; more loader workers would only take CPU from the step"
    else:
        kind, why = BALANCED, f"{share}; input and compute both matter"
    return Verdict(kind=kind, data_wait_frac=wait, input_free_speedup=estimate, reason=why)
