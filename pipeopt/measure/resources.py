"""What a window used besides time: CPU, device memory, and (with NVML) GPU utilisation and power."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeopt.measure.cpu import CpuMeter, CpuSnapshot
from pipeopt.measure.device import peak_memory_bytes, peak_reserved_bytes, reset_peak_memory
from pipeopt.measure.nvml import NvmlSampler


@dataclass(frozen=True)
class ResourceFigures:
    """Per-window resource figures; None where it could not be measured (see ``gpu_status``)."""

    cpu_main_pct: float | None = None  # training process, 100 = one core
    cpu_workers_pct: float | None = None  # its child processes (loader workers)
    workers: int | None = None  # live child processes at the end of the window
    peak_mem_bytes: int | None = None  # CUDA allocator peak up to the window's end (ResourceProbe: since when)
    gpu_util_pct: float | None = None  # NVML figures below: mean over the window unless named p95 or max
    gpu_mem_used_bytes: int | None = None  # max
    gpu_power_w: float | None = None
    gpu_status: str = "n/a"
    peak_reserved_bytes: int | None = None  # CUDA allocator reserve, peak during the window
    gpu_util_p95_pct: float | None = None
    gpu_power_p95_w: float | None = None
    gpu_power_limit_w: float | None = None
    gpu_temp_c: float | None = None
    gpu_temp_p95_c: float | None = None
    gpu_sm_clock_mhz: float | None = None
    gpu_sm_clock_p95_mhz: float | None = None
    gpu_throttle: str | None = None  # clock event reasons seen in the window, comma-separated ("" for none)


@dataclass(frozen=True)
class Mark:
    t: float
    cpu: CpuSnapshot | None


def _never() -> bool:
    return False


class ResourceProbe:
    """``begin()`` marks a window's start; ``end(mark)`` returns its ``ResourceFigures``.

    CUDA's peak-memory statistics are the user's too (``torch.cuda.max_memory_allocated``, a
    ``DeviceStatsMonitor``): ``begin()`` resets them only where ``resets_peak()`` says a window's own peak is needed
    (the batch plan's windows, whose peaks decide what fits the budget). Elsewhere a window's peak is the allocator's
    peak up to its end since the last reset, pipeopt's or the user's: an upper bound of the window's own.

    ``ready_now()`` is read at every step: the running epoch (its number) and the finished batches waiting in its
    train loader, or None where they cannot be counted."""

    def __init__(
        self,
        device: torch.device,
        *,
        cpu: CpuMeter | None,
        gpu: NvmlSampler | None,
        gpu_status: str,
        ready: Callable[[], tuple[object, int] | None] = lambda: None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.ready_now = ready
        self._clock = clock
        self._device = device
        self._cpu = cpu
        self._gpu = gpu
        self._gpu_status = gpu_status
        self.resets_peak: Callable[[], bool] = _never  # asked once per window, at its start

    def begin(self) -> Mark:
        if self.resets_peak():
            reset_peak_memory(self._device)
        return Mark(self._clock(), self._cpu.snapshot() if self._cpu is not None else None)

    def end(self, mark: Mark) -> ResourceFigures:
        now = self._clock()
        cpu = workers = None
        if self._cpu is not None and mark.cpu is not None:
            snap = self._cpu.snapshot()
            cpu = CpuMeter.utilisation(mark.cpu, snap)
            workers = snap.workers
        gpu = self._gpu.summary(mark.t, now) if self._gpu is not None else None
        return ResourceFigures(
            cpu_main_pct=cpu[0] if cpu else None,
            cpu_workers_pct=cpu[1] if cpu else None,
            workers=workers,
            peak_mem_bytes=peak_memory_bytes(self._device),
            peak_reserved_bytes=peak_reserved_bytes(self._device),
            gpu_status=self._gpu.status if self._gpu is not None else self._gpu_status,
            **(gpu.figures() if gpu else {}),
        )
