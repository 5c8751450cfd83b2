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


def test_cpu_is_split_into_the_threads_loading_inside_the_fetch_and_the_processs_step_outside_it():
    clock, process, thread = FakeClock(), FakeClock(), FakeClock()
    records = []
    timer = StepTimer(clock, HostClock(clock), records.append, process_cpu=process, thread_cpu=thread)
    for load_cpu in (0.03, 0.05):
        timer.fetch_started()
        clock.advance(0.1)  # the fetch: 0.1 s of wall time, of which ``load_cpu`` is the training thread loading ...
        thread.advance(load_cpu)
        process.advance(load_cpu + 0.06)  # ... while the process's idle intra-op threads spin for 60 ms
        timer.fetch_stopped()
        timer.compute_started()
        clock.advance(0.2)
        process.advance(0.25)  # the step: the training thread and its intra-op threads
        thread.advance(0.15)
        timer.compute_stopped()
        timer.batch_ended(8, optimizer_stepped=True)
    timer.interrupted()  # the epoch ends: the last step ends at its own batch
    assert [(r.fetch_cpu, r.step_cpu) for r in records] == [pytest.approx((0.03, 0.25)), pytest.approx((0.05, 0.25))]
