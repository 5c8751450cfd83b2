"""The loader search as a pure decision: fed measured trials, it proposes and chooses."""

import dataclasses

import pytest

from pipeopt.tuning.loader_search import Budget, LoaderSearch, LoaderSettings, Trial
from pipeopt.tuning.noise import Rate
from tests.tuning.worlds import GIB, LATENCY, MEMORY_BOUND

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


def test_workers_grow_until_the_wait_is_gone_then_the_cheapest_within_noise_wins():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2, more_epochs=True))
    proposed = run(search, storage_world)
    counts = [p.num_workers for p in proposed]
    # the before-window waited 90 %: about 9 workers are needed, so growth starts at 4 (two per CPU; beyond, the
    # CPU a worker takes is measured first) and goes on geometrically past the 2 CPUs (these workers mostly wait)
    assert counts[:3] == [4, 8, 16]
    assert all(p.persistent_workers for p in proposed if p.num_workers)
    chosen = search.choice().settings
    assert chosen.num_workers == 12  # the refined midpoint reaches the 1000/s cap with fewer workers than 16
    assert chosen.prefetch_factor == 2


def test_cpu_heavy_workers_stop_at_the_cpu_budget():
    def cpu_world(settings):
        n = settings.num_workers
        return trial(settings, 100.0 * (1 + n), 0.8, cpu_workers=95.0 * n)

    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    proposed = run(search, cpu_world)
    assert max(p.num_workers for p in proposed) == 4  # two per CPU always fit; 8 x 95 % would not
    assert "8 workers would need about 760 % CPU" in search.stop_reason
    assert search.choice().settings.num_workers == 4


def test_growth_ends_at_the_first_count_that_does_not_beat_the_best():
    def plateau(settings):  # the step caps at 900/s; a fetch costs the loop some wait however many workers
        n = settings.num_workers
        return trial(settings, min(900.0, 100.0 * max(n, 1)), 0.8 if n < 8 else 0.12, cpu_workers=5.0 * n)

    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    counts = [p.num_workers for p in run(search, plateau)]
    # 16 beats 8 (+12.5 %); 32 ties 16 twice and ends growth
    assert counts[:5] == [4, 8, 16, 32, 32]
    assert 64 not in counts
    assert "were not faster than" in search.stop_reason


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

    def close_then_clear(settings):
        n = settings.num_workers
        seen[n] = seen.get(n, 0) + 1
        if n == 1:
            return trial(settings, 104.0 if seen[n] == 1 else 108.0, 0.8)  # +4 %, then +8 %: together +6 %
        return trial(settings, 100.0, 0.8)

    search = LoaderSearch(trial(USER, 100.0, 0.5), Budget(cpus=2))  # half the step waiting: start at 1 worker
    proposed = [p.num_workers for p in run(search, close_then_clear)]
    assert proposed[:2] == [1, 1]
    one = next(t for t in search.trials if t.settings.num_workers == 1)
    assert one.repeats == 2 and one.rate.value == pytest.approx(106.0)
    assert search.choice().settings.num_workers == 1


def test_one_noisy_trial_does_not_make_clearly_slower_settings_eligible():
    two = USER.with_workers(2, persistent=False)
    search = LoaderSearch(trial(USER, 519.0, 0.9, se=0.023), Budget(cpus=2))
    search.record(trial(two, 613.0, 0.2, cpu_workers=100.0, se=0.036))
    search.record(trial(dataclasses.replace(two, prefetch_factor=4), 632.0, 0.2, se=0.33))  # very noisy
    assert search.choice().settings == two  # 613 beats 519 beyond noise; the noisy 632 beats nothing


@pytest.mark.parametrize("wait, first", [(0.3, 1), (0.5, 1), (0.75, 2), (0.8, 4), (0.95, 4)])
def test_growth_starts_at_the_workers_the_before_window_says_are_needed(wait, first):
    search = LoaderSearch(trial(USER, 100.0, wait), Budget(cpus=2))
    assert search.propose().num_workers == first  # w / (1 - w), rounded down to a power of two, <= 2 per CPU


def test_from_the_users_workers_growth_doubles_them():
    search = LoaderSearch(trial(USER.with_workers(3, persistent=False), 100.0, 0.9, cpu_workers=30.0), Budget(cpus=2))
    assert search.propose().num_workers == 6


def test_a_first_count_that_fails_is_halved_and_never_exceeded():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    counts = [p.num_workers for p in run(search, crashing_from_4)]
    assert counts[:2] == [4, 2] and max(counts) == 4 and counts.count(4) == 1
    assert "4 workers failed" in search.stop_reason
    assert search.choice().settings.num_workers == 2


# -- DALI as one more candidate --------------------------------------------------------------------------------
DALI = LoaderSettings.dali_on("cpu")


def with_dali(rate, *, fail=False, wait=0.0):
    """``storage_world``, where DALI delivers ``rate`` samples/s (or fails)."""
    def world(settings):
        if settings.dali:
            return Trial(settings, None, error="the DALI pipeline failed") if fail else trial(settings, rate, wait)
        return storage_world(settings)
    return world


def test_dali_is_tried_after_the_worker_search_and_chosen_when_faster_beyond_noise():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2, dali="cpu"))
    proposed = run(search, with_dali(1500.0))
    assert proposed.count(DALI) == 1
    assert [p for p in proposed if p.dali] == proposed[-1:]  # last: no DataLoader extras after DALI won
    assert search.choice().settings == DALI


def test_dali_at_a_tie_is_measured_again_and_the_dataloader_is_kept():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2, dali="cpu"))
    proposed = run(search, with_dali(1005.0))  # the best worker count reaches 1000/s
    assert proposed.count(DALI) == 2
    chosen = search.choice().settings
    assert not chosen.dali and chosen.num_workers == 12


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


# -- the capacity model's predictions, recorded beside each measurement ----------------------------------------
def test_every_dataloader_proposal_carries_the_models_prediction_for_it():
    search = LoaderSearch(LATENCY(USER), Budget(cpus=2, more_epochs=True, dali="cpu"))
    run(search, with_dali_on(LATENCY, 500.0))
    by_count = {t.settings.num_workers: t.predicted for t in search.trials if not t.settings.dali}
    assert by_count[0] is None  # the user's settings: measured, not predicted
    assert by_count[4] == pytest.approx(400.0)  # from the before-window alone: 4 workers x 100/s
    assert by_count[8] == pytest.approx(800.0)  # refitted on the 4-worker window (100/s a worker, CPU measured)
    assert all(t.predicted is None for t in search.trials if t.settings.dali)  # DALI is not modelled


def test_a_measured_setting_whose_workers_exceed_their_memory_is_never_chosen():
    search = LoaderSearch(MEMORY_BOUND(USER), Budget(cpus=2, memory_bytes=5 * GIB, more_epochs=True))
    run(search, MEMORY_BOUND)
    assert any(t.settings.num_workers == 4 for t in search.trials)  # tried (its memory unknown until measured)
    assert search.choice().settings.num_workers <= 2  # 4 x 2 GiB do not fit the 5 GiB workers may take


def with_dali_on(world, rate):
    def both(settings):
        return trial(settings, rate, 0.0) if settings.dali else world(settings)
    return both
