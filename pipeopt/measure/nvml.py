"""GPU utilisation, memory and power from NVML, sampled by a background thread.

NVML comes from ``nvidia-ml-py`` (imported as ``pynvml``). Where it cannot work - no NVIDIA driver, the package
missing, a CPU run - nothing is sampled and the report says why ("n/a (no NVIDIA driver)").
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

NO_DRIVER = "n/a (no NVIDIA driver)"
NOT_INSTALLED = "n/a (nvidia-ml-py not installed: pip install nvidia-ml-py)"
NOT_CUDA = "n/a (the run is not on a CUDA device)"
SAMPLED = "sampled"


def open_nvml(nvml: ModuleType | None = None) -> tuple[ModuleType | None, str]:
    """Import (unless given) and initialise NVML: ``(module, SAMPLED)`` or ``(None, reason)``."""
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return None, NOT_INSTALLED
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except (nvml.NVMLError_LibraryNotFound, nvml.NVMLError_DriverNotLoaded):
        return None, NO_DRIVER
    except nvml.NVMLError as err:
        return None, f"n/a (NVML failed to start: {err})"
    return nvml, SAMPLED


def device_handle(nvml: ModuleType, device: torch.device) -> Any:
    """The NVML handle of a CUDA device, by UUID (NVML ignores CUDA_VISIBLE_DEVICES), else by visible index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except nvml.NVMLError:
            pass  # fall back to the index below
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if ids and all(v.isdigit() for v in ids) and index < len(ids):
        index = int(ids[index])
    return nvml.nvmlDeviceGetHandleByIndex(index)


@dataclass(frozen=True)
class GpuSample:
    t: float
    util_pct: float
    mem_used_bytes: int
    power_w: float | None


@dataclass(frozen=True)
class GpuSummary:
    util_pct: float
    mem_used_bytes: int
    power_w: float | None
    samples: int


class NvmlSampler:
    """Samples one GPU every ``interval_s`` on a daemon thread. An NVML error mid-run stops sampling, not training."""

    def __init__(
        self,
        nvml: ModuleType,
        handle: Any,
        *,
        interval_s: float = 0.2,
        clock: Callable[[], float] = time.perf_counter,
        max_samples: int = 20_000,
    ) -> None:
        self._nvml = nvml
        self._handle = handle
        self._interval = interval_s
        self._clock = clock
        self.samples: collections.deque[GpuSample] = collections.deque(maxlen=max_samples)
        self.status = SAMPLED
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> bool:
        nvml = self._nvml
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            mem = nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            try:
                power = nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
            except nvml.NVMLError_NotSupported:
                power = None
        except nvml.NVMLError as err:
            self.status = f"n/a (NVML stopped answering: {err})"
            return False
        self.samples.append(GpuSample(self._clock(), float(util), int(mem), power))
        return True

    def _run(self) -> None:
        while self.sample_once() and not self._stop.wait(self._interval):
            pass

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pipeopt-nvml", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass  # the driver went away; there is nothing left to release

    def summary(self, t0: float, t1: float) -> GpuSummary | None:
        """Samples taken during [t0, t1] (and the one just before, so windows shorter than the interval get one)."""
        chosen = [s for s in list(self.samples) if t0 - self._interval <= s.t <= t1]
        if not chosen:
            return None
        powers = [s.power_w for s in chosen if s.power_w is not None]
        return GpuSummary(
            util_pct=sum(s.util_pct for s in chosen) / len(chosen),
            mem_used_bytes=max(s.mem_used_bytes for s in chosen),
            power_w=sum(powers) / len(powers) if powers else None,
            samples=len(chosen),
        )
