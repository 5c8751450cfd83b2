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


#: transfer (host-to-device copy) share of the step at or above which the run is transfer-bound.
TRANSFER_BOUND_AT = 0.20
#: a window whose device-memory peak comes within this share of the budget is memory-capacity-bound.
MEMORY_BOUND_WITHIN = 0.05

TRANSFER_BOUND = "transfer-bound"
MEMORY_BOUND = "memory-capacity-bound"


def limit(window: WindowStats, *, budget_bytes: int | None = None, shrunk: bool = False) -> tuple[str, str]:
    """What limits a window's throughput, and why: the data wait first (input-bound), then the host-to-device copy
    (transfer-bound), then memory (the batch plan had to split the micro-batch, ``shrunk``, or the window's peak came
    within 5 % of the budget), else compute (or balanced, as ``judge`` has it)."""
    if window.data_wait_frac >= INPUT_BOUND_AT:
        return INPUT_BOUND, f"the loop waited for data {window.data_wait_frac:.0%} of each step"
    if window.transfer_frac >= TRANSFER_BOUND_AT:
        return TRANSFER_BOUND, f"copying batches to the device took {window.transfer_frac:.0%} of each step"
    if shrunk:
        return MEMORY_BOUND, "the micro-batch had to be split to fit the memory budget"
    peak = window.resources.peak_mem_bytes
    if peak is not None and budget_bytes and peak >= (1 - MEMORY_BOUND_WITHIN) * budget_bytes:
        return MEMORY_BOUND, f"the device-memory peak reached {peak / budget_bytes:.0%} of the budget"
    kind = judge(window).kind
    return kind, ("the step's own work sets the pace" if kind == COMPUTE_BOUND
                  else f"the loop waited for data {window.data_wait_frac:.0%} of each step; input and compute both "
                       "matter")
