"""The CUDA event clock's arithmetic against a simulated device that runs queued work in order (``record`` is the
seam: the events here carry the device time at which the device reaches them)."""

import pytest

from pipeopt.measure.device import CudaEventClock
from tests.measure.fakes import FakeClock


class Device:
    """Work is queued by the host and run in order: each kernel starts once the device is free."""

    def __init__(self, host: FakeClock) -> None:
        self.host, self.free_at = host, 0.0

    def kernel(self, seconds: float) -> None:
        self.free_at = max(self.free_at, self.host.t) + seconds

    def event(self) -> "Event":
        return Event(self, max(self.free_at, self.host.t))


class Event:
    def __init__(self, device: Device, at: float) -> None:
        self.device, self.at = device, at

    def synchronize(self) -> None:
        self.device.host.t = max(self.device.host.t, self.at)

    def elapsed_time(self, other: "Event") -> float:
        return (other.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event has it


def steps(clock: CudaEventClock, device: Device, n: int, *, kernel_s: float, host_s: float) -> None:
    for _ in range(n):
        clock.stamp()
        device.kernel(kernel_s)
        clock.stamp()
        device.host.t += host_s


@pytest.mark.parametrize("drained_before", [False, True])
def test_settle_finds_how_far_the_device_ran_behind_whoever_waited_for_it(drained_before):
    """20 steps of one 20 ms kernel launched 1 ms apart: the device finishes 381 ms after the host's last stamp.
    A ``.item()`` (or the fit's end) that waited first does not hide it."""
    host = FakeClock(0.0)
    device = Device(host)
    clock = CudaEventClock(None, host=host, record=device.event)  # type: ignore[arg-type]
    steps(clock, device, 20, kernel_s=0.020, host_s=0.001)
    if drained_before:
        host.t = device.free_at + 5.0
    assert clock.settle() == pytest.approx(0.400 - 0.019)
    assert clock.settle() == 0.0  # nothing stamped since


def test_a_device_that_keeps_up_is_behind_only_by_the_last_steps_own_work():
    """Input-bound (the device waits for the host): the settle finds only the last step's 2 ms kernel still running
    - at most one step's device time, which a window of 20 or more steps carries as a bias of 5 % of its compute
    share at worst - and each settle counts from its own first stamp."""
    host = FakeClock(0.0)
    device = Device(host)
    clock = CudaEventClock(None, host=host, record=device.event)  # type: ignore[arg-type]
    steps(clock, device, 10, kernel_s=0.002, host_s=0.010)
    assert clock.settle() == pytest.approx(0.002)
    steps(clock, device, 5, kernel_s=0.030, host_s=0.010)  # then it falls behind by 20 ms a step
    assert clock.settle() == pytest.approx(5 * 0.030 - 4 * 0.010)
