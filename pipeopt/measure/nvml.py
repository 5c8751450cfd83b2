"""GPU utilisation, memory, power (and its limit), temperature, SM clock and clock event (throttle) reasons from
NVML, sampled by a background thread.

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


#: NVML's clock event ("throttle") reason bits and what each means (nvml.h, ``nvmlClocksEventReason*``).
CLOCK_EVENTS = {
    0x1: "idle", 0x2: "application clocks", 0x4: "power cap", 0x8: "hardware slowdown", 0x10: "sync boost",
    0x20: "software thermal", 0x40: "hardware thermal", 0x80: "power brake", 0x100: "display clocks",
}


def clock_events(mask: int | None) -> list[str]:
    """The reasons set in an NVML clock event mask, in bit order."""
    return [] if not mask else [name for bit, name in CLOCK_EVENTS.items() if mask & bit]


@dataclass(frozen=True)
class GpuSample:
    t: float
    util_pct: float
    mem_used_bytes: int
    power_w: float | None
    power_limit_w: float | None = None
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    clock_events: int | None = None  # NVML's reason mask


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class GpuSummary:
    """A window's samples: means and 95th percentiles; memory used is the maximum; clock event reasons seen."""

    util_pct: float
    util_p95_pct: float
    mem_used_bytes: int
    power_w: float | None
    power_p95_w: float | None
    power_limit_w: float | None
    temp_c: float | None
    temp_p95_c: float | None
    sm_clock_mhz: float | None
    sm_clock_p95_mhz: float | None
    throttle: str | None
    samples: int

    @classmethod
    def of(cls, samples: list[GpuSample]) -> GpuSummary:
        def series(name: str) -> list[float]:
            return [float(v) for v in (getattr(s, name) for s in samples) if v is not None]

        util, power, temp, clock = series("util_pct"), series("power_w"), series("temp_c"), series("sm_clock_mhz")
        masks = [s.clock_events for s in samples if s.clock_events is not None]
        mask = 0
        for m in masks:
            mask |= m
        return cls(util_pct=_mean(util) or 0.0, util_p95_pct=_p95(util),
                   mem_used_bytes=max(s.mem_used_bytes for s in samples),
                   power_w=_mean(power), power_p95_w=_p95(power) if power else None,
                   power_limit_w=_mean(series("power_limit_w")), temp_c=_mean(temp),
                   temp_p95_c=_p95(temp) if temp else None, sm_clock_mhz=_mean(clock),
                   sm_clock_p95_mhz=_p95(clock) if clock else None,
                   throttle=", ".join(clock_events(mask)) if masks else None, samples=len(samples))

    def figures(self) -> dict[str, Any]:
        """The ``ResourceFigures`` fields this summary fills."""
        return {"gpu_util_pct": self.util_pct, "gpu_util_p95_pct": self.util_p95_pct,
                "gpu_mem_used_bytes": self.mem_used_bytes, "gpu_power_w": self.power_w,
                "gpu_power_p95_w": self.power_p95_w, "gpu_power_limit_w": self.power_limit_w,
                "gpu_temp_c": self.temp_c, "gpu_temp_p95_c": self.temp_p95_c, "gpu_sm_clock_mhz": self.sm_clock_mhz,
                "gpu_sm_clock_p95_mhz": self.sm_clock_p95_mhz, "gpu_throttle": self.throttle}


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

    def _optional(self, query: str, *args: Any) -> Any:
        """A figure not every device or driver reports: None where NVML says so (or the binding lacks the call)."""
        call = getattr(self._nvml, query, None)
        if call is None:
            return None
        try:
            return call(self._handle, *args)
        except (self._nvml.NVMLError_NotSupported, self._nvml.NVMLError_NoPermission):
            return None

    def sample_once(self) -> bool:
        nvml = self._nvml
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            mem = nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            power = self._optional("nvmlDeviceGetPowerUsage")
            limit = self._optional("nvmlDeviceGetEnforcedPowerLimit")
            temp = self._optional("nvmlDeviceGetTemperature", getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
            clock = self._optional("nvmlDeviceGetClockInfo", getattr(nvml, "NVML_CLOCK_SM", 1))
            events = self._optional("nvmlDeviceGetCurrentClocksEventReasons" if hasattr(
                nvml, "nvmlDeviceGetCurrentClocksEventReasons") else "nvmlDeviceGetCurrentClocksThrottleReasons")
        except nvml.NVMLError as err:
            self.status = f"n/a (NVML stopped answering: {err})"
            return False
        self.samples.append(GpuSample(
            self._clock(), float(util), int(mem), None if power is None else power / 1000.0,
            power_limit_w=None if limit is None else limit / 1000.0, temp_c=None if temp is None else float(temp),
            sm_clock_mhz=None if clock is None else float(clock), clock_events=None if events is None else int(events)))
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
        return GpuSummary.of(chosen) if chosen else None
