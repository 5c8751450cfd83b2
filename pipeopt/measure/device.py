"""Device clocks and memory: where the step's work is timed and how much memory it peaked at.

A clock hands out *stamps* and turns a pair of stamps into seconds. On CPU the host clock is the device clock.
On CUDA, work is asynchronous: a host timestamp taken after launching a step measures the launch, not the work.
``CudaEventClock`` records CUDA events on the current stream instead, and resolves them once per window
(``settle``), so the device time is counted where it happens without a host synchronisation on every step.
``settle`` also says how far the device ran behind the host: work launched that it had not yet done (the window
meter adds it to the window that launched it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch


class DeviceClock(Protocol):
    def stamp(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...

    def settle(self) -> float: ...


class HostClock:
    """Stamps are host times (``time.perf_counter`` unless a clock is injected)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock

    def stamp(self) -> float:
        return self._clock()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def settle(self) -> float:
        return 0.0  # the host's work is done when its timestamp is taken


class CudaEventClock:
    """Stamps are timing events recorded on the device's current stream (``record`` makes and records one)."""

    def __init__(self, device: torch.device, *, host: Callable[[], float] = time.perf_counter,
                 record: Callable[[], Any] | None = None) -> None:
        self._record = record if record is not None else lambda: _recorded_event(device)
        self._host = host
        self._first: tuple[Any, float] | None = None  # the first stamp since the last settle, and its host time
        self._last: tuple[Any, float] | None = None

    def stamp(self) -> Any:
        event = self._record()
        self._last = (event, self._host())
        if self._first is None:
            self._first = self._last
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1e3

    def settle(self) -> float:
        """Wait until the last recorded event has happened, so every earlier pair can be resolved. Returns the
        device's backlog at that event: how much later the device reached it than the host recorded it, counted
        from the first stamp since the last settle (the device then had nothing queued, so it reached that one at
        once). The same whoever waited it out - this call, or a ``.item()`` or the fit's end before it."""
        if self._first is None or self._last is None:
            return 0.0
        (first, first_host), (last, last_host) = self._first, self._last
        self._first = None
        last.synchronize()
        return max(0.0, self.seconds(first, last) - (last_host - first_host))


def _recorded_event(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def clock_for(device: torch.device, host: Callable[[], float] = time.perf_counter) -> DeviceClock:
    return CudaEventClock(device, host=host) if device.type == "cuda" else HostClock(host)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated device memory since CUDA's peak statistics were last reset; None where the device has no
    allocator stats."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def peak_reserved_bytes(device: torch.device) -> int | None:
    """Peak memory the CUDA caching allocator reserved since CUDA's peak statistics were last reset (None
    elsewhere)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_reserved(device))


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device (None elsewhere)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
