"""NVML at the edge: a fake module with the real one's error classes (nvidia-ml-py is a dependency)."""

from types import SimpleNamespace
from unittest.mock import MagicMock

import pynvml
import pytest

from pipeopt.measure.nvml import NO_DRIVER, SAMPLED, NvmlSampler, open_nvml
from tests.measure.fakes import FakeClock


def fake_nvml(init_error=None):
    fake = MagicMock(spec=pynvml)
    for name in ("NVMLError", "NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NotSupported",
                 "NVMLError_NoPermission", "NVMLError_GpuIsLost"):
        setattr(fake, name, getattr(pynvml, name))
    if init_error is not None:
        fake.nvmlInit.side_effect = init_error
    fake.nvmlDeviceGetUtilizationRates.return_value = SimpleNamespace(gpu=87, memory=40)
    fake.nvmlDeviceGetMemoryInfo.return_value = SimpleNamespace(used=3 * 2**30, total=80 * 2**30, free=77 * 2**30)
    fake.nvmlDeviceGetPowerUsage.return_value = 250_000  # milliwatts
    fake.nvmlDeviceGetEnforcedPowerLimit.return_value = 700_000
    fake.nvmlDeviceGetTemperature.return_value = 60
    fake.nvmlDeviceGetClockInfo.return_value = 1980
    fake.nvmlDeviceGetCurrentClocksEventReasons.return_value = 0
    return fake


def test_no_driver_is_reported_as_such():
    nvml, status = open_nvml(fake_nvml(pynvml.NVMLError_LibraryNotFound()))
    assert nvml is None and status == NO_DRIVER == "n/a (no NVIDIA driver)"


def test_other_nvml_start_failures_say_what_failed():
    nvml, status = open_nvml(fake_nvml(pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)))
    assert nvml is None and status.startswith("n/a (NVML failed to start:")


def test_this_machine_without_a_driver():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert open_nvml() == (None, NO_DRIVER)
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present here; the absent-driver path is covered by the fake above")


def test_sampled_figures_over_a_window():
    fake = fake_nvml()
    assert open_nvml(fake) == (fake, SAMPLED)
    clock = FakeClock(0.0)
    sampler = NvmlSampler(fake, handle="gpu0", interval_s=0.25, clock=clock)
    for util, used in ((50, 2 * 2**30), (90, 3 * 2**30), (100, 5 * 2**30)):
        clock.advance(0.25)
        fake.nvmlDeviceGetUtilizationRates.return_value = SimpleNamespace(gpu=util, memory=0)
        fake.nvmlDeviceGetMemoryInfo.return_value = SimpleNamespace(used=used, total=0, free=0)
        assert sampler.sample_once()
    summary = sampler.summary(0.5, 0.75)  # samples at 0.5 and 0.75, plus 0.25 (the one before the window)
    assert summary.samples == 3
    assert summary.util_pct == pytest.approx(80.0)
    assert summary.mem_used_bytes == 5 * 2**30
    assert summary.power_w == pytest.approx(250.0)
    assert sampler.summary(10.0, 11.0) is None


def test_health_over_a_window_mean_p95_and_clock_events():
    fake = fake_nvml()
    clock = FakeClock(0.0)
    sampler = NvmlSampler(fake, handle="gpu0", interval_s=0.1, clock=clock)
    temps = [60, 61, 62, 63, 64, 65, 66, 67, 68, 90]
    for i, temp in enumerate(temps):
        clock.advance(0.1)
        fake.nvmlDeviceGetTemperature.return_value = temp
        fake.nvmlDeviceGetClockInfo.return_value = 1980 if i < 5 else 1500
        fake.nvmlDeviceGetCurrentClocksEventReasons.return_value = 0x4 | 0x40 if temp == 90 else 0
        assert sampler.sample_once()
    s = sampler.summary(0.1, 1.0)
    assert s.temp_c == pytest.approx(sum(temps) / 10) and s.temp_p95_c == 90
    assert s.sm_clock_mhz == pytest.approx(1740.0) and s.sm_clock_p95_mhz == 1980
    assert s.power_limit_w == pytest.approx(700.0)
    assert s.throttle == "power cap, hardware thermal"
    figures = s.figures()
    assert figures["gpu_temp_p95_c"] == 90 and figures["gpu_throttle"] == "power cap, hardware thermal"


def test_figures_a_device_does_not_report_are_none_not_zero():
    fake = fake_nvml()
    fake.nvmlDeviceGetTemperature.side_effect = pynvml.NVMLError_NotSupported()
    fake.nvmlDeviceGetEnforcedPowerLimit.side_effect = pynvml.NVMLError_NoPermission()
    sampler = NvmlSampler(fake, handle="gpu0", clock=FakeClock(1.0))
    assert sampler.sample_once()
    s = sampler.summary(0.0, 2.0)
    assert s.temp_c is None and s.temp_p95_c is None and s.power_limit_w is None
    assert s.util_pct == 87 and s.throttle == ""  # sampled, no clock event


def test_driver_lost_mid_run_stops_sampling_and_says_why():
    fake = fake_nvml()
    sampler = NvmlSampler(fake, handle="gpu0", interval_s=0.01)
    fake.nvmlDeviceGetUtilizationRates.side_effect = pynvml.NVMLError_GpuIsLost()
    sampler.start()
    sampler._thread.join(timeout=5)
    assert not sampler._thread.is_alive()
    assert sampler.status.startswith("n/a (NVML stopped answering")
    sampler.stop()


def test_the_background_thread_samples_and_stops():
    fake = fake_nvml()
    sampler = NvmlSampler(fake, handle="gpu0", interval_s=0.01)
    sampler.start()
    import time

    deadline = time.monotonic() + 5
    while len(sampler.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert len(sampler.samples) >= 3
    assert sampler._thread is None
    fake.nvmlShutdown.assert_called_once()
