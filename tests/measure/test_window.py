import pytest

from pipeopt.measure.device import HostClock
from pipeopt.measure.steps import StepRecord
from pipeopt.measure.window import WindowMeter, summarize
from tests.measure.fakes import FakeClock, NullProbe


def record(start, *, wait=0.1, transfer=0.05, compute=0.3, total=0.5, samples=10, step_cpu=0.0, fetch_cpu=0.0):
    return StepRecord(
        start=start,
        end=start + total,
        wait=wait,
        transfers=((start + wait, start + wait + transfer),),
        computes=((start + 0.2, start + 0.2 + compute),),
        samples=samples,
        micro_batches=1,
        step_cpu=step_cpu,
        fetch_cpu=fetch_cpu,
    )


def test_summary_figures():
    recs = [record(0.0, step_cpu=0.4, fetch_cpu=0.1), record(0.5, total=1.5, wait=1.1, step_cpu=0.6, fetch_cpu=0.3)]
    w = summarize(recs, HostClock(), index=0, label="observe", first_step=5, resources=NullProbe().end(None))
    assert w.steps == 2 and w.samples == 20 and w.first_step == 5
    assert w.duration_s == pytest.approx(2.0)
    assert w.step_time_s == pytest.approx(1.0)
    assert w.step_time_std_s == pytest.approx(0.5)
    assert w.samples_per_s == pytest.approx(10.0)
    assert w.steps_per_s == pytest.approx(1.0)
    assert w.data_wait_frac == pytest.approx(1.2 / 2.0)
    assert w.transfer_frac == pytest.approx(0.1 / 2.0)
    assert w.busy_frac == pytest.approx(0.6 / 2.0)
    assert w.input_free_step_s == pytest.approx(1.0 - 0.6)
    assert (w.step_cpu_s, w.fetch_cpu_s) == pytest.approx((0.5, 0.2))  # per step


class Behind(HostClock):
    """A device running behind the host: ``settle`` waits out (and returns) the backlog queued so far."""

    def __init__(self) -> None:
        super().__init__(FakeClock())
        self.backlog = 0.0

    def settle(self) -> float:
        waited, self.backlog = self.backlog, 0.0
        return waited


def test_the_devices_backlog_at_a_windows_end_is_part_of_its_steps():
    """On CUDA the host runs ahead of the device: the steps' host times (2 s here) miss the 2 s of work still queued
    at the window's end. It counts: twice the step time, half the rate, and the step's spread stretched alike."""
    clock = Behind()
    clock.backlog = 2.0
    recs = [record(0.0), record(0.5, total=1.5, wait=1.1)]
    w = summarize(recs, clock, index=0, label="observe", first_step=0, resources=NullProbe().end(None))
    assert w.duration_s == pytest.approx(4.0) and w.step_time_s == pytest.approx(2.0)
    assert w.step_time_std_s == pytest.approx(1.0)
    assert w.samples_per_s == pytest.approx(5.0) and w.busy_frac == pytest.approx(0.6 / 4.0)
    assert w.data_wait_frac == pytest.approx(1.2 / 4.0)


def test_a_window_starts_with_no_backlog_so_it_counts_only_its_own():
    """Work queued before a window (the warm-up's, a settling step's) is waited out as it starts, not counted in it."""
    clock, windows = Behind(), []
    meter = WindowMeter(window=2, warmup=1, clock=clock, probe=NullProbe(), on_window=windows.append)
    clock.backlog = 7.0  # left by the warm-up step: drained as the first window starts
    meter.update(record(0.0))
    meter.update(record(1.0))
    clock.backlog = 1.0  # the window's own
    meter.update(record(2.0))
    meter.reset("trial", skip=1)
    clock.backlog = 9.0  # left by the settling step, drained as the trial's window starts after it
    meter.update(record(3.0))
    for start in (4.0, 5.0):
        meter.update(record(start))
    assert [(w.label, w.duration_s) for w in windows] == [("observe", pytest.approx(2.0)),
                                                          ("trial", pytest.approx(1.0))]


def test_samples_per_second_is_unknown_when_samples_are():
    w = summarize([record(0.0, samples=None)], HostClock(), index=0, label="x", first_step=0,
                  resources=NullProbe().end(None))
    assert w.samples is None and w.samples_per_s is None and w.steps_per_s == pytest.approx(2.0)


def test_meter_skips_warmup_and_groups_windows():
    windows = []
    meter = WindowMeter(window=3, warmup=2, clock=HostClock(FakeClock()), probe=NullProbe(), on_window=windows.append)
    for i in range(2 + 3 * 2 + 1):
        meter.update(record(float(i)))
    assert [(w.index, w.first_step, w.steps) for w in windows] == [(0, 2, 3), (1, 5, 3)]
    assert meter.pending_steps == 1 and meter.steps_seen == 9
    last = meter.compute()
    assert last is not None and (last.first_step, last.steps) == (8, 1)
    assert meter.compute() is None


def test_reset_drops_the_unfinished_window_and_relabels():
    windows = []
    meter = WindowMeter(window=2, warmup=0, clock=HostClock(), probe=NullProbe(), on_window=windows.append)
    meter.update(record(0.0, total=100.0))
    meter.reset(label="trial")
    meter.update(record(1.0))
    meter.update(record(2.0))
    assert len(windows) == 1 and windows[0].label == "trial"
    assert windows[0].step_time_s == pytest.approx(0.5)


def test_roundtrip_to_dict():
    w = summarize([record(0.0)], HostClock(), index=0, label="observe", first_step=0, resources=NullProbe().end(None))
    from pipeopt.measure.window import WindowStats

    assert WindowStats.from_dict(w.to_dict()) == w


def test_reset_can_skip_steps_that_are_settling():
    windows = []
    meter = WindowMeter(window=2, warmup=0, clock=HostClock(), probe=NullProbe(), on_window=windows.append)
    meter.reset(label="trial", skip=3)
    for i in range(3):
        meter.update(record(float(i), total=50.0))  # the old loader's batches and the new workers' start-up
    meter.update(record(3.0))
    meter.update(record(4.0))
    assert [(w.label, w.first_step, w.step_time_s) for w in windows] == [("trial", 3, pytest.approx(0.5))]


def _supplied(ready_counts, epochs=None):
    """50 steps of 0.5 s, one batch of 10 samples each, with these ready-batch readings after each step."""
    epochs = epochs or [EPOCH] * len(ready_counts)
    recs = [record(i * 0.5) for i in range(len(ready_counts))]
    return summarize(recs, HostClock(), index=0, label="trial", first_step=0, resources=NullProbe().end(None),
                     ready=list(zip(epochs, ready_counts)))


EPOCH = object()


def test_a_window_living_off_a_prefetched_stock_is_rated_by_what_its_loader_supplied():
    drained = _supplied([20 - i * 10 // 50 for i in range(50)])  # the stock falls by 10 batches over 50 steps
    assert drained.batches == 50
    assert drained.samples_per_s == pytest.approx(20.0)  # what the step consumed
    assert drained.supply_ratio == pytest.approx(40 / 50, rel=0.05)
    assert drained.sustained_per_s == pytest.approx(20.0 * 40 / 50, rel=0.05)  # what the loader kept up with


def test_a_saw_toothing_stock_does_not_move_the_rate():
    saw = _supplied([8 - (i % 8) for i in range(48)])  # workers taking turns: 8, 7, ... 1, 8, 7, ...
    assert saw.sustained_per_s == pytest.approx(20.0, rel=0.04)


def test_a_growing_stock_is_no_credit():
    grew = _supplied([10 + i // 5 for i in range(50)])  # supply outran consumption by 20 %: the step set the pace
    assert grew.supply_ratio == pytest.approx(1.2, rel=0.02)
    assert grew.sustained_per_s == pytest.approx(20.0)


@pytest.mark.parametrize("case", ["uncounted", "new epoch", "too short", "short for its stock"])
def test_supply_is_unknown_without_a_reading_at_every_step_of_one_epoch(case):
    counts = [5] * 10
    if case == "uncounted":
        recs = [record(i * 0.5) for i in range(10)]
        w = summarize(recs, HostClock(), index=0, label="x", first_step=0, resources=NullProbe().end(None),
                      ready=[(EPOCH, 5)] * 9 + [None])
    elif case == "new epoch":
        w = _supplied(counts, epochs=[EPOCH] * 5 + [object()] * 5)
    elif case == "too short":
        w = _supplied(counts[:2])
    else:
        w = _supplied([6, 5, 4, 3, 2])  # 5 batches taken from a stock of 6: no refill seen, but none expected yet
    assert w.supply_ratio is None
    assert w.sustained_per_s == pytest.approx(w.samples_per_s)


def test_only_the_wait_of_fetches_that_found_no_batch_ready_is_starved():
    waits, ready = [0.3, 0.05, 0.05, 0.3, 0.05], [0, 2, 1, 0, 3]  # a step's wait follows the reading before it
    recs = [record(i * 0.5, wait=w) for i, w in enumerate(waits)]
    w = summarize(recs, HostClock(), index=0, label="x", first_step=0, resources=NullProbe().end(None),
                  ready=[(EPOCH, r) for r in ready])
    assert w.data_wait_frac == pytest.approx(0.75 / 2.5)
    # steps 2-5 (the first has no reading before it): step 2 followed an empty stock, as did step 5
    assert w.starved_wait_frac == pytest.approx((0.05 + 0.05) / 2.0)
    # where a reading is missing, nothing is known
    unread = summarize(recs, HostClock(), index=0, label="x", first_step=0, resources=NullProbe().end(None),
                       ready=[(EPOCH, 1)] * 4 + [None])
    assert unread.starved_wait_frac is None


def test_the_meter_reads_the_ready_batches_at_every_step():
    class Counting(NullProbe):
        def __init__(self):
            super().__init__()
            self.n = 0

        def ready_now(self):
            self.n += 1
            return (EPOCH, 15 - self.n // 3)  # one batch less ready every third step

    seen = []
    meter = WindowMeter(window=30, warmup=0, clock=HostClock(), probe=Counting(), on_window=seen.append)
    for i in range(30):
        meter.update(record(i * 0.5))
    assert seen[0].supply_ratio == pytest.approx(2 / 3, rel=0.05)  # a third of the batches came from the stock
