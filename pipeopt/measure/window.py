"""Windows: a fixed number of optimizer steps summarised into rates, fractions and resource figures."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeopt.measure.device import DeviceClock
from pipeopt.measure.resources import ResourceFigures, ResourceProbe
from pipeopt.measure.steps import StepRecord


@dataclass(frozen=True)
class WindowStats:
    """Measured figures of one window. Times are seconds per optimizer step (means over the window).

    ``rate_rel_se`` is the relative standard error of the window's mean step time, from the means of
    consecutive blocks of steps (five, or one per epoch when the window spans whole short epochs): loaders with
    several workers deliver in bursts and stall at epoch starts, so single steps are not independent, blocks
    are closer to it.

    ``busy_frac`` is compute time over total time: the share of the step the accelerator (or, on CPU, the
    training process) spent in forward/backward/optimizer. On CUDA ``compute`` and ``transfer`` are device
    times from CUDA events and may overlap the host's ``wait``, so the fractions need not add up to 1.
    """

    index: int
    label: str
    first_step: int
    steps: int
    samples: int | None
    duration_s: float
    step_time_s: float
    step_time_std_s: float
    rate_rel_se: float
    wait_s: float
    transfer_s: float
    compute_s: float
    samples_per_s: float | None
    steps_per_s: float
    data_wait_frac: float
    transfer_frac: float
    busy_frac: float
    resources: ResourceFigures = field(default_factory=ResourceFigures)
    batches: int = 0  # micro-batches taken from the loader (``steps`` times the accumulation)
    step_cpu_s: float = 0.0  # CPU seconds per step of the training process outside the fetch (``StepRecord``)
    fetch_cpu_s: float = 0.0  # CPU seconds per step of the training thread inside the fetch: with no workers, loading
    supply_ratio: float | None = None  # batches the loader made per batch taken in the window (``supply_ratio``)
    starved_wait_frac: float | None = None  # the share of the window waited with no batch ready (``starved_wait``)

    @property
    def sustained_per_s(self) -> float:
        """The rate this window's loader sustains: samples/s (steps/s where samples are unknown), less the share of
        the batches taken that came from a stock made before the window (``supply_ratio`` below 1).

        A newly started loader fills its queue while the old one drains; one that supplies a little slower than
        the step consumes lives off that stock for many steps without a wait, and its consumed rate would flatter
        it. A stock that grew is no credit: the rate stays what the step consumed."""
        rate = self.samples_per_s or self.steps_per_s
        return rate if self.supply_ratio is None else rate * min(1.0, self.supply_ratio)

    @property
    def input_free_step_s(self) -> float:
        """Step time if every batch were already waiting: the host's other work or the device's, whichever is longer."""
        return max(self.step_time_s - self.wait_s, self.compute_s + self.transfer_s, 1e-12)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WindowStats:
        data = dict(data)
        data["resources"] = ResourceFigures(**data.get("resources", {}))
        return cls(**data)


def summarize(
    records: Sequence[StepRecord],
    clock: DeviceClock,
    *,
    index: int,
    label: str,
    first_step: int,
    resources: ResourceFigures,
    blocks: int = 5,
    ready: Sequence[tuple[object, int] | None] = (),
) -> WindowStats:
    """Resolve the records' device stamps and reduce them to a ``WindowStats``.

    The steps' host times miss the device's backlog at the window's end (CUDA runs behind the host, by up to its
    launch queue: a step of one 20 ms kernel read 1.4 ms on the host). The meter starts every window with none, so
    the backlog the clock finds is the window's own: it is added to the duration, and each step's time stretched in
    proportion (the host ran ahead at the device's pace, so the steps keep their relative spread)."""
    if not records:
        raise ValueError("a window needs at least one step")
    backlog = clock.settle()
    host = sum(r.total for r in records)
    stretch = (host + backlog) / host if backlog > 0 and host > 0 else 1.0
    totals = [r.total * stretch for r in records]
    duration = sum(totals)
    n = len(records)
    wait = sum(r.wait for r in records)
    transfer = sum(clock.seconds(a, b) for r in records for a, b in r.transfers)
    compute = sum(clock.seconds(a, b) for r in records for a, b in r.computes)
    counts = [r.samples for r in records if r.samples is not None]
    samples = sum(counts) if len(counts) == len(records) else None
    safe = duration if duration > 0 else float("nan")
    return WindowStats(
        index=index,
        label=label,
        first_step=first_step,
        steps=n,
        samples=samples,
        duration_s=duration,
        step_time_s=duration / n,
        step_time_std_s=statistics.pstdev(totals) if n > 1 else 0.0,
        rate_rel_se=_block_rel_se(totals, blocks),
        wait_s=wait / n,
        transfer_s=transfer / n,
        compute_s=compute / n,
        samples_per_s=(samples / safe) if samples else None,
        steps_per_s=n / safe,
        data_wait_frac=wait / safe,
        transfer_frac=transfer / safe,
        busy_frac=compute / safe,
        resources=resources,
        batches=sum(r.micro_batches for r in records),
        step_cpu_s=sum(r.step_cpu for r in records) / n,
        fetch_cpu_s=sum(r.fetch_cpu for r in records) / n,
        supply_ratio=supply_ratio(records, ready),
        starved_wait_frac=starved_wait(records, ready),
    )


def starved_wait(records: Sequence[StepRecord], ready: Sequence[tuple[object, int] | None]) -> float | None:
    """The share of the window's time the loop waited in fetches that began with no finished batch ready (the
    stock ``ready[i-1]`` read as step ``i - 1`` ended): the wait more loaders could take away. The rest of the
    wait - a batch was ready - is the fetch's own work (receiving the batch from a worker, waking the thread) and
    stays whatever the worker count. From the window's second step on (its first has no reading before it); None
    without a reading at every step, or with fewer than three steps."""
    if len(records) < 3 or len(ready) != len(records) or any(r is None for r in ready):
        return None
    duration = sum(r.total for r in records[1:])
    starved = sum(r.wait for r, before in zip(records[1:], ready) if before is not None and before[1] == 0)
    return starved / duration if duration > 0 else None


def supply_ratio(records: Sequence[StepRecord], ready: Sequence[tuple[object, int] | None]) -> float | None:
    """Batches the loader made per batch the loop took, over the window: the least-squares slope against time of
    the batches made by each step's end (taken so far plus those waiting ready, ``ready[i]`` read as step ``i``
    ended) over the slope of those taken.

    Slopes over every step, not the two ends: a loader's stock of ready batches saw-tooths as its workers take
    turns, and the ends alone would carry that. None without a reading at every step, when the window crosses an
    epoch boundary (an epoch's end empties the stock whatever the loader's speed), or when it took fewer batches
    than twice the largest stock it saw."""
    readings = [r for r in ready if r is not None]
    if len(readings) != len(records) or len(records) < 3:
        return None
    epoch = readings[0][0]
    if any(r[0] != epoch for r in readings):
        return None
    xs = [r.end for r in records]
    taken = list(itertools.accumulate(r.micro_batches for r in records))
    if taken[-1] < 2 * max(r[1] for r in readings):
        return None  # too short for the stock it drew on: its workers' supply and the stock cannot be told apart
    made = [t + reading[1] for t, reading in zip(taken, readings)]
    took = _slope(xs, taken)
    return None if not took else max(0.0, _slope(xs, made) / took)


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0


def _block_rel_se(totals: Sequence[float], blocks: int = 5) -> float:
    n = len(totals)
    if n < 2:
        return 0.0
    k = min(blocks, n)
    edges = [round(i * n / k) for i in range(k + 1)]
    means = [sum(totals[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]
    mean = sum(totals) / n
    return statistics.stdev(means) / math.sqrt(k) / mean if mean > 0 else 0.0


class WindowMeter:
    """Skips ``warmup`` steps, then groups every ``window`` steps into a ``WindowStats`` (update / compute / reset).

    ``reset`` drops the steps of an unfinished window, e.g. when the configuration changes mid-window.
    """

    def __init__(
        self,
        *,
        window: int,
        warmup: int,
        clock: DeviceClock,
        probe: ResourceProbe,
        on_window: Callable[[WindowStats], None],
    ) -> None:
        self.window = window
        self.warmup = warmup
        self._clock = clock
        self._probe = probe
        self._on_window = on_window
        self._steps: list[StepRecord] = []
        self._ready: list[tuple[object, int] | None] = []
        self._seen = 0
        self._windows = 0
        self._mark: Any = None
        self._skip = 0
        self._length = window
        self._blocks = 5
        self.label = "observe"

    @property
    def steps_seen(self) -> int:
        return self._seen

    @property
    def pending_steps(self) -> int:
        """Steps in the current, unfinished window."""
        return len(self._steps)

    def update(self, record: StepRecord) -> None:
        self._seen += 1
        if self._seen <= self.warmup:
            if self._seen == self.warmup:
                self._mark = self._begin()
            return
        if self._skip > 0:
            self._skip -= 1
            if self._skip == 0:
                self._mark = self._begin()
            return
        if self._mark is None:
            self._mark = self._begin()
        self._steps.append(record)
        self._ready.append(self._probe.ready_now())
        if len(self._steps) >= self._length:
            self.compute()

    def compute(self) -> WindowStats | None:
        """Close the current window now (if it has steps) and hand it on."""
        if not self._steps:
            return None
        stats = summarize(
            self._steps,
            self._clock,
            index=self._windows,
            label=self.label,
            first_step=self._seen - len(self._steps),
            resources=self._probe.end(self._mark),
            blocks=self._blocks,
            ready=self._ready,
        )
        self._windows += 1
        self._steps = []
        self._ready = []
        self._mark = self._begin()
        self._on_window(stats)
        return stats

    def _begin(self) -> Any:
        """A window starts with no device backlog (steps before it may have left one): its own is what
        ``summarize`` finds at its end."""
        self._clock.settle()
        return self._probe.begin()

    def reset(self, label: str | None = None, skip: int = 0, length: int | None = None, blocks: int = 5) -> None:
        """Drop the unfinished window; ignore the next ``skip`` steps (a configuration change settling), and
        make windows ``length`` steps long (default: ``window``), their noise estimated from ``blocks`` blocks."""
        self._steps = []
        self._ready = []
        self._skip = skip
        self._length = max(self.window, length or 0)
        self._blocks = blocks
        self._mark = self._begin() if self._seen >= self.warmup and skip == 0 else None
        if label is not None:
            self.label = label
