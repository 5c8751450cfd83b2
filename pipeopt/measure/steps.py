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

``step_cpu`` is the training process's CPU time over the step outside its fetches: the step's own, its intra-op
threads included, but not their spinning while the loop waits for data (torch's threads busy-wait for work, which
reads as load it is not). ``fetch_cpu`` is the training thread's own CPU time inside the fetches: with no loader
workers, the thread loads the batch there, so it is what loading costs.
"""

from __future__ import annotations

import time
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
    step_cpu: float = 0.0  # CPU seconds of the training process over the step, outside its fetches
    fetch_cpu: float = 0.0  # CPU seconds of the training thread inside its fetches

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
    cpu_start: float = 0.0  # the process's CPU time at the step's start ...
    done_cpu: float = 0.0  # ... and at the batch end that stepped the optimizer
    fetch_process_cpu: float = 0.0  # the process's CPU time inside the fetches
    fetch_cpu: float = 0.0  # the training thread's


class StepTimer:
    """Receives timing points (from a profiler tap and the callback's hooks) and emits ``StepRecord``s."""

    def __init__(self, clock: Callable[[], float], device_clock: DeviceClock, on_step: Callable[[StepRecord], None],
                 *, process_cpu: Callable[[], float] = time.process_time,
                 thread_cpu: Callable[[], float] = time.thread_time) -> None:
        self._clock = clock
        self._process_cpu = process_cpu
        self._thread_cpu = thread_cpu  # the calling (training) thread's CPU time
        self._device = device_clock
        self._on_step = on_step
        self._open = _Open()
        self._fetch_t0: float | None = None
        self._fetch_cpu0 = (0.0, 0.0)  # (process, thread) CPU time at the fetch's start
        self._transfer_t0: Any = None
        self._compute_t0: Any = None
        self.dropped_partial = 0  # accumulation groups cut short by an interruption (not whole steps)

    # -- points from the loop ---------------------------------------------------------------------------
    def fetch_started(self) -> None:
        now, cpu = self._clock(), self._process_cpu()
        if self._open.done_at is not None:  # the previous step ran contiguously into this fetch
            self._emit(end=now, cpu=cpu)
            now, cpu = self._clock(), self._process_cpu()  # what the record's consumers took is pipeopt's
        if self._open.start is None:
            self._open.start, self._open.cpu_start = now, cpu
        self._fetch_t0, self._fetch_cpu0 = now, (cpu, self._thread_cpu())

    def fetch_stopped(self) -> None:
        if self._fetch_t0 is not None:
            op, (process0, thread0) = self._open, self._fetch_cpu0
            op.wait += self._clock() - self._fetch_t0
            op.fetch_process_cpu += self._process_cpu() - process0
            op.fetch_cpu += self._thread_cpu() - thread0
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
            self._open.start, self._open.cpu_start = now, self._process_cpu()
        op = self._open
        op.samples = None if samples is None or op.samples is None else op.samples + samples
        op.micro_batches += 1
        if optimizer_stepped:
            op.done_at, op.done_cpu = now, self._process_cpu()

    def interrupted(self) -> None:
        """Validation or an epoch boundary: the time until the next fetch belongs to no step."""
        if self._open.done_at is not None:
            self._emit(end=self._open.done_at, cpu=self._open.done_cpu)
        elif self._open.micro_batches:
            self.dropped_partial += 1
        self._open = _Open()
        self._fetch_t0 = self._transfer_t0 = self._compute_t0 = None

    # ---------------------------------------------------------------------------------------------------
    def _emit(self, end: float, cpu: float) -> None:
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
                step_cpu=max(0.0, cpu - op.cpu_start - op.fetch_process_cpu),
                fetch_cpu=op.fetch_cpu,
            )
        )
