"""The capacity model of the loader, fitted to synthetic windows: what it predicts from the before-window alone, and
after one window with workers, on latency-bound, CPU-bound and memory-bound pipelines."""

import pytest

from pipeopt.tuning import capacity
from pipeopt.tuning.loader_search import LoaderSettings
from tests.tuning.worlds import CPU_BOUND, GIB, LATENCY, MEMORY_BOUND

USER = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False)


def workers(n):
    return USER.with_workers(n, persistent=True)


def test_the_before_window_gives_the_step_and_the_main_process_loading_rates():
    model = capacity.fit([LATENCY(USER)], cpus=2)
    assert model.step_rate == pytest.approx(1000.0)
    assert model.loader_rate == pytest.approx(100.0)
    assert model.rate(0) == pytest.approx(LATENCY.rate(0))
    assert model.cpu_limit is None  # a worker's CPU is not measured yet
    assert model.best(64) == 4  # 10 would reach the step's rate, but two per CPU until a worker's CPU is measured


def test_latency_bound_after_one_window_with_workers():
    model = capacity.fit([LATENCY(USER), LATENCY(workers(4))], cpus=2)
    assert model.loader_rate == pytest.approx(100.0)  # 400/s from 4 workers
    assert model.cpu_limit == pytest.approx(2 / 0.0012)
    assert model.best(64) == LATENCY.best()[0] == 10
    assert model.rate(10) == pytest.approx(LATENCY.best()[1])


def test_cpu_bound_the_cpus_cap_the_rate_whatever_the_count():
    model = capacity.fit([CPU_BOUND(USER), CPU_BOUND(workers(4))], cpus=2)
    assert model.cpu_limit == pytest.approx(400.0)
    assert model.rate(4) == pytest.approx(CPU_BOUND.best()[1]) == pytest.approx(model.rate(16))
    assert model.rate(model.best(64)) == pytest.approx(CPU_BOUND.best()[1])


def test_memory_bound_the_count_the_memory_holds():
    model = capacity.fit([MEMORY_BOUND(USER), MEMORY_BOUND(workers(4))], cpus=2, memory_bytes=5 * GIB)
    assert model.most_workers(64) == 2
    assert model.best(64) == 2


def test_a_window_that_no_longer_waits_keeps_the_loader_rate_it_had():
    fast = LATENCY(workers(16))  # 16 x 100 > 1000: the step's pace, no wait to read a loader's rate from
    model = capacity.fit([LATENCY(USER), fast], cpus=2)
    assert model.loader_rate == pytest.approx(100.0)  # still the main process's figure, the latest supply-bound one
    assert model.best(64) == 10


def test_nothing_measured_no_model():
    assert capacity.fit([], cpus=2) is None
