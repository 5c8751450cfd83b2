import multiprocessing as mp
import os
import sys
import threading
import time

import psutil
import pytest

from pipeopt.measure.cpu import CpuMeter, descendants


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


def test_worker_memory_is_the_childrens_unique_memory():
    from pipeopt.measure.cpu import worker_private_memory

    assert worker_private_memory() is None  # no children
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()

    def hold(ready, done):
        block = bytearray(64 * 2**20)  # 64 MiB written by the child: unique to it
        block[:: 4096] = b"x" * len(block[:: 4096])
        ready.set()
        done.wait(10)

    child = ctx.Process(target=hold, args=(ready, done))
    child.start()
    ready.wait(10)
    try:
        assert 60 * 2**20 < worker_private_memory() < 1024 * 2**20
    finally:
        done.set()
        child.join()


def _fork_a_grandchild(done):
    grandchild = mp.get_context("fork").Process(target=done.wait, args=(10,))
    grandchild.start()
    done.wait(10)
    grandchild.join()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the /proc children files are Linux's")
def test_descendants_are_found_without_reading_every_process(monkeypatch):
    """Children forked by any thread, and theirs, are found from the process's own /proc entries - not by psutil's
    scan of every process (a millisecond or more, twice a window, on a machine running many)."""
    ctx = mp.get_context("fork")
    done = ctx.Event()
    started = []
    child = ctx.Process(target=_fork_a_grandchild, args=(done,))
    thread = threading.Thread(target=lambda: started.append(ctx.Process(target=done.wait, args=(10,))))
    thread.start()
    thread.join()
    child.start()
    started[0].start()
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(child.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)  # the grandchild is being started
        grandchildren = {p.pid for p in psutil.Process(child.pid).children()}
        expected = {p.pid for p in psutil.Process().children(recursive=True)}  # (and any other test's leftovers)
        monkeypatch.setattr(psutil.Process, "children", lambda *a, **k: pytest.fail("scanned every process"))
        found = {p.pid for p in descendants(psutil.Process(os.getpid()))}
        assert grandchildren and {child.pid, started[0].pid} | grandchildren <= found and found == expected
        assert CpuMeter().snapshot().workers == len(expected)
    finally:
        done.set()
        child.join()
        started[0].join()
