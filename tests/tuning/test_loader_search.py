"""The loader search as a pure decision: fed measured trials, it proposes and chooses."""

import dataclasses

import pytest

from pipeopt.tuning.loader_search import Budget, LoaderSearch, LoaderSettings, Trial
from pipeopt.tuning.noise import Rate
from tests.tuning.worlds import CPU_BOUND, GIB, LATENCY, MEMORY_BOUND

USER = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False)


def trial(settings, rate, wait, cpu_workers=None, se=0.01):
    return Trial(settings, Rate(rate, se), data_wait_frac=wait, cpu_main_pct=100.0, cpu_workers_pct=cpu_workers)


def run(search, world):
    """Drive the search against ``world(settings) -> Trial``; return the proposals in order."""
    proposed = []
    while (candidate := search.propose()) is not None:
        proposed.append(candidate)
        search.record(world(candidate))
    return proposed


def storage_world(settings):
    """Each worker delivers 100 samples/s; the step caps at 1000; workers use 5 % CPU each."""
    n = settings.num_workers
    rate = min(1000.0, 100.0 * max(n, 1) * (1.05 if n else 1.0))
    wait = max(0.0, 1 - rate / 1000.0)
    return trial(settings, rate, wait, cpu_workers=5.0 * n)


def crashing_from_4(settings):
    """``storage_world``, where 4 workers or more crash."""
    if settings.num_workers >= 4:
        return Trial(settings, None, error="RuntimeError: DataLoader worker (pid 1) exited unexpectedly")
    return storage_world(settings)


def test_compute_bound_runs_are_left_alone():
    search = LoaderSearch(trial(USER, 1000.0, 0.02), Budget(cpus=8))
    assert search.propose() is None
    assert "compute-bound" in search.stop_reason
    assert search.choice().settings == USER


def test_the_models_pick_then_its_refit_reach_the_best_count_in_two_trials():
    search = LoaderSearch(LATENCY(USER), Budget(cpus=2, more_epochs=True))
    proposed = run(search, LATENCY)
    # the before-window alone says 10 workers would reach the step's 1000/s, but until a worker's CPU is measured
    # at most two per CPU are started: 4; their window shows a worker costs little CPU, and the refit picks 10
    assert [p.num_workers for p in proposed] == [4, 10]
    assert all(p.persistent_workers for p in proposed)
    assert [t.predicted for t in search.trials] == [None, pytest.approx(400.0), pytest.approx(1000.0)]
    assert search.choice().settings.num_workers == LATENCY.best()[0]
    assert search.fell_back is None


def test_cpu_bound_loading_stops_where_the_cpus_are_spent():
    search = LoaderSearch(CPU_BOUND(USER), Budget(cpus=2, more_epochs=True))
    proposed = run(search, CPU_BOUND)
    assert len(proposed) <= 3
    chosen = search.choice()
    assert chosen.rate.value == pytest.approx(CPU_BOUND.best()[1])  # the 2 CPUs' 400/s
    assert "picks 4 workers again (predicted 400.0 samples/s)" in search.stop_reason


def test_memory_bound_workers_stay_within_the_memory_they_may_take():
    search = LoaderSearch(MEMORY_BOUND(USER), Budget(cpus=2, memory_bytes=5 * GIB, more_epochs=True))
    proposed = run(search, MEMORY_BOUND)
    assert [p.num_workers for p in proposed][:2] == [4, 2]  # 4 x 2 GiB measured over the 5 GiB: refit at 2
    assert search.choice().settings.num_workers == 2  # 4 was faster, but does not fit


@pytest.mark.parametrize("world", [LATENCY, CPU_BOUND, MEMORY_BOUND], ids=["latency", "cpu", "memory"])
def test_every_kept_trial_carries_its_prediction_and_few_trials_are_needed(world):
    search = LoaderSearch(world(USER), Budget(cpus=2, memory_bytes=5 * GIB, more_epochs=True))
    proposed = run(search, world)
    assert len(proposed) <= 3
    assert all(t.predicted is not None for t in search.trials[1:] if t.settings.prefetch_factor == 2)
    chosen = search.choice()  # the model refitted on every trial predicts what the chosen setting measured
    assert search.predict(chosen.settings) == pytest.approx(chosen.rate.value, rel=0.05)


def test_a_pipeline_the_model_does_not_describe_falls_back_to_geometric_growth():
    def collapse(settings):  # beyond 4 workers something the model cannot see (thrashing storage) caps it at 300/s
        n = settings.num_workers
        rate = 100.0 * n if n <= 4 else 300.0
        return trial(settings, rate, 1 - rate / 1000.0, cpu_workers=5.0 * n)

    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    counts = [p.num_workers for p in run(search, collapse)]
    assert counts[:2] == [4, 7]  # the refit predicts 7 workers reach ~667/s; they measure 300
    assert search.fell_back == "the refitted model's pick, 7 workers, measured 300.0 samples/s against 666.7 predicted"
    assert counts[2] == 8  # geometric growth from twice the fastest count: not faster, ends; then the midpoints
    assert "8 workers were not faster than 4 workers" in search.stop_reason
    assert search.choice().settings.num_workers == 4


def test_cpu_heavy_workers_stop_at_the_cpu_budget():
    def cpu_world(settings):
        n = settings.num_workers
        return trial(settings, 100.0 * (1 + n), 0.8, cpu_workers=95.0 * n)

    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    proposed = run(search, cpu_world)
    assert max(p.num_workers for p in proposed) == 4  # two per CPU always fit; 8 x 95 % would not
    assert "8 workers would need about 760 % CPU" in search.stop_reason
    assert search.choice().settings.num_workers == 4


def test_a_failed_trial_ends_growth_and_is_never_chosen():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    run(search, crashing_from_4)
    assert "4 workers failed" in search.stop_reason
    assert search.choice().settings.num_workers == 2


def test_within_noise_means_no_change():
    flat = lambda s: trial(s, 100.0 * (1.02 if s.num_workers else 1.0), 0.5)  # noqa: E731
    search = LoaderSearch(trial(USER, 100.0, 0.5), Budget(cpus=2))
    run(search, flat)
    assert search.choice().settings == USER


def test_pin_memory_is_only_tried_on_cuda():
    world = lambda s: trial(s, 1000.0 if s.num_workers >= 2 else 100.0, 0.0 if s.num_workers >= 2 else 0.9)  # noqa: E731
    cpu = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    assert not any(p.pin_memory for p in run(cpu, world))

    def with_transfer(s):
        t = world(s)
        return Trial(s, t.rate, t.data_wait_frac, transfer_frac=0.2, cpu_main_pct=100.0, cpu_workers_pct=10.0)

    cuda = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2, cuda=True))
    assert any(p.pin_memory for p in run(cuda, with_transfer))


def test_record_before_the_next_proposal():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    search.propose()
    with pytest.raises(RuntimeError, match="record"):
        search.propose()


def test_a_count_too_close_to_call_is_measured_again_and_judged_on_both():
    seen = {}

    def close(settings):  # every count within noise of the main process: nothing the model predicts comes true
        n = settings.num_workers
        seen[n] = seen.get(n, 0) + 1
        return trial(settings, 104.0 if n == 1 else 100.0 if seen[n] == 1 or n != 2 else 108.0, 0.8)

    search = LoaderSearch(trial(USER, 100.0, 0.5), Budget(cpus=2))  # half the step waiting: 1 worker predicted
    proposed = [p.num_workers for p in run(search, close)]
    assert proposed[:4] == [1, 4, 2, 2]  # the refit's 4 misses; growth from 2, too close to call: measured again
    two = next(t for t in search.trials if t.settings.num_workers == 2)
    assert two.repeats == 2 and two.rate.value == pytest.approx(104.0)
    assert search.choice().settings == USER  # nothing beat the user's setting beyond noise


def test_one_noisy_trial_does_not_make_clearly_slower_settings_eligible():
    two = USER.with_workers(2, persistent=False)
    search = LoaderSearch(trial(USER, 519.0, 0.9, se=0.023), Budget(cpus=2))
    search.record(trial(two, 613.0, 0.2, cpu_workers=100.0, se=0.036))
    search.record(trial(dataclasses.replace(two, prefetch_factor=4), 632.0, 0.2, se=0.33))  # very noisy
    assert search.choice().settings == two  # 613 beats 519 beyond noise; the noisy 632 beats nothing


@pytest.mark.parametrize("wait, first", [(0.3, 1), (0.5, 1), (0.75, 3), (0.8, 4), (0.95, 4)])
def test_the_first_pick_is_the_workers_the_before_window_says_are_needed(wait, first):
    search = LoaderSearch(trial(USER, 100.0, wait), Budget(cpus=2))
    # the main process loaded a share w of each step: a worker keeps up with (1 - w) / w of the step's pace, so about
    # w / (1 - w) workers are needed (at most two per CPU before a worker's CPU is measured)
    assert search.propose().num_workers == first


def test_from_the_users_workers_the_model_reads_what_each_delivers_and_costs():
    search = LoaderSearch(trial(USER.with_workers(3, persistent=False), 100.0, 0.9, cpu_workers=30.0), Budget(cpus=2))
    # 3 workers delivered 100/s (33/s each) taking 130 % CPU with the step: the 2 CPUs allow about 154/s, which
    # 5 workers reach
    assert search.propose().num_workers == 5


def test_a_first_count_that_fails_is_halved_and_never_exceeded():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    counts = [p.num_workers for p in run(search, crashing_from_4)]
    assert counts[:2] == [4, 2] and max(counts) == 4 and counts.count(4) == 1
    assert "4 workers failed" in search.stop_reason
    assert search.choice().settings.num_workers == 2


# -- DALI as one more candidate --------------------------------------------------------------------------------
DALI = LoaderSettings.dali_on("cpu")


def with_dali(rate, *, fail=False, wait=0.0):
    """``LATENCY``, where DALI delivers ``rate`` samples/s (or fails)."""
    def world(settings):
        if settings.dali:
            return Trial(settings, None, error="the DALI pipeline failed") if fail else trial(settings, rate, wait)
        return LATENCY(settings)
    return world


def test_dali_is_tried_after_the_worker_search_and_chosen_when_faster_beyond_noise():
    search = LoaderSearch(LATENCY(USER), Budget(cpus=2, dali="cpu"))
    proposed = run(search, with_dali(1500.0))
    assert proposed.count(DALI) == 1
    assert [p for p in proposed if p.dali] == proposed[-1:]  # last: no DataLoader extras after DALI won
    assert search.choice().settings == DALI


def test_dali_at_a_tie_is_measured_again_and_the_dataloader_is_kept():
    search = LoaderSearch(LATENCY(USER), Budget(cpus=2, dali="cpu"))
    proposed = run(search, with_dali(1005.0))  # the best worker count reaches 1000/s
    assert proposed.count(DALI) == 2
    chosen = search.choice().settings
    assert not chosen.dali and chosen.num_workers == 10


def test_a_slower_or_failed_dali_trial_is_never_chosen():
    for world in (with_dali(300.0), with_dali(5000.0, fail=True)):
        search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2, dali="cpu"))
        proposed = run(search, world)
        assert proposed.count(DALI) == 1
        assert not search.choice().settings.dali


def test_dali_alone_when_workers_may_not_change_and_never_for_a_compute_bound_run():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2, dali="mixed", may_change_workers=False))
    proposed = run(search, with_dali(900.0))
    assert proposed[0] == LoaderSettings.dali_on("mixed") and search.choice().settings.dali == "mixed"
    assert LoaderSearch(trial(USER, 1000.0, 0.02), Budget(cpus=2, dali="cpu")).propose() is None
    assert all(not p.dali for p in run(LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2)), with_dali(9e9)))
