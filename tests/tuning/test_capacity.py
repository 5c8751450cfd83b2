"""The capacity model of the loader, fitted to synthetic windows: what it predicts from the before-window alone, and
after one window with workers, on latency-bound, CPU-bound and memory-bound pipelines."""

import dataclasses
import math

import pytest

from pipeopt.tuning import capacity
from pipeopt.tuning.loader_search import LoaderSettings
from tests.tuning.worlds import CONTENDED, CPU_BOUND, GIB, LATENCY, MEMORY_BOUND, RECEIVING, World

USER = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False)


def workers(n):
    return USER.with_workers(n, persistent=True)


def test_the_before_window_gives_the_step_the_main_process_loading_rate_and_what_loading_costs():
    model = capacity.fit([LATENCY(USER)], cpus=2)
    assert model.step_rate == pytest.approx(1000.0)
    assert model.loader_rate == pytest.approx(100.0)
    assert model.rate(0) == pytest.approx(LATENCY.rate(0))
    assert (model.load_cpu, model.step_cpu) == (LATENCY.load_cpu, LATENCY.main_cpu)
    assert model.cpu_limit == pytest.approx(2 / 0.0012)


def test_latency_bound_the_pick_reaches_the_steps_rate_from_the_before_window_alone():
    model = capacity.fit([LATENCY(USER)], cpus=2)
    best_n, best_rate = LATENCY.best()
    pick = model.best(64)
    assert model.rate(pick) == pytest.approx(best_rate) == pytest.approx(LATENCY.rate(pick))
    # the step's rate read from a window that waited is a lower bound: the pick aims HEADROOM above it
    assert pick == math.ceil((1 - capacity.CLOSE_ENOUGH) * capacity.HEADROOM * best_n)


def test_the_training_processs_spinning_threads_do_not_cap_the_workers():
    trial = LATENCY(workers(4))  # waited 60 %: the process's CPU reads a whole core though the step uses 40 %
    assert trial.cpu_main_pct == pytest.approx(100.0)  # read as the step's, it would cap the rate at 2 / 2.7 ms
    model = capacity.fit([LATENCY(USER), trial], cpus=2)
    assert model.cpu_limit == pytest.approx(2 / 0.0012)
    assert model.rate(model.best(64)) == pytest.approx(LATENCY.best()[1])


def test_cpu_bound_the_cpus_cap_the_rate_whatever_the_count():
    model = capacity.fit([CPU_BOUND(USER)], cpus=2)  # loading a sample costs 4 ms in the before-window's fetch
    assert model.cpu_limit == pytest.approx(400.0)
    assert model.rate(4) == pytest.approx(CPU_BOUND.best()[1]) == pytest.approx(model.rate(16))
    pick = model.best(64)
    assert pick == CPU_BOUND.best()[0] == 2  # no more workers than the CPUs can keep loading
    assert model.rate(pick) == pytest.approx(CPU_BOUND.best()[1])


def test_the_steps_cpu_is_the_least_a_window_measured_not_its_spin_beside_workers():
    trial = CONTENDED(workers(3))  # beside 3 workers the step burns 0.6 ms of CPU a sample, half of it spinning
    assert trial.step_cpu_s == pytest.approx(0.0006)
    assert trial.rate.value == pytest.approx(2 / 0.0016)  # the CPUs are spent at that cost
    model = capacity.fit([CONTENDED(USER), trial], cpus=2)
    assert model.step_cpu == CONTENDED.main_cpu  # the before-window's: no worker beside the step
    assert model.cpu_limit == pytest.approx(2 / 0.0013)
    pick = model.best(64)  # read at 0.6 ms, the CPU limit would be the rate 3 workers just measured: no gain
    assert pick > 3 and model.rate(pick) > 1.1 * trial.rate.value
    assert CONTENDED.rate(pick) > 1.05 * trial.rate.value  # and more workers do take that spin back


def test_memory_bound_the_count_the_memory_holds():
    model = capacity.fit([MEMORY_BOUND(USER), MEMORY_BOUND(workers(4))], cpus=2, memory_bytes=5 * GIB)
    assert model.most_workers(64) == 2
    assert model.best(64) == 2


def test_until_a_worker_is_measured_the_training_processs_private_memory_stands_in_for_it():
    before = capacity.fit([MEMORY_BOUND(USER)], cpus=2, memory_bytes=5 * GIB, training_mem_bytes=2 * GIB)
    assert before.most_workers(64) == 2 and before.best(64) == 2
    measured = capacity.fit([MEMORY_BOUND(USER), MEMORY_BOUND(workers(2))], cpus=2, memory_bytes=5 * GIB,
                            training_mem_bytes=4 * GIB)  # the measured worker (2 GiB) replaces the stand-in
    assert measured.most_workers(64) == 2


def test_a_pick_held_below_its_aim_says_what_held_it():
    before = capacity.fit([MEMORY_BOUND(USER)], cpus=2, memory_bytes=5 * GIB, training_mem_bytes=2 * GIB)
    assert before.best(64) == 2
    assert before.held_back(64) == ("it aims for 13, but 2 fit the 5.0 GiB workers may take at 2.0 GiB each "
                                    "(the training process's private memory, until a worker is measured)")
    measured = capacity.fit([MEMORY_BOUND(USER), MEMORY_BOUND(workers(2))], cpus=2, memory_bytes=5 * GIB)
    assert measured.held_back(64).endswith("at 2.0 GiB each (measured)")
    free = capacity.fit([LATENCY(USER)], cpus=2)
    assert free.best(64) == 13 and free.held_back(64) is None  # the pick is what it aims for
    assert free.held_back(4) == "it aims for 13, but 4 is the most pipeopt starts"


def test_a_window_that_no_longer_waits_keeps_the_loader_rate_it_had():
    fast = LATENCY(workers(16))  # 16 x 100 > 1000: the step's pace, no wait to read a loader's rate from
    model = capacity.fit([LATENCY(USER), fast], cpus=2)
    assert model.loader_rate == pytest.approx(100.0)  # still the main process's figure, the latest supply-bound one
    assert model.rate(model.best(64)) == pytest.approx(LATENCY.best()[1])


def test_a_faster_step_seen_with_workers_raises_the_pick():
    # the before-window's step reads slow (it paid for waiting); a window with workers that still waits shows more
    slow_read = World(step_rate=600.0, loader_rate=100.0, cpus=2, main_cpu=0.001, load_cpu=0.0002)
    first = capacity.fit([slow_read(USER)], cpus=2).best(64)
    refit = capacity.fit([slow_read(USER), LATENCY(workers(first))], cpus=2)
    assert refit.step_rate == pytest.approx(1000.0)
    assert refit.best(64) > first


def test_a_wait_with_a_batch_ready_is_the_steps_own_not_the_loaders():
    trial = RECEIVING(workers(12))  # 1,200/s of supply; the step with receiving takes 833/s and waits 17 % of it
    assert trial.data_wait_frac == pytest.approx(1 / 6) and trial.supply_wait_frac == pytest.approx(0.0)
    refit = capacity.fit([RECEIVING(USER), trial], cpus=2)
    assert refit.step_rate == pytest.approx(RECEIVING.rate(12)) == pytest.approx(1000 / 1.2)
    assert refit.rate(refit.best(64)) == pytest.approx(RECEIVING.rate(12))  # no gain predicted from more workers
    # read as supply (where the loader's stock is not known), the same wait promises the step's 1,000/s
    unknown = dataclasses.replace(trial, supply_wait_frac=None)
    assert capacity.fit([RECEIVING(USER), unknown], cpus=2).step_rate == pytest.approx(1000.0)


def test_nothing_measured_no_model():
    assert capacity.fit([], cpus=2) is None
