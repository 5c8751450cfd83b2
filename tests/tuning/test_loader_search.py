"""The loader search as a pure decision: fed measured trials, it proposes and chooses."""

import dataclasses

import pytest

from pipeopt.tuning.loader_search import Budget, LoaderSearch, LoaderSettings, Trial
from pipeopt.tuning.noise import Rate
from tests.tuning.worlds import CONTENDED, CPU_BOUND, GIB, LATENCY, MEMORY_BOUND, RECEIVING

USER = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False)


def trial(settings, rate, wait, cpu_workers=None, se=0.01):
    """A measured window; with workers, what a sample costs them in CPU as the session derives it."""
    load_cpu = cpu_workers / 100.0 / rate if cpu_workers is not None and settings.num_workers else None
    return Trial(settings, Rate(rate, se), data_wait_frac=wait, cpu_main_pct=100.0, cpu_workers_pct=cpu_workers,
                 load_cpu_s=load_cpu)


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


def test_from_the_before_window_alone_the_models_pick_reaches_the_best_rate_in_one_trial():
    search = LoaderSearch(LATENCY(USER), Budget(cpus=2, more_epochs=True))
    proposed = run(search, LATENCY)
    # the before-window says a sample costs 0.2 ms of CPU to load and one loader delivers 100/s: 13 workers reach the
    # step's 1000/s with headroom (the step read from a window that waited is a lower bound)
    assert [p.num_workers for p in proposed] == [13]
    assert all(p.persistent_workers for p in proposed)
    assert [t.predicted for t in search.trials] == [None, pytest.approx(1000.0)]
    assert search.choice().rate.value == pytest.approx(LATENCY.best()[1])
    assert search.fell_back is None and "picks 13 workers again" in search.stop_reason


def test_cpu_bound_loading_stops_where_the_cpus_are_spent():
    search = LoaderSearch(CPU_BOUND(USER), Budget(cpus=2, more_epochs=True))
    proposed = run(search, CPU_BOUND)
    assert [p.num_workers for p in proposed] == [2]  # 4 ms of CPU a sample: 2 CPUs load 400/s, which 2 workers make
    assert search.choice().rate.value == pytest.approx(CPU_BOUND.best()[1])


def test_cpu_bound_loading_beside_a_spinning_step_adds_workers_while_the_model_predicts_a_gain():
    search = LoaderSearch(CONTENDED(USER), Budget(cpus=2, more_epochs=True))
    proposed = run(search, CONTENDED)
    # each trial spends the CPUs; only the step's CPU measured without workers says more workers can still pay
    assert [p.num_workers for p in proposed] == [2, 4, 6]
    assert search.choice().settings.num_workers == 6
    assert search.choice().rate.value >= 0.9 * CONTENDED.best()[1]


def noisy(world, se=0.08):
    """``world`` where every window with workers reads with a standard error of ``se`` (a busy 2-CPU machine)."""
    def measure(settings):
        t = world(settings)
        return dataclasses.replace(t, rate=Rate(t.rate.value, se)) if settings.num_workers and t.ok else t

    return measure


def test_a_supply_bound_trial_in_noisy_windows_does_not_stop_the_models_picks_short():
    search = LoaderSearch(CONTENDED(USER), Budget(cpus=2, more_epochs=True))
    proposed = run(search, noisy(CONTENDED))
    # 4 workers waited with no batch ready; 6 predicted 14 % faster, within 2 x 8 % but beyond the 5 % floor
    assert [p.num_workers for p in proposed] == [2, 4, 6]
    assert search.choice().settings.num_workers == 6


@pytest.mark.parametrize(("rates", "kept"), [((120.0, 135.0, 140.0), 5), ((120.0, 124.0, 125.0), 3)],
                         ids=["climbing", "flat"])
def test_more_workers_reading_faster_than_the_floor_are_kept_though_within_each_others_noise(rates, kept):
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    for n, rate in zip((3, 5, 8), rates, strict=True):
        search.record(trial(USER.with_workers(n, persistent=True), rate, 0.3, se=0.08))
    # 140 is within 2 x 8 % of 120: no count beats another beyond noise, all beat your settings beyond it; the
    # fewest within the 5 % floor of the fastest is kept (and where the counts read flat, the cheapest)
    assert search.choice().settings.num_workers == kept
    assert search.choice().climbed_from == (3 if kept != 3 else None)  # the report says why more were kept


def test_memory_bound_workers_stay_within_the_memory_they_may_take():
    search = LoaderSearch(MEMORY_BOUND(USER), Budget(cpus=2, memory_bytes=5 * GIB, more_epochs=True))
    proposed = run(search, MEMORY_BOUND)
    assert [p.num_workers for p in proposed] == [13, 2]  # 2 GiB a worker, measured: the refit stays at 2
    assert search.choice().settings.num_workers == 2  # 13 was faster, but does not fit
    assert search.stop_reason.endswith("it aims for 13, but 2 fit the 5.0 GiB workers may take at 2.0 GiB each "
                                       "(measured)")  # the report says what held the workers back
    assert search.first_held is None  # its first pick, 13, was what it aimed for
    stand_in = LoaderSearch(MEMORY_BOUND(USER), Budget(cpus=2, memory_bytes=5 * GIB, training_mem_bytes=2 * GIB))
    assert [p.num_workers for p in run(stand_in, MEMORY_BOUND)] == [2]  # the training process's 2 GiB stands in
    assert stand_in.summary()[0] == ("loader model's first pick: 2 workers: it aims for 13, but 2 fit the 5.0 GiB "
                                     "workers may take at 2.0 GiB each (the training process's private memory, until "
                                     "a worker is measured)")


@pytest.mark.parametrize(("again", "kept"), [(90.0, 2), (104.0, 0)], ids=["user-slower-again", "user-as-fast"])
def test_a_gain_within_noise_measures_the_users_settings_again_and_decides_on_both_windows(again, kept):
    # the user's window read 100 samples/s, the workers' 112: ahead by more than the 5 % floor, within the noise of
    # two windows of 5 % error each (a 14 % gap is needed); the user's settings are measured once more, late
    windows = {"user": [100.0, again]}

    def world(settings):
        if settings.num_workers == 0:
            return trial(settings, windows["user"].pop(0), 0.5, se=0.05)
        return trial(settings, 112.0, 0.3, cpu_workers=40.0 * settings.num_workers, se=0.05)

    search = LoaderSearch(world(USER), Budget(cpus=1, more_epochs=True))
    proposed = run(search, world)
    assert proposed.count(USER) == 1 and proposed.index(USER) > 0  # once more, after the workers' trials
    assert search.baseline.repeats == 2 and search.trials[0] is search.baseline
    assert search.baseline.rate.value == pytest.approx((100.0 + again) / 2)
    assert search.choice().settings.num_workers == kept
    # still too close to call against the user's two windows (102): the workers' setting is measured once more too,
    # and their two windows (112 each) are still within the noise of a 10 % gap
    if again == 104.0:
        assert proposed[-2] == USER and proposed[-1] in proposed[:-2]
        assert max(t.repeats for t in search.trials[1:]) == 2
    else:
        assert proposed[-1] == USER


def test_a_noisy_trial_still_ahead_after_the_users_second_window_is_measured_again_and_kept():
    # one window of 3 workers reads 118 samples/s with a 9 % standard error (bursty workers on 2 CPUs): against the
    # user's 100 and then 101, an 18 % gap is inside its noise; pooled with a second window of it, it is not
    user = [100.0, 101.0]

    def world(settings):
        n = settings.num_workers
        if n == 0:
            return trial(settings, user.pop(0), 0.9)
        return trial(settings, 118.0, 0.25, cpu_workers=95.0 * n, se=0.09)  # CPU-bound: more workers add nothing

    search = LoaderSearch(world(USER), Budget(cpus=2, more_epochs=True))
    counts = [p.num_workers for p in run(search, world)]
    n = counts[0]
    assert counts == [n, 0, n]  # the model's pick; the user's settings, then the pick, once more each
    pick = search.trials[1]
    assert len(search.trials) == 2 and pick.repeats == 2 and search.baseline.repeats == 2
    assert search.choice() is pick


def test_a_clear_gain_or_loss_does_not_measure_the_users_settings_again():
    assert USER not in run(LoaderSearch(LATENCY(USER), Budget(cpus=2, more_epochs=True)), LATENCY)
    slower = LoaderSearch(trial(USER, 100.0, 0.5, se=0.05), Budget(cpus=1, more_epochs=True))
    assert USER not in run(slower, lambda s: trial(s, 80.0, 0.3, cpu_workers=40.0 * s.num_workers, se=0.05))


@pytest.mark.parametrize("world", [LATENCY, CPU_BOUND, MEMORY_BOUND], ids=["latency", "cpu", "memory"])
def test_every_trial_carries_its_prediction_and_few_trials_are_needed(world):
    search = LoaderSearch(world(USER), Budget(cpus=2, memory_bytes=5 * GIB, more_epochs=True))
    proposed = run(search, world)
    assert len(proposed) <= 3
    assert all(t.predicted is not None for t in search.trials[1:])
    chosen = search.choice()  # the model refitted on every trial predicts what the chosen setting measured
    assert search.predict(chosen.settings) == pytest.approx(chosen.rate.value, rel=0.05)
    assert chosen.rate.value == pytest.approx(world.best()[1] if world is not MEMORY_BOUND else world.rate(2))


def test_a_wait_left_with_batches_ready_does_not_send_the_search_to_more_workers():
    search = LoaderSearch(RECEIVING(USER), Budget(cpus=2, more_epochs=True))
    proposed = run(search, RECEIVING)
    assert len(proposed) == 1  # the pick reaches the step's pace; the wait left had a batch ready every time
    assert "predicts no gain beyond noise" in search.stop_reason
    assert search.choice().rate.value == pytest.approx(RECEIVING.best()[1])

    def stock_unknown(settings):  # the same world where the loader's stock cannot be read (all wait taken as supply)
        return dataclasses.replace(RECEIVING(settings), supply_wait_frac=None)

    assert len(run(LoaderSearch(stock_unknown(USER), Budget(cpus=2, more_epochs=True)), stock_unknown)) > 1


def collapse(settings):
    """Beyond 4 workers something the model cannot see (thrashing storage) caps the rate at 300/s."""
    n = settings.num_workers
    rate = 100.0 * n if n <= 4 else 300.0
    return trial(settings, rate, 1 - rate / 1000.0, cpu_workers=5.0 * n)


def test_a_refits_pick_slower_than_the_best_is_fitted_on_not_searched_geometrically():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    counts = [p.num_workers for p in run(search, collapse)]
    # loading's CPU unknown in the before-window: 4 workers (two per CPU); their window says 13 reach the step
    assert counts[:2] == [4, 13]  # 13 measure 300/s, slower than 4: what the model cannot see, it is refitted on
    assert len(counts) <= 3 and search.fell_back is None
    assert search.choice().settings.num_workers == 4


def thrashing(settings):
    """Two workers at most help; from three on the storage thrashes: 60/s, slower than the main process alone."""
    rate = {0: 100.0, 1: 150.0, 2: 200.0}.get(settings.num_workers, 60.0)
    return trial(settings, rate, 1 - rate / 1000.0, cpu_workers=5.0 * settings.num_workers)


def test_a_first_pick_slower_than_the_users_settings_falls_back_to_geometric_growth():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    counts = [p.num_workers for p in run(search, thrashing)]
    assert counts[:4] == [4, 1, 2, 3]  # the pick (4); growth from one worker, stopped at the 4 tried; a midpoint
    assert search.fell_back.startswith("its pick, 4 workers, measured 60.0 samples/s")
    assert "4 workers were not faster than 2 workers" in search.stop_reason
    assert search.choice().settings.num_workers == 2
    held, fell_back = search.summary()[:2]  # loading's CPU unmeasured: two workers per CPU at first, and it says so
    assert held.startswith("loader model's first pick: 4 workers: it aims for") and "two per CPU" in held
    assert fell_back.startswith("loader model: its pick, 4 workers")


def test_cpu_heavy_workers_are_not_added_when_the_model_predicts_no_gain():
    def cpu_world(settings):  # 95 % of a CPU per worker: beyond 2 CPUs, more workers only share them
        n = settings.num_workers
        return trial(settings, 100.0 * (1 + n), 0.8, cpu_workers=95.0 * n)

    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    proposed = run(search, cpu_world)
    assert [p.num_workers for p in proposed] == [4]
    # 4 workers' loop still waited with no batch ready: the floor, not the noise, stopped the search
    assert "predicts no gain beyond the 5% floor over 4 workers, whose loop still waited" in search.stop_reason
    assert search.choice().settings.num_workers == 4


def test_a_failed_pick_is_halved_never_exceeded_and_never_chosen():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    counts = [p.num_workers for p in run(search, crashing_from_4)]
    assert counts[:2] == [4, 2] and max(counts) == 4 and counts.count(4) == 1
    assert search.fell_back == ("its pick, 4 workers, failed: "
                                "RuntimeError: DataLoader worker (pid 1) exited unexpectedly")
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


def test_in_the_fallback_a_count_too_close_to_call_is_measured_again_and_judged_on_both():
    seen = {}

    def close_then_clear(settings):
        n = settings.num_workers
        seen[n] = seen.get(n, 0) + 1
        if n == 2:
            return trial(settings, 156.0 if seen[n] == 1 else 162.0, 0.8)  # +4 % over one worker, then +8 %
        return thrashing(settings)

    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    proposed = [p.num_workers for p in run(search, close_then_clear)]
    assert proposed[:4] == [4, 1, 2, 2]
    two = next(t for t in search.trials if t.settings.num_workers == 2)
    assert two.repeats == 2 and two.rate.value == pytest.approx(159.0)
    assert search.choice().settings.num_workers == 2


def test_one_noisy_trial_does_not_make_clearly_slower_settings_eligible():
    two = USER.with_workers(2, persistent=False)
    search = LoaderSearch(trial(USER, 519.0, 0.9, se=0.023), Budget(cpus=2))
    search.record(trial(two, 613.0, 0.2, cpu_workers=100.0, se=0.036))
    search.record(trial(dataclasses.replace(two, prefetch_factor=4), 632.0, 0.2, se=0.33))  # very noisy
    assert search.choice().settings == two  # 613 beats 519 beyond noise; the noisy 632 beats nothing


@pytest.mark.parametrize("wait, first", [(0.3, 1), (0.5, 2), (0.75, 4), (0.95, 4)])
def test_the_first_pick_reaches_the_steps_rate_two_per_cpu_while_loadings_cpu_is_unknown(wait, first):
    search = LoaderSearch(trial(USER, 100.0, wait), Budget(cpus=2))
    # the step takes 100 / (1 - w) samples/s, the main process loads 100 / w: 1.25 x the step's rate over that
    assert search.propose().num_workers == first


def test_with_loadings_cpu_measured_the_first_pick_may_exceed_two_per_cpu():
    before = dataclasses.replace(trial(USER, 100.0, 0.9), load_cpu_s=0.0002, step_cpu_s=0.001)
    search = LoaderSearch(before, Budget(cpus=2))
    assert search.propose().num_workers == 11  # 1.25 x 1000/s over 111/s a loader; the CPUs allow 1,667/s


def test_from_the_users_workers_the_model_extrapolates_their_measured_supply_and_cpu():
    user = trial(USER.with_workers(3, persistent=False), 100.0, 0.9, cpu_workers=30.0)
    search = LoaderSearch(user, Budget(cpus=2))
    # 33/s and 3 ms of CPU a sample each: 2 CPUs load 667/s, and the pick aims 25 % above what it read
    assert search.propose().num_workers == 25


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


def test_with_dali_a_candidate_the_worker_counts_and_dali_take_three_trials_in_all():
    search = LoaderSearch(CONTENDED(USER), Budget(cpus=2, more_epochs=True, dali="cpu"))
    proposed = run(search, with_dali_on(CONTENDED, 3000.0))  # without DALI: 2, 4 and 6 workers
    assert [p.dali or p.num_workers for p in proposed] == [2, 4, "cpu"]
    assert search.choice().settings == DALI


def test_dali_at_a_tie_is_measured_again_and_the_dataloader_is_kept():
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2, dali="cpu"))
    proposed = run(search, with_dali(1005.0))  # the best worker count reaches 1000/s
    assert proposed.count(DALI) == 2
    chosen = search.choice().settings
    assert not chosen.dali and chosen.num_workers == 12


def test_under_dali_the_store_is_filled_by_the_fastest_of_pipeopts_loaders_not_the_users_unfilled_window():
    # the user's settings (no workers) read fastest in their window, which filled nothing; pipeopt's trials filled
    def world(settings):
        return trial(settings, 1500.0, 0.0) if settings.dali else trial(settings, 80.0 + settings.num_workers, 0.9)
    search = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2, dali="cpu"))
    run(search, world)
    assert search.choice().settings == DALI and search.best_dataloader().settings == USER
    filler = search.best_dataloader(filling=True)
    tried = [t for t in search.trials if t is not search.baseline and not t.settings.dali]
    assert filler is max(tried, key=lambda t: t.rate.value) and filler.settings.num_workers > 0


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
    assert by_count[13] == pytest.approx(1000.0)  # from the before-window alone: the step's rate
    assert all(t.predicted is None for t in search.trials if t.settings.dali)  # DALI is not modelled


def test_a_measured_setting_whose_workers_exceed_their_memory_is_never_chosen():
    search = LoaderSearch(MEMORY_BOUND(USER), Budget(cpus=2, memory_bytes=5 * GIB, more_epochs=True))
    run(search, MEMORY_BOUND)
    assert any(t.settings.num_workers == 13 for t in search.trials)  # tried (its memory unknown until measured)
    assert search.choice().settings.num_workers <= 2  # 4 x 2 GiB do not fit the 5 GiB workers may take


def with_dali_on(world, rate):
    def both(settings):
        return trial(settings, rate, 0.0) if settings.dali else world(settings)
    return both


def knife_edge(settings, cpu_per_worker=5.0):
    """Storage latency as measured on a 2-CPU host: one loader delivers 100 samples/s; the before-window, waiting
    85 % of each step, reads the step slow (80/s), and 7 workers then measure 700/s - the step's pace and exactly
    their supply, so none of their wait found the stock empty."""
    n = settings.num_workers
    if n == 0:  # loading in the main process: 0.2 ms of its CPU a sample (the rest of a read is waiting)
        return dataclasses.replace(trial(settings, 80.0, 0.85), load_cpu_s=0.0002)
    rate = min(700.0, 100.0 * n)
    return dataclasses.replace(trial(settings, rate, 0.12, cpu_workers=cpu_per_worker * n),
                               supply_wait_frac=0.0 if rate >= 700.0 else 1 - rate / 700.0)


def test_a_choice_with_no_supply_to_spare_is_kept_with_the_models_headroom():
    search = LoaderSearch(knife_edge(USER), Budget(cpus=2, more_epochs=True))
    assert [p.num_workers for p in run(search, knife_edge)] == [7]  # the pick, from the before-window's slow step
    assert "predicts no gain beyond noise over 7 workers" in search.stop_reason  # a rate model: 9 read 700/s too
    chosen = search.choice()
    kept = search.with_headroom(chosen)
    # 7 deliver 700/s, the step's measured pace; a loader delivers 80 / 0.85 = 94/s (the before-window: the only one
    # its supply limited), so 25 % headroom over the step takes ceil(0.97 x 1.25 x 700 / 94.1) = 10
    assert (chosen.settings.num_workers, kept.settings.num_workers, kept.headroom_from) == (7, 10, 7)
    assert kept.settings == dataclasses.replace(chosen.settings, num_workers=10)  # the rest of the choice kept
    assert kept.predicted == pytest.approx(700.0) and search.predictions[kept.settings] == kept.predicted
    assert kept.rate == chosen.rate  # what was measured stays what was measured


def test_the_headroom_is_only_added_where_the_model_holds_and_the_workers_fit():
    def cpu_heavy(settings):  # the same, each worker a whole CPU busy: 10 workers do not fit 2 CPUs
        return knife_edge(settings, cpu_per_worker=100.0)

    def kept(world, budget=None):
        search = LoaderSearch(world(USER), budget or Budget(cpus=2, more_epochs=True))
        run(search, world)
        return search.with_headroom(search.choice()).settings.num_workers

    assert kept(cpu_heavy) == 7
    assert kept(knife_edge, Budget(cpus=2, memory_bytes=8 * GIB, training_mem_bytes=1 * GIB)) == 8  # 8 GiB: 8 fit
    search = LoaderSearch(knife_edge(USER), Budget(cpus=2))
    run(search, knife_edge)
    assert search.with_headroom(search.baseline) is search.baseline  # the user's own settings are never grown
    supply_bound = dataclasses.replace(search.choice(), supply_wait_frac=0.2)  # its supply limited it: the search's
    assert search.with_headroom(supply_bound) is supply_bound  # own next trial, not an unmeasured count
    fell_back = LoaderSearch(trial(USER, 100.0, 0.9), Budget(cpus=2))
    run(fell_back, thrashing)
    assert fell_back.with_headroom(fell_back.choice()) == fell_back.choice()  # the model had it wrong
