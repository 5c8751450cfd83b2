"""The tuning session against a fake switcher and fake ranks: the agreed figures drive every decision."""

import dataclasses

import pytest

from pipeopt.tuning.agreement import agree
from pipeopt.tuning.loader_search import Budget, LoaderSettings
from pipeopt.tuning.session import Agreed, LoaderSession, TrialWindows, started_from
from tests.helpers import make_window

USER = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False)


class FakeSwitcher:
    def __init__(self):
        self.user_settings = self.current = self.fallback = USER
        self.failed = None
        self.switches = []
        self.taken_back = []  # the settings switched to with take_back
        self.restored = False

    def switch(self, settings, *, timeout_s=None, take_back=False):
        self.fallback, self.current = self.current, settings
        self.switches.append(settings)
        if take_back:
            self.taken_back.append(settings)

    def settle(self):
        pass

    def take_failure(self):
        failure, self.failed = self.failed, None
        return failure

    def restore_user(self):
        self.restored = True
        self.switch(USER)


def session(agree=lambda v: v, budget_s=60.0, clock=lambda: 0.0):
    resets = []
    switcher = FakeSwitcher()
    s = LoaderSession(switcher, budget=Budget(cpus=2), budget_s=budget_s,
                      windows=TrialWindows(lambda *args: resets.append(args)), clock=clock, agree=agree)
    return s, switcher, resets


def window(rate, wait):
    return make_window(samples_per_s=rate, data_wait_frac=wait, rate_rel_se=0.01)


def feed(s, rate, wait):
    s.on_window(window(rate, wait))
    s.on_step_end()


def test_a_failure_on_another_rank_fails_the_trial_on_every_rank():
    other_rank_failed = {"now": False}

    def agree(values):
        other = list(values)
        other[8] = 1.0 if other_rank_failed["now"] else 0.0  # the "failed" slot of the other rank's vector
        return [max(a, b) for a, b in zip(values, other)]

    s, switcher, _ = session(agree)
    feed(s, 100.0, 0.5)  # before: half the step waiting; the loader model picks 2 workers
    assert switcher.switches[-1].num_workers == 2
    other_rank_failed["now"] = True
    feed(s, 300.0, 0.5)  # this rank measured fine; the other rank's workers died
    failed = [t for t in s.search.trials if not t.ok]
    assert failed and failed[0].settings.num_workers == 2 and "another rank" in failed[0].error


def test_the_slowest_rank_and_the_largest_wait_decide():
    slower = {"rate": None}

    def agree(values):
        other = list(values)
        if slower["rate"] is not None:
            other[0] = -slower["rate"]
        return [max(a, b) for a, b in zip(values, other)]

    s, switcher, _ = session(agree)
    feed(s, 100.0, 0.9)
    slower["rate"] = 101.0  # this rank saw 300/s with a worker, the other rank only 101/s
    feed(s, 300.0, 0.5)
    assert s.search.trials[-1].rate.value == 101.0


def test_any_rank_over_budget_ends_the_search_on_all():
    t = {"now": 0.0}
    s, switcher, _ = session(budget_s=10.0, clock=lambda: t["now"])
    feed(s, 100.0, 0.5)
    t["now"] = 11.0
    feed(s, 150.0, 0.3)  # the model's 2 workers: faster, but the budget is spent
    assert any("budget (10 s) ran out" in n for n in s.notes)
    assert s.state == "after" and s.chosen.settings.num_workers == 2


def test_each_window_is_kept_with_the_settings_it_measured_and_the_slowest_ranks_rate():
    """What the sample cache pools into its window before: the loader search's windows of the settings in place,
    each as every rank agreed on it (a 1 s window: 10 steps of 100 ms)."""
    def agree(values):
        other = list(values)
        other[0] = max(values[0], -90.0)  # another rank: never faster than 90 samples/s
        return [max(a, b) for a, b in zip(values, other)]

    s, switcher, _ = session(agree)
    feed(s, 100.0, 0.9)
    feed(s, 300.0, 0.5)
    assert [(settings, rate.value, seconds) for settings, rate, seconds, _ in s.measured] == [
        (USER, 90.0, 1.0), (switcher.switches[0], 90.0, 1.0)]


def test_an_after_window_that_is_not_faster_reverts_to_the_users_loader():
    t = {"now": 0.0}
    s, switcher, _ = session(budget_s=10.0, clock=lambda: t["now"])
    feed(s, 100.0, 0.9)
    t["now"] = 11.0
    feed(s, 150.0, 0.6)
    feed(s, 101.0, 0.9)  # after-window: no better than before; measured once more
    assert s.state == "after"
    feed(s, 99.0, 0.9)
    assert s.state == "done" and switcher.restored
    assert any("reverted to your loader settings" in n for n in s.notes)
    assert s.changes == [] and s.kept is None


def test_ranks_agree_on_the_slowest_rate_and_the_largest_wait_of_a_window():
    mine = Agreed.of(window(250.0, 0.3), USER, mem=None, failed=False, over_budget=True)
    theirs = Agreed.of(window(200.0, 0.5), USER, mem=None, failed=False, over_budget=False)
    vector = []
    agree(theirs, lambda v: vector.extend(v) or v)  # what the other rank contributes
    both = agree(mine, lambda v: [max(a, b) for a, b in zip(v, vector)])
    assert both.rate.value == 200.0 and both.data_wait_frac == 0.5 and both.over_budget  # the worst of each
    assert both.worker_mem_bytes is None and not both.failed


def test_a_cached_configuration_is_trusted_when_it_verifies():
    s, switcher, _ = session()
    cached = USER.with_workers(4, persistent=True)
    s.verify_cached(cached, expected_rate=1000.0)
    assert switcher.current == cached
    assert started_from(s) == cached  # in force from the start: no window of the user's settings (the report says so)
    feed(s, 700.0, 0.1)  # short of 80 %: measured once more
    assert s.state == "verify"
    feed(s, 1000.0, 0.05)  # together 850: within the tolerance
    assert s.state == "done" and s.kept == cached and s.search is None and started_from(s) == cached
    assert any("applied the cached loader configuration" in n for n in s.notes)


def test_a_cached_configuration_that_falls_short_is_tuned_afresh():
    s, switcher, _ = session()
    s.verify_cached(USER.with_workers(4, persistent=True), expected_rate=1000.0)
    feed(s, 500.0, 0.5)
    feed(s, 520.0, 0.5)
    assert s.state == "before" and switcher.restored and not s.from_cache
    feed(s, 100.0, 0.9)  # the before-window of the fresh tuning
    assert s.state == "trial" and started_from(s) is None  # the user's settings were measured after all


def test_no_trial_starts_that_the_fit_cannot_finish():
    left = {"steps": 1000}
    switcher = FakeSwitcher()
    s = LoaderSession(switcher, budget=Budget(cpus=2), budget_s=60.0, clock=lambda: 0.0,
                      windows=TrialWindows(lambda *args: None, steps_left=lambda: left["steps"]))
    feed(s, 100.0, 0.5)  # before: the model picks 2 workers; 1000 steps left: room for them
    assert switcher.switches[-1].num_workers == 2
    left["steps"] = 30  # a trial window (20) and an after-window (20) no longer fit
    feed(s, 150.0, 0.3)
    assert switcher.switches[-1].num_workers == 2  # no new trial: the measured workers are chosen and verified
    assert s.state == "after"
    assert any("the fit has 30 optimizer steps left: too few for another trial" in n for n in s.notes)


def test_a_close_call_measures_the_users_own_loader_again_before_choosing():
    resets, said, switcher = [], [], FakeSwitcher()
    s = LoaderSession(switcher, budget=Budget(cpus=2), budget_s=60.0, clock=lambda: 0.0, say=said.append,
                      windows=TrialWindows(lambda *args: resets.append(args)))
    user_rates = iter([100.0, 104.0])  # the before-window, then the user's settings measured again
    while s.state not in ("after", "done"):
        workers = bool(switcher.switches) and switcher.switches[-1].num_workers > 0
        # the workers read 112 samples/s: 12 % ahead, within the noise of two windows of 5 % error each
        rate, wait = (112.0, 0.3) if workers else (next(user_rates), 0.5)
        s.on_window(make_window(samples_per_s=rate, data_wait_frac=wait, rate_rel_se=0.05))
        s.on_step_end()
    assert getattr(switcher, "restored", False)  # the user's own loader object again, not a copy of its settings
    assert any(label == "your settings, measured again" for label, *_ in resets)
    assert s.state == "done" and s.changes == []  # 112 against the two windows' 102: not beyond noise
    assert s.before_rate.value == pytest.approx(102.0)
    assert any(line.startswith("trial 0: num_workers=0") and "pooled over 2 windows" in line for line in said)


def test_no_trial_starts_that_the_epoch_making_a_store_of_whole_items_cannot_finish_on_any_rank():
    """A store of whole items is read from the epoch after the one that makes it: a trial running into that epoch, at
    a decoding loader's pace, would put the cached trials off. The horizon is the most steps any rank has (a rank
    whose store an earlier run kept has none: None)."""
    other = {"read_in": None}
    slot = [f.name for f in dataclasses.fields(Agreed)].index("read_in")

    def agree(values):
        theirs = list(values)
        theirs[slot] = float("-inf") if other["read_in"] is None else float(other["read_in"])
        return [max(a, b) for a, b in zip(values, theirs)]

    s, switcher, _ = session(agree)
    here = {"read_in": None}
    s.store_read_in = lambda: here["read_in"]
    feed(s, 100.0, 0.5)  # before: no store yet; the model picks 2 workers
    two = switcher.switches[-1]
    assert two.num_workers == 2
    here["read_in"], other["read_in"] = 200, None  # this rank makes its store: room for the next trial (20 + 40)
    feed(s, 150.0, 0.3)
    assert s.state == "trial" and switcher.switches[-1] != two
    third = switcher.switches[-1]
    here["read_in"], other["read_in"] = None, 30  # now only the other rank makes one, 30 steps from being read
    feed(s, 160.0, 0.3)
    assert switcher.switches[-1] == third  # no further trial: the fastest measured is chosen and verified
    assert s.state == "after" and s.chosen.settings == third
    assert any("the sample cache's store is read in 30 optimizer steps" in n for n in s.notes)


def test_a_warm_sample_store_ends_the_worker_search_so_the_cache_is_tried_next():
    s, switcher, _ = session()
    warm = {"now": False}
    s.store_warm = lambda: warm["now"]
    feed(s, 100.0, 0.9)  # before: the first trial is proposed
    first = switcher.switches[-1]
    warm["now"] = True  # the trial's loader filled the store
    feed(s, 300.0, 0.5)
    assert switcher.switches[-1] == first  # no further trial: the faster setting is chosen and measured after
    assert s.state == "after" and s.chosen.settings == first
    assert any("the sample cache's store holds an epoch" in n for n in s.notes)


def test_what_a_sample_costs_is_read_where_it_is_made_not_from_the_spinning_process():
    from pipeopt.measure.resources import ResourceFigures
    from pipeopt.tuning.session import cpu_per_sample

    # 10 steps of 32 samples; the training thread spent 40 ms a step inside the fetch, the process 20 ms a step
    # outside it; over the window the process read 190 % (its intra-op threads spinning while it waited)
    spinning = ResourceFigures(cpu_main_pct=190.0, cpu_workers_pct=160.0, workers=4)
    stats = window(320.0, 0.4)
    stats = type(stats)(**{**stats.__dict__, "step_cpu_s": 0.02, "fetch_cpu_s": 0.04, "resources": spinning})
    load, step = cpu_per_sample(stats, USER)  # no workers: the training thread loaded inside the fetch
    assert (load, step) == pytest.approx((0.04 / 32, 0.02 / 32))
    load, step = cpu_per_sample(stats, USER.with_workers(4, persistent=True))  # the workers loaded
    assert (load, step) == pytest.approx((1.6 / 320.0, 0.02 / 32))
    assert cpu_per_sample(stats, LoaderSettings.dali_on("cpu")) == (None, None)  # DALI's CPU is not modelled


def test_a_trial_window_lasts_window_s_at_the_pace_the_model_predicts_for_it():
    shapes = []
    windows = TrialWindows(lambda label, skip, length, blocks: shapes.append(length), window=20, min_window_s=1.0)
    windows.last_step_s, windows.last_rate = 0.1, 80.0  # the before-window: 10 steps a second
    six = USER.with_workers(6, persistent=True)
    windows.measure("trial", 0, six)  # nothing predicted: the last window's pace
    for predicted in (480.0, 40.0):  # 6x as fast: 60 steps a second; a slower prediction never shortens it
        windows.predicted = {six: predicted}.get
        windows.measure("trial", 0, six)
    assert shapes == [20, 60, 20]
    windows.predicted = {six: 480.0}.get
    assert windows.trial_steps(USER, six) == (1 + 13 + 60) + 2 * 60  # the trial, then two after-windows of it


def test_a_trials_room_holds_the_switch_back_to_a_setting_tried_before_it_and_its_after_windows():
    windows = TrialWindows(lambda *args: None, window=4)
    four, eight = USER.with_workers(4, persistent=True), USER.with_workers(8, persistent=True)  # 9 and 17 in flight
    trial = 9 + 17 + 17  # from four to eight: both queues skipped, a window as long as eight's queue
    assert windows.trial_steps(four, eight) == trial + 2 * 17
    assert windows.trial_steps(four, eight, [four]) == trial + (17 + 9) + 2 * 9  # four chosen: back to it


def test_a_trials_room_in_a_bounded_fit_counts_its_windows_as_they_will_be_cut():
    """A trial predicted much faster than the window before it has windows of ``min_window_s`` at the new pace:
    thousands of steps, more than a short fit has left. ``measure`` cuts each to a third of what is left then, so
    the room a trial needs is counted with those cuts - the trial is not refused for windows it would never run."""
    four, cached = USER.with_workers(4, persistent=True), dataclasses.replace(USER, cache=True)
    windows = TrialWindows(lambda *args: None, window=20, min_window_s=1.0, steps_left=lambda: 800)
    windows.last_step_s, windows.last_rate = 0.01, 3200.0  # 100 steps a second
    windows.predicted = {cached: 14000.0}.get  # 1 s at the predicted pace: 437 steps
    skip = four.in_flight + cached.in_flight
    trial = skip + (800 - skip) // 3
    first = (800 - trial) // 3
    assert windows.trial_steps(four, cached) == trial + first + (800 - trial - first) // 3 <= 800
    windows.steps_left = lambda: None  # an unbounded fit: whole windows of 1 s each
    assert windows.trial_steps(four, cached) == skip + 3 * 437
    windows.steps_left = lambda: 60  # too short even for windows of `window` steps
    assert windows.trial_steps(four, cached) == skip + 3 * 20 > 60


def _tuned_in_a_fit_of(fit_steps):
    """A loader session in a fit of ``fit_steps`` optimizer steps (window 4, after a 2-step warm-up) where any
    worker count measures 3x the main process, the counts within the floor of each other, and still waits: each
    refit picks more workers (2, 4, 7) and the cheapest wins. Returns the windows cut and the phase the fit ended
    in (the first window the fit could not close ends it)."""
    cut, used = [], {"steps": 2 + 4}  # the warm-up and the before-window

    def reset_meter(label, skip, length, blocks):
        cut.append((label, skip, length or 4))

    s = LoaderSession(FakeSwitcher(), budget=Budget(cpus=8), budget_s=60.0, clock=lambda: 0.0,
                      windows=TrialWindows(reset_meter, window=4, steps_left=lambda: fit_steps - used["steps"]))
    feed(s, 100.0, 0.6)
    while s.state in ("trial", "after"):
        _, skip, length = cut[-1]
        if used["steps"] + skip + length > fit_steps:
            break
        used["steps"] += skip + length
        feed(s, 300.0 + s._applied.num_workers, 0.3)
    return [label for label, _, _ in cut], s.state


def test_a_fit_of_any_length_closes_every_trial_and_after_window_the_session_starts():
    ended = {steps: _tuned_in_a_fit_of(steps) for steps in range(20, 401, 4)}
    assert {steps: state for steps, (_, state) in ended.items() if state != "done"} == {}
    labels, _ = ended[400]  # a long fit: three trials, then back from the largest to the cheapest
    assert [label.split(",")[0] for label in labels] == [
        "trial: num_workers=2", "trial: num_workers=4", "trial: num_workers=7", "after: num_workers=2"]


def test_the_session_sizes_a_trial_by_the_models_prediction():
    shapes = []
    s = LoaderSession(FakeSwitcher(), budget=Budget(cpus=2), budget_s=60.0, clock=lambda: 0.0,
                      windows=TrialWindows(lambda label, skip, length, blocks: shapes.append((label, length)),
                                           window=20, min_window_s=3.0))
    feed(s, 100.0, 0.5)  # steps of 100 ms: 3 s would be 30 of them; the model predicts 2 workers at 200/s
    label, length = shapes[-1]
    assert label.startswith("trial: num_workers=2") and s.search.predictions[s._trial] == 200.0
    assert length == 60  # 3 s at the predicted pace, twice the before-window's


def test_a_window_paced_in_seconds_takes_at_most_a_third_of_what_the_fit_has_left():
    """After a trial much faster than the window before it, an after-window of ``min_window_s`` at the new pace can
    be thousands of steps: it is cut to a third of the steps left after its skip (never under ``window``), so the
    fit closes it and the change is verified."""
    shapes: list[tuple] = []
    left = {"steps": 3000}
    windows = TrialWindows(lambda label, skip, length, blocks: shapes.append((label, skip, length)), window=20,
                           min_window_s=3.0, steps_left=lambda: left["steps"])
    windows.last_step_s = 0.0006  # the trial ran at ~0.6 ms a step: 3 s is 5,000 steps
    settings = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False)
    windows.measure("after", 0, settings)
    assert shapes[-1] == ("after", 0, 1000)
    windows.measure("after", 30, settings)
    assert shapes[-1] == ("after", 30, 990)
    left["steps"] = 45
    windows.measure("after", 0, settings)
    assert shapes[-1] == ("after", 0, 20)  # never under `window`
    windows.steps_left = lambda: None  # an unbounded fit: seconds at the pace, as before
    windows.measure("after", 0, settings)
    assert shapes[-1] == ("after", 0, 5000)


def test_a_choice_with_no_supply_to_spare_is_measured_and_kept_with_the_models_headroom():
    from pipeopt.report.findings import loader_changes

    s, switcher, _ = session()
    # before: 80 samples/s waiting 85 % of each 100 ms step, 0.2 ms of the main process's CPU a sample loading
    s.on_window(make_window(samples_per_s=80.0, data_wait_frac=0.85, rate_rel_se=0.01, fetch_cpu_s=0.0016,
                            samples=80, steps=10))
    s.on_step_end()
    pick = switcher.switches[-1].num_workers
    # its trial: the step's pace, every fetch finding a batch ready - no supply to spare, and no gain predicted
    s.on_window(make_window(samples_per_s=100.0 * pick, data_wait_frac=0.12, starved_wait_frac=0.0,
                            rate_rel_se=0.01, samples=320, steps=10))
    s.on_step_end()
    assert s.state == "after" and len(s.search.trials) == 2
    grown = switcher.switches[-1]  # the after-window measures the workers the model keeps headroom with
    assert grown.num_workers > pick and s.chosen.headroom_from == pick and s.chosen.settings == grown
    s.on_window(make_window(samples_per_s=100.0 * pick, data_wait_frac=0.05, rate_rel_se=0.01))
    s.on_step_end()
    assert s.state == "done" and s.kept == grown
    change = next(c for c in loader_changes(s) if c.knob == "num_workers")
    assert change.after == grown.num_workers and f"with {pick} in their trial" in change.reason
    assert "headroom" in change.reason and change.predicted_speedup == pytest.approx(s.chosen.predicted / 80.0)


def test_more_workers_kept_on_a_climb_say_so_in_the_changes_reason():
    from pipeopt.tuning.loader_search import Trial
    from pipeopt.tuning.noise import Rate
    from pipeopt.tuning.session import _kept_reasons

    user = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False)
    climbed = Trial(user.with_workers(9, persistent=True), Rate(1400.0, 0.08), climbed_from=3)
    reason = _kept_reasons(user, Rate(900.0, 0.02), climbed)("num_workers")
    assert "900.0 -> 1,400.0 samples/s" in reason and "more workers than 3" in reason
    assert "the cheapest setting" not in reason  # 9 was not the cheapest setting no trial beat


def test_a_window_in_parts_holds_the_steps_of_the_whole_window_the_first_part_shortest_and_whole_epochs_uncut():
    """A trial's first part is the fewest steps a window holds (a far slower trial stops after those), the rest of
    the window in equal parts of at least as many; a window too short for two parts, or of whole epochs, is one."""
    shapes: list[tuple] = []
    windows = TrialWindows(lambda label, skip, length, blocks: shapes.append((skip, length, blocks)), window=20,
                           min_window_s=2.9)
    windows.last_step_s = 0.01  # 289 steps (2.9 s at 10 ms, rounded down): 20, then four parts of 68
    four = USER.with_workers(4, persistent=True)
    assert windows.measure_parts("trial", 13, four, 5) == (20, 68, 5) and shapes[-1] == (13, 20, 5)
    windows.measure_part("trial", 68)
    assert shapes[-1] == (0, 68, 5)  # the next part at once: no skip
    windows.last_step_s = 0.05  # 57 steps: 20, then the 37 left in one part (too few for two of `window`)
    assert windows.measure_parts("trial", 0, four, 5) == (20, 37, 2)
    windows.last_step_s = 0.138  # 21 steps: one part, not two of `window` (40 steps where 21 were asked)
    assert windows.measure_parts("trial", 0, four, 5) == (21, 0, 1)
    windows.last_step_s, windows.epoch_steps = 0.05, 30  # 57 steps are two epochs of 30: one window of them, uncut
    assert windows.measure_parts("trial", 0, four, 5) == (60, 0, 1) and shapes[-1] == (0, 60, 2)


def test_a_window_in_even_parts_looks_first_after_a_share_of_the_whole_window():
    """An after-window's parts are even (its first look already spans a share of the window's seconds): as many as
    asked where each holds at least ``window`` steps, together the whole window; fewer where the window is
    shorter; whole epochs uncut."""
    shapes: list[tuple] = []
    windows = TrialWindows(lambda label, skip, length, blocks: shapes.append((skip, length, blocks)), window=20,
                           min_window_s=3.0)
    four = USER.with_workers(4, persistent=True)
    windows.last_step_s = 0.01  # 300 steps: three parts of 100
    assert windows.measure_parts("after", 7, four, 3, even=True) == (100, 100, 3) and shapes[-1] == (7, 100, 5)
    windows.last_step_s = 0.06  # 50 steps: two parts of 25 (three would hold fewer than `window`)
    assert windows.measure_parts("after", 0, four, 3, even=True) == (25, 25, 2)
    windows.last_step_s = 0.1  # 30 steps: one part
    assert windows.measure_parts("after", 0, four, 3, even=True) == (30, 30, 1)
    windows.last_step_s, windows.epoch_steps = 0.01, 100  # 300 steps are three epochs: one window of them
    assert windows.measure_parts("after", 0, four, 3, even=True) == (300, 300, 1) and shapes[-1] == (0, 300, 3)
