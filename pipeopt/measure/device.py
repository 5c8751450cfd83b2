"""Device clocks and memory: where the step's work is timed and how much memory it peaked at.

A clock hands out *stamps* and turns a pair of stamps into seconds. On CPU the host clock is the device clock.
On CUDA, work is asynchronous: a host timestamp taken after launching a step measures the launch, not the work.
``CudaEventClock`` records CUDA events on the current stream instead, and resolves them once per window
(``settle``), so the device time is counted where it happens without a host synchronisation on every step.
``settle`` also says how long it waited: the device's backlog, work the host launched that the device had not yet
done (the window meter adds it to the window that launched it).
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
    """Stamps are timing events recorded on the device's current stream."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._last: torch.cuda.Event | None = None

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        self._last = event
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def settle(self) -> float:
        """Wait until the last recorded event has happened, so every earlier pair can be resolved; the seconds
        waited (the device's backlog)."""
        if self._last is None:
            return 0.0
        started = time.perf_counter()
        self._last.synchronize()
        return time.perf_counter() - started


def clock_for(device: torch.device, host: Callable[[], float] = time.perf_counter) -> DeviceClock:
    return CudaEventClock(device) if device.type == "cuda" else HostClock(host)


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
