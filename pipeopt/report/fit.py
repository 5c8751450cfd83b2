"""Fit and cost: which accelerators the run's tuned configuration fits on, what limits it, and what its epochs and
the whole fit take in time and (given a price) money - all projected from figures measured on the run.

* **Memory needed** for ``m`` samples per micro-batch: on CUDA the after-window's allocator peak (ground truth) moved
  by the measured bytes per sample (activations and input) for each sample more or fewer; elsewhere the counted
  breakdown (parameters, gradients, optimizer state, activations, batch) moved the same way. Under 16-bit mixed
  precision (predicted, for a 32-bit run that fits nowhere else) the 32-bit activations halve and autocast adds a
  16-bit copy of the weights.
* **Fits** with a buffer ``b``: needed x (1 + b) <= the card's memory. When the configuration does not, the largest
  micro-batch that divides the effective batch and fits, with the accumulation that keeps the effective batch.
* **Time**: optimizer steps per epoch (and for the fit) x the measured seconds per optimizer step of the before and
  after windows. **Cost**: time x ``cost_per_hour``; no prices are built in.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from pipeopt.measure.memory import MemoryBreakdown
from pipeopt.measure.window import WindowStats
from pipeopt.verdict import limit

#: buffers checked, as shares of the memory needed.
BUFFERS = (0.2, 0.4)
_GIB = 1024**3
FP32 = "32-true"
HALF = "16-mixed or bf16-mixed"


@cache
def accelerator_sizes() -> tuple[tuple[float, str], ...]:
    """(GiB, example names) of the accelerator memory sizes in ``accelerators.json``."""
    data = json.loads(resources.files("pipeopt.report").joinpath("accelerators.json").read_text())
    return tuple((float(row["gib"]), str(row["examples"])) for row in data["sizes"])


@dataclass(frozen=True)
class Fit:
    """One card size and buffer: ``fits`` as the run is, or ``micro_batch`` x ``accumulate`` under ``precision``
    that would (None: nothing does)."""

    buffer: float
    fits: bool
    micro_batch: int | None = None
    accumulate: int | None = None
    precision: str | None = None

    def text(self) -> str:
        if self.fits:
            return "fits"
        if self.micro_batch is None:
            return "does not fit"
        how = f"{self.micro_batch} x {self.accumulate}"
        return how if self.precision is None else f"{how} ({self.precision}, predicted)"


@dataclass(frozen=True)
class FitRow:
    memory_gib: float
    examples: str
    fits: list[Fit]


def need_bytes(memory: MemoryBreakdown, micro: int, *, peak: int | None = None, half: bool = False) -> float:
    """Memory needed with ``micro`` samples per micro-batch (see the module's doc)."""
    per_sample = memory.per_sample_bytes or 0.0
    measured = memory.micro_batch or micro
    need = (peak if peak else memory.counted_bytes) + per_sample * (micro - measured)
    if half and memory.activations_fp32_bytes is not None and memory.micro_batch:
        need += memory.params_bytes / 2 - memory.activations_fp32_bytes / memory.micro_batch * micro / 2
    return need


def _fit(memory: MemoryBreakdown, capacity: float, buffer: float, *, effective: int, precision: str | None,
         peak: int | None) -> Fit:
    micro = memory.micro_batch or effective

    def fits(m: int, half: bool = False) -> bool:
        return need_bytes(memory, m, peak=peak, half=half) * (1 + buffer) <= capacity

    if fits(micro):
        return Fit(buffer, True)
    smaller = [m for m in range(micro - 1, 0, -1) if effective % m == 0]
    for half in (False, True) if precision == FP32 else (False,):
        found = next((m for m in ([micro] if half else []) + smaller if fits(m, half)), None)
        if found is not None:
            return Fit(buffer, False, found, effective // found, HALF if half else None)
    return Fit(buffer, False)


def fits_on(memory: MemoryBreakdown, *, accumulate: int, peak: int | None = None,
            sizes: tuple[tuple[float, str], ...] | None = None) -> list[FitRow]:
    """For each card size, whether the configuration fits with each buffer in ``BUFFERS``, or what would."""
    micro = memory.micro_batch or 1
    rows = []
    for gib, examples in sizes if sizes is not None else accelerator_sizes():
        rows.append(FitRow(gib, examples, [_fit(memory, gib * _GIB, b, effective=micro * accumulate,
                                                 precision=memory.precision, peak=peak) for b in BUFFERS]))
    return rows


@dataclass(frozen=True)
class TimeAndCost:
    """Seconds (and, with a price, money) an epoch and the whole fit take at the before and after windows' pace."""

    steps_per_epoch: int | None
    planned_steps: int | None
    epoch_s_before: float | None = None
    epoch_s_after: float | None = None
    fit_s_before: float | None = None
    fit_s_after: float | None = None
    epochs_measured_s: list[float] = field(default_factory=list)  # wall time of each whole epoch the fit ran
    cost_per_hour: float | None = None
    epoch_cost_before: float | None = None
    epoch_cost_after: float | None = None
    fit_cost_before: float | None = None
    fit_cost_after: float | None = None

    @property
    def fit_saving(self) -> float | None:
        if self.fit_cost_before is None or self.fit_cost_after is None:
            return None
        return self.fit_cost_before - self.fit_cost_after


def time_and_cost(before: WindowStats | None, after: WindowStats | None, *, steps_per_epoch: int | None,
                  planned_steps: int | None, epochs_measured_s: list[float],
                  cost_per_hour: float | None) -> TimeAndCost:
    def seconds(window: WindowStats | None, steps: int | None) -> float | None:
        return None if window is None or steps is None else steps * window.step_time_s

    def cost(s: float | None) -> float | None:
        return None if s is None or cost_per_hour is None else s / 3600 * cost_per_hour

    times = {f"{what}_s_{when}": seconds(w, steps) for when, w in (("before", before), ("after", after))
             for what, steps in (("epoch", steps_per_epoch), ("fit", planned_steps))}
    costs = {k.replace("_s_", "_cost_"): cost(v) for k, v in times.items()}
    return TimeAndCost(steps_per_epoch, planned_steps, epochs_measured_s=list(epochs_measured_s),
                       cost_per_hour=cost_per_hour, **times, **costs)


@dataclass
class FitAndCost:
    """The report's "Fit and cost" section."""

    memory: MemoryBreakdown | None
    memory_note: str | None  # why the breakdown is missing or partial
    device_memory_bytes: int | None  # the device in use (CUDA)
    budget_bytes: int | None  # memory_fraction of it
    peak_bytes: int | None  # the after-window's allocator peak (CUDA)
    reserved_bytes: int | None  # the after-window's allocator reserve (CUDA)
    fits_on: list[FitRow]
    limit: str | None  # what limits the run as it ended
    limit_reason: str | None
    window_limits: list[tuple[int, str]]  # (window index, what limited it)
    time: TimeAndCost

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["time"]["fit_saving"] = self.time.fit_saving
        data["window_limits"] = [list(pair) for pair in self.window_limits]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FitAndCost:
        data = dict(data)
        time = {k: v for k, v in data.pop("time").items() if k != "fit_saving"}
        memory = data.pop("memory")
        return cls(memory=MemoryBreakdown(**memory) if memory else None, time=TimeAndCost(**time),
                   fits_on=[FitRow(r["memory_gib"], r["examples"], [Fit(**f) for f in r["fits"]])
                            for r in data.pop("fits_on")],
                   window_limits=[(int(i), str(k)) for i, k in data.pop("window_limits")], **data)


def fit_and_cost(*, windows: list[WindowStats], after: WindowStats | None,
                 memory: MemoryBreakdown | None, memory_note: str | None, accumulate: int,
                 device_memory_bytes: int | None, memory_fraction: float, shrunk: bool, time: TimeAndCost,
                 sizes: tuple[tuple[float, str], ...] | None = None) -> FitAndCost:
    """The section for a fit whose windows, breakdown and set-up are given; ``shrunk``: the batch plan split the
    micro-batch to fit the budget."""
    budget = int(device_memory_bytes * memory_fraction) if device_memory_bytes else None
    last = after or (windows[-1] if windows else None)
    peak = last.resources.peak_mem_bytes if last is not None else None
    reserved = last.resources.peak_reserved_bytes if last is not None else None
    cards = sizes if sizes is not None else accelerator_sizes()
    if device_memory_bytes:  # the device in use first: measured from its own peak, so the run that just fitted on
        cards = ((device_memory_bytes / _GIB, "this device"), *cards)  # it reads as fitting
    rows = fits_on(memory, accumulate=accumulate, peak=peak, sizes=cards) if memory is not None else []
    kind, why = limit(last, budget_bytes=budget, shrunk=shrunk) if last is not None else (None, None)
    return FitAndCost(memory=memory, memory_note=memory_note, device_memory_bytes=device_memory_bytes,
                      budget_bytes=budget, peak_bytes=peak, reserved_bytes=reserved, fits_on=rows, limit=kind,
                      limit_reason=why, window_limits=[(w.index, limit(w, budget_bytes=budget)[0]) for w in windows],
                      time=time)
