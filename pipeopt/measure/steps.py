"""Per-step timing: turns the training loop's timing points into one record per optimizer step.

A step (with gradient accumulation: every micro-batch up to and including the one that steps the optimizer)
is split into
- ``wait``: host time blocked in ``next()`` on the train loader (what the loop actually waited; batches a
  prefetcher already holds cost nothing here),
- ``transfer``: moving the batch to the device,
- ``compute``: forward + backward + optimizer step,
- ``total``: from the start of the step's first fetch to the start of the next step's first fetch. When the
  loop was interrupted in between (validation, epoch end), the step ends at its own last batch instead, so
  validation and epoch set-up are never counted as training time.
``wait`` and ``total`` are host times. ``transfer`` and ``compute`` come from a device clock (CUDA events on
CUDA) and are resolved later, once per window, so they are kept as pairs of stamps here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeopt.measure.device import DeviceClock

Stamps = tuple[Any, Any]


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step. ``transfers`` / ``computes`` are unresolved device-clock stamp pairs."""

    start: float
    end: float
    wait: float
    transfers: tuple[Stamps, ...]
    computes: tuple[Stamps, ...]
    samples: int | None
    micro_batches: int

    @property
    def total(self) -> float:
        return self.end - self.start


@dataclass
class _Open:
    start: float | None = None
    wait: float = 0.0
    transfers: list[Stamps] = field(default_factory=list)
    computes: list[Stamps] = field(default_factory=list)
    samples: int | None = 0
    micro_batches: int = 0
    done_at: float | None = None  # host time of the batch end that stepped the optimizer


class StepTimer:
    """Receives timing points (from a profiler tap and the callback's hooks) and emits ``StepRecord``s."""

    def __init__(self, clock: Callable[[], float], device_clock: DeviceClock, on_step: Callable[[StepRecord], None]):
        self._clock = clock
        self._device = device_clock
        self._on_step = on_step
        self._open = _Open()
        self._fetch_t0: float | None = None
        self._transfer_t0: Any = None
        self._compute_t0: Any = None
        self.dropped_partial = 0  # accumulation groups cut short by an interruption (not whole steps)

    # -- points from the loop ---------------------------------------------------------------------------
    def fetch_started(self) -> None:
        now = self._clock()
        if self._open.done_at is not None:  # the previous step ran contiguously into this fetch
            self._emit(end=now)
            now = self._clock()  # what the consumers of the record took is pipeopt's, not the next step's
        if self._open.start is None:
            self._open.start = now
        self._fetch_t0 = now

    def fetch_stopped(self) -> None:
        if self._fetch_t0 is not None:
            self._open.wait += self._clock() - self._fetch_t0
            self._fetch_t0 = None

    def transfer_started(self) -> None:
        self._transfer_t0 = self._device.stamp()

    def transfer_stopped(self) -> None:
        if self._transfer_t0 is not None:
            self._open.transfers.append((self._transfer_t0, self._device.stamp()))
            self._transfer_t0 = None

    def compute_started(self) -> None:
        self._compute_t0 = self._device.stamp()

    def compute_stopped(self) -> None:
        if self._compute_t0 is not None:
            self._open.computes.append((self._compute_t0, self._device.stamp()))
            self._compute_t0 = None

    def batch_ended(self, samples: int | None, optimizer_stepped: bool) -> None:
        """A micro-batch finished; ``optimizer_stepped`` closes the optimizer step it belongs to."""
        now = self._clock()
        if self._open.start is None:  # a batch whose fetch we did not see (e.g. a custom fetcher)
            self._open.start = now
        op = self._open
        op.samples = None if samples is None or op.samples is None else op.samples + samples
        op.micro_batches += 1
        if optimizer_stepped:
            op.done_at = now

    def interrupted(self) -> None:
        """Validation or an epoch boundary: the time until the next fetch belongs to no step."""
        if self._open.done_at is not None:
            self._emit(end=self._open.done_at)
        elif self._open.micro_batches:
            self.dropped_partial += 1
        self._open = _Open()
        self._fetch_t0 = self._transfer_t0 = self._compute_t0 = None

    # ---------------------------------------------------------------------------------------------------
    def _emit(self, end: float) -> None:
        op = self._open
        self._open = _Open()
        if op.start is None:
            return
        self._on_step(
            StepRecord(
                start=op.start,
                end=end,
                wait=op.wait,
                transfers=tuple(op.transfers),
                computes=tuple(op.computes),
                samples=op.samples,
                micro_batches=op.micro_batches,
            )
        )
