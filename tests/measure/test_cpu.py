import multiprocessing as mp
import time

from pipeopt.measure.cpu import CpuMeter


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_main_process_cpu_is_measured():
    meter = CpuMeter()
    a = meter.snapshot()
    _spin(0.3)
    main, workers = CpuMeter.utilisation(a, meter.snapshot())
    assert main > 50  # one core busy most of the time (the machine may be shared)


def test_child_process_cpu_is_counted_as_workers_live_or_reaped():
    meter = CpuMeter()
    a = meter.snapshot()
    child = mp.get_context("fork").Process(target=_spin, args=(0.4,))
    child.start()
    time.sleep(0.2)
    live = meter.snapshot()
    assert live.workers >= 1
    child.join()
    b = meter.snapshot()
    main, workers = CpuMeter.utilisation(a, b)
    assert workers > 30  # the child spun ~0.4 s of CPU in ~0.4-0.5 s of wall time
    assert b.workers_s >= live.workers_s  # a reaped child's time is not lost


def test_no_elapsed_time_gives_no_figure():
    meter = CpuMeter(clock=lambda: 1.0)
    s = meter.snapshot()
    assert CpuMeter.utilisation(s, s) is None
