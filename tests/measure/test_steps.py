import pytest

from pipeopt.measure.device import HostClock
from pipeopt.measure.steps import StepTimer
from tests.measure.fakes import FakeClock


def _timer(clock):
    records = []
    return StepTimer(clock, HostClock(clock), records.append), records


def _step(timer, clock, *, wait, transfer, compute, other=0.0, samples=8, stepped=True):
    timer.fetch_started()
    clock.advance(wait)
    timer.fetch_stopped()
    timer.transfer_started()
    clock.advance(transfer)
    timer.transfer_stopped()
    timer.compute_started()
    clock.advance(compute)
    timer.compute_stopped()
    timer.batch_ended(samples, optimizer_stepped=stepped)
    clock.advance(other)


def _resolved(record):
    transfer = sum(b - a for a, b in record.transfers)
    compute = sum(b - a for a, b in record.computes)
    return record.wait, transfer, compute, record.total


def test_a_step_runs_from_its_fetch_to_the_next_fetch():
    clock = FakeClock()
    timer, records = _timer(clock)
    _step(timer, clock, wait=0.5, transfer=0.25, compute=1.0, other=0.125)
    assert records == []  # the step's end is the next fetch
    _step(timer, clock, wait=0.0, transfer=0.0, compute=1.0)
    (first,) = records
    assert _resolved(first) == pytest.approx((0.5, 0.25, 1.0, 1.875))
    assert first.samples == 8 and first.micro_batches == 1


def test_gradient_accumulation_is_measured_at_optimizer_step_boundaries():
    clock = FakeClock()
    timer, records = _timer(clock)
    for stepped in (False, False, True, False, False, True):
        _step(timer, clock, wait=0.1, transfer=0.0, compute=0.2, samples=4, stepped=stepped)
    timer.interrupted()
    assert [r.micro_batches for r in records] == [3, 3]
    assert [r.samples for r in records] == [12, 12]
    assert _resolved(records[0]) == pytest.approx((0.3, 0.0, 0.6, 0.9))


def test_validation_between_steps_is_not_counted():
    clock = FakeClock()
    timer, records = _timer(clock)
    _step(timer, clock, wait=0.1, transfer=0.0, compute=0.2)
    timer.interrupted()  # validation starts
    clock.advance(30.0)  # ... and takes a while
    _step(timer, clock, wait=0.1, transfer=0.0, compute=0.2)
    timer.interrupted()
    assert [r.total for r in records] == pytest.approx([0.3, 0.3])


def test_an_interrupted_accumulation_group_is_dropped_and_counted():
    clock = FakeClock()
    timer, records = _timer(clock)
    _step(timer, clock, wait=0.1, transfer=0.0, compute=0.2, stepped=False)
    timer.interrupted()
    assert records == [] and timer.dropped_partial == 1


def test_time_spent_by_the_record_consumer_is_not_charged_to_the_next_step():
    clock = FakeClock()
    records = []

    def slow_consumer(record):
        records.append(record)
        clock.advance(5.0)  # e.g. closing a window and writing to loggers

    timer = StepTimer(clock, HostClock(clock), slow_consumer)
    _step(timer, clock, wait=0.1, transfer=0.0, compute=0.2)
    _step(timer, clock, wait=0.1, transfer=0.0, compute=0.2)
    timer.interrupted()
    assert [r.total for r in records] == pytest.approx([0.3, 0.3])
    assert [r.wait for r in records] == pytest.approx([0.1, 0.1])


def test_samples_unknown_when_a_batch_has_no_tensor():
    clock = FakeClock()
    timer, records = _timer(clock)
    _step(timer, clock, wait=0.1, transfer=0.0, compute=0.2, samples=None)
    timer.interrupted()
    assert records[0].samples is None
