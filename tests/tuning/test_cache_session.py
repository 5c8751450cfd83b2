"""The sample-cache session against a fake switcher in synthetic worlds: it waits until the store is warm on every
rank, keeps the cache only when faster beyond noise, cuts workers the cache made idle, and restores otherwise."""

from __future__ import annotations

import dataclasses

import pytest

from pipeopt.tuning.cache_session import CacheSession, best_speedup, pool_recent
from pipeopt.tuning.loader_search import LoaderSettings
from pipeopt.tuning.noise import Rate
from pipeopt.tuning.session import Agreed, TrialWindows
from tests.helpers import make_window
from tests.tuning.test_session import USER, FakeSwitcher

COLD = [f.name for f in dataclasses.fields(Agreed)].index("store_cold")
BESIDE = [f.name for f in dataclasses.fields(Agreed)].index("beside")
EIGHT = LoaderSettings(num_workers=8, prefetch_factor=2, persistent_workers=True, pin_memory=False)


def world_storage_bound(settings: LoaderSettings) -> tuple[float, float]:
    """Samples/s and data wait: each sample waits on storage; from the store the step's compute (1000/s) limits."""
    if settings.cache:
        return (1000.0, 0.01) if settings.num_workers >= 2 else (950.0 if settings.num_workers == 1 else 700.0, 0.2)
    return 400.0 * min(settings.num_workers, 8) / 8, 0.6


def world_compute_light(settings: LoaderSettings) -> tuple[float, float]:
    """The cache saves nothing measurable: loading was cheap already."""
    return 500.0, 0.15


def run(world, *, warm_after: int = 2, installed_fills: bool = True, other_rank_cold: bool = False,
        before_wait: float | None = 0.6, windows: int = 20, current: LoaderSettings = EIGHT,
        filler: LoaderSettings | None = None, alone_first: bool = False, max_workers: int | None = None,
        dali_reads: bool = False):
    switcher = FakeSwitcher()
    switcher.current = current
    seen = {"windows": 0}

    def agree(values):
        values = list(values)
        if other_rank_cold and len(values) > COLD:
            values[COLD] = 1.0  # another rank's store is not warm yet
        return values

    session = CacheSession(switcher, windows=TrialWindows(lambda *args: None),
                           warm=lambda: seen["windows"] >= warm_after, fills=lambda: installed_fills, agree=agree,
                           alone_first=alone_first, max_workers=max_workers, dali_reads=dali_reads)
    session.begin(before_wait, filler)
    for _ in range(windows):
        if session.state == "done":
            break
        rate, wait, *figures = world(switcher.current)  # (and the window's other figures, where a world has them)
        session.on_window(make_window(samples_per_s=rate, data_wait_frac=wait, rate_rel_se=0.01, **dict(*figures)))
        seen["windows"] += 1
        session.on_step_end()
    return session, switcher


def labelled(current: LoaderSettings, *, warm_after: int, fills: bool):
    """A session whose windows' labels are recorded (a trial asks for 3 s), warm after ``warm_after`` windows."""
    labels: list[str] = []
    switcher = FakeSwitcher()
    switcher.current = current
    session = CacheSession(switcher, windows=TrialWindows(lambda label, *shape: labels.append(label),
                                                          min_window_s=3.0),
                           warm=lambda: labels.count("window") >= warm_after, fills=lambda: fills)
    return session, switcher, labels


def window_ends(session: CacheSession, labels: list[str], rate: float, wait: float) -> None:
    session.on_window(make_window(samples_per_s=rate, data_wait_frac=wait, rate_rel_se=0.01))
    labels.append("window")
    session.on_step_end()


def test_the_cache_is_tried_once_the_store_is_warm_and_kept_with_fewer_workers():
    session, switcher = run(world_storage_bound)
    # two windows filling (cold), then before; the cache with the 8 workers in place, then the main process alone
    # (slower), then halving from 8: 4 and 2 keep pace, 1 is slower beyond noise
    tried = [(s.num_workers, s.cache) for s in switcher.switches]
    assert tried[:5] == [(8, True), (0, True), (4, True), (2, True), (1, True)]
    assert session.kept == dataclasses.replace(EIGHT, num_workers=2, cache=True)
    assert switcher.current == session.kept
    knobs = {c.knob: (c.before, c.after) for c in session.outcome.changes}
    assert knobs == {"cache": (False, True), "num_workers": (8, 2)}
    cache_change = session.outcome.changes[0]
    assert cache_change.predicted_speedup == 2.5 and cache_change.measured_speedup == 2.5
    assert best_speedup(session.trials, session.before) == 2.5
    # every switch to a warm store takes back what the loader in place had not delivered (``Handover.take_back``)
    assert switcher.taken_back == switcher.switches and all(s.cache for s in switcher.switches)


def test_the_window_in_which_the_store_turns_warm_is_the_window_before():
    """The warm epoch is not spent on one more window of the slow settings: the first cached trial follows the
    window that found the store warm, and its speedup is over that window's rate."""
    labels: list[str] = []
    switcher = FakeSwitcher()
    switcher.current = EIGHT
    session = CacheSession(switcher, windows=TrialWindows(lambda label, *shape: labels.append(label)),
                           warm=lambda: labels.count("window") >= 2, fills=lambda: True)
    session.begin(0.6)
    for rate in (300.0, 400.0):  # cold, then warm
        session.on_window(make_window(samples_per_s=rate, data_wait_frac=0.6, rate_rel_se=0.01))
        labels.append("window")
        session.on_step_end()
    assert session.before is not None and session.before.value == 400.0
    assert switcher.switches == [dataclasses.replace(EIGHT, cache=True, give_way=True)]
    assert labels[0] == "filling the sample cache" and "cache: before" not in labels


def test_the_loader_searchs_windows_of_the_settings_in_place_are_pooled_into_the_window_before():
    """The loader search measured the settings in place (its after-windows) just before: with them, the window
    that finds the store warm completes a window before of a trial's length - no window of its own. Without them
    (a 1 s window against 3 s asked), the cached trials go first, judged provisionally against that window
    (``test_windows_before_spanning_too_little_are_measured_again_only_when_no_cached_trial_is_clearly_faster``)."""
    def tried(measured):
        session, _, labels = labelled(EIGHT, warm_after=1, fills=True)
        session.begin(0.6, None, measured)
        window_ends(session, labels, 400.0, 0.6)  # 10 x 0.1 s
        return session, labels

    session, labels = tried([(Rate(300.0, 0.01), 2.5, 0.6)])
    assert "cache: before" not in labels and labels[-1].startswith("cache trial")
    assert session.before is not None and round(session.before.value, 1) == round((300 * 2.5 + 400) / 3.5, 1)
    session, labels = tried([])
    assert "cache: before" not in labels and labels[-1].startswith("cache trial")
    assert session.before is not None and session.before.value == 400.0


def test_nothing_is_tried_while_any_rank_is_cold():
    session, switcher = run(world_storage_bound, other_rank_cold=True)
    assert session.state == "wait" and switcher.switches == []


def test_a_cache_that_is_not_faster_is_not_kept_and_the_settings_in_place_return():
    session, switcher = run(world_compute_light)
    assert session.state == "done" and session.kept is None
    # the workers in place (giving way) and the main process alone, both read from the store; the cheapest of them,
    # the main process alone, has no workers to try at the usual priority; none faster: back
    assert [(s.num_workers, s.cache, s.give_way) for s in switcher.switches] == [
        (8, True, True), (0, True, False), (8, False, False)]
    assert switcher.current == EIGHT
    assert switcher.taken_back == switcher.switches[:2]  # back to the slower loader: what the store's gave is kept
    assert any("not faster beyond noise" in n for n in session.outcome.notes)


def test_a_compute_bound_run_is_left_alone():
    session, switcher = run(world_storage_bound, before_wait=0.05)
    assert session.state == "done" and switcher.switches == [] and session.kept is None
    assert any("compute-bound" in n for n in session.outcome.notes)


def test_a_wait_the_cache_could_take_away_beyond_the_floor_is_tried_and_one_under_it_is_not():
    """The loader search left the loop waiting 8 % of each step: reading from the store can take that away (1.09x,
    beyond the 5 % floor), so it is tried; at 3 % it could not pay, and nothing is tried."""
    def almost_fed(wait):
        return lambda settings: (980.0, 0.01) if settings.cache else (900.0, wait)

    session, switcher = run(almost_fed(0.08))
    assert switcher.switches and all(s.cache for s in switcher.switches) and session.kept is not None
    session, switcher = run(almost_fed(0.03))
    assert switcher.switches == [] and session.kept is None
    assert any("compute-bound (the loop waited for data 3%" in n for n in session.outcome.notes)


def test_windows_before_that_say_the_loop_hardly_waited_are_confirmed_by_one_measured_now():
    """The host ran the step 6x slower for a stretch of the fill (measured in storage_latency: 16 s), and the windows
    pooled for the window before say the loop hardly waited. A window measured now decides: where the loop waits
    again, the cache is tried; where it confirms, nothing is."""
    for now_wait, tried in ((0.3, True), (0.03, False)):
        session, switcher, labels = labelled(EIGHT, warm_after=1, fills=True)
        session.begin(0.6, None, [(Rate(100.0, 0.01), 1.5, 0.03), (Rate(100.0, 0.01), 1.5, 0.03)])
        window_ends(session, labels, 100.0, 0.03)  # the last filling window: the store is warm
        assert labels[-2:] == ["window", "cache: before"] and switcher.switches == []
        window_ends(session, labels, 400.0, now_wait)
        assert bool(switcher.switches) == tried and all(s.cache for s in switcher.switches)
        assert any("compute-bound (the loop waited for data 3%" in n for n in session.outcome.notes) != tried
        if not tried:  # the fit's later windows are labelled for what is in place, not as more windows before
            assert labels[-1] == "cache not kept", labels


def test_the_users_own_loader_is_replaced_by_a_filling_copy_before_waiting():
    session, switcher = run(world_storage_bound, installed_fills=False, warm_after=100, windows=3)
    assert switcher.switches == [EIGHT] and session.state == "wait"


def test_an_after_window_that_falls_back_reverts():
    calls = {"n": 0}

    def fades(settings):
        calls["n"] += 1
        if settings.cache and calls["n"] >= 8:  # the after-windows: no better than before
            return 400.0, 0.6
        return world_storage_bound(settings)

    session, switcher = run(fades)
    assert session.kept is None and switcher.current == EIGHT
    assert any("not faster beyond noise" in n for n in session.outcome.notes)


def test_resume_applies_the_kept_cache_without_trials():
    switcher = FakeSwitcher()
    session = CacheSession(switcher, windows=TrialWindows(lambda *args: None), warm=lambda: False,
                           fills=lambda: True)
    kept = dataclasses.replace(EIGHT, num_workers=2, cache=True)
    session.restore(kept)
    assert switcher.switches == [kept] and session.state == "done" and session.kept == kept


def test_under_dali_a_dataloader_fills_the_store_and_the_cache_must_beat_dali():
    dali = LoaderSettings.dali_on("cpu")
    two = dataclasses.replace(EIGHT, num_workers=2)

    def world(settings):
        if settings.dali:
            return 500.0, 0.3
        if settings.cache:
            return {2: 900.0, 1: 890.0, 0: 500.0}[settings.num_workers], 0.02
        return 400.0, 0.5

    session, switcher = run(world, current=dali, filler=two, installed_fills=False, before_wait=0.3)
    # filled by the DataLoader (reading what the store holds already), then DALI measured for the window before
    assert switcher.switches[:2] == [dataclasses.replace(two, cache=True), dali]
    assert [(s.num_workers, s.cache) for s in switcher.switches[2:5]] == [(2, True), (0, True), (1, True)]
    assert session.kept == dataclasses.replace(two, num_workers=1, cache=True)
    assert {c.knob: (c.before, c.after) for c in session.outcome.changes} == {
        "cache": (False, True), "dali": ("cpu", None), "num_workers": (0, 1)}


@pytest.mark.parametrize("fed_rate, fed_wait", [(1400.0, 0.02), (600.0, 0.3)])
def test_under_dali_fed_from_the_store_is_tried_first_and_kept_with_dali_where_fastest(fed_rate, fed_wait):
    dali = LoaderSettings.dali_on("cpu")
    two = dataclasses.replace(EIGHT, num_workers=2)
    fed = dataclasses.replace(dali, cache=True)

    def world(settings):
        if settings.dali:
            return (fed_rate, fed_wait) if settings.cache else (500.0, 0.3)
        if settings.cache:
            return {2: 900.0, 1: 890.0, 0: 500.0}[settings.num_workers], 0.02
        return 400.0, 0.5

    session, switcher = run(world, current=dali, filler=two, installed_fills=False, before_wait=0.3, dali_reads=True)
    assert switcher.switches[:3] == [dataclasses.replace(two, cache=True), dali, fed]
    changes = {c.knob: (c.before, c.after) for c in session.outcome.changes}
    if fed_wait < 0.1:  # the loop no longer waits: no cached workers could do better; DALI stays, fed the store
        assert switcher.switches[3:] == [] and session.kept == fed and changes == {"cache": (False, True)}
        assert fed.describe() == "DALI (cpu, reading the sample cache)"
    else:  # still waiting: the DataLoader's workers reading the store are tried next, and win
        assert switcher.switches[3] == dataclasses.replace(two, cache=True, give_way=True)
        assert session.kept is not None and not session.kept.dali and changes["dali"] == ("cpu", None)
    # where DALI cannot be fed the store (the cached part is not an image: ``dali_reads``), it is not tried
    _, switcher = run(world, current=dali, filler=two, installed_fills=False, before_wait=0.3)
    assert fed not in switcher.switches


def test_under_dali_the_loader_searchs_windows_of_dali_are_the_window_before():
    """DALI was measured by the loader search (its trial and after-window): pooled, they are the window before, and
    the first cached trial follows the filling DataLoader at once - no switch back to DALI for a window of its own.
    They are DALI's alone: the filling DataLoader's windows are not the settings in place - and so it reads the
    samples the store holds already instead of making them again (at the usual priority: it decodes the rest)."""
    dali, two = LoaderSettings.dali_on("cpu"), dataclasses.replace(EIGHT, num_workers=2)
    session, switcher, labels = labelled(dali, warm_after=2, fills=False)
    session.begin(0.3, two, [(Rate(500.0, 0.01), 1.5, 0.3), (Rate(520.0, 0.01), 1.5, 0.3)])
    for _ in range(2):  # the filling DataLoader, at 700/s: cold, then warm
        window_ends(session, labels, 700.0, 0.5)
    assert switcher.switches == [dataclasses.replace(two, cache=True),
                                 dataclasses.replace(two, cache=True, give_way=True)]
    assert "cache: before" not in labels
    assert session.before is not None and session.before.value == 510.0  # DALI's two windows, not the filler's


def test_no_cache_trial_starts_that_the_fit_cannot_finish():
    switcher = FakeSwitcher()
    switcher.current = EIGHT
    session = CacheSession(switcher, windows=TrialWindows(lambda *args: None, window=20, steps_left=lambda: 40),
                           warm=lambda: True, fills=lambda: True)
    session.begin(0.6)
    session.on_window(make_window(samples_per_s=400.0, data_wait_frac=0.6, rate_rel_se=0.01))
    session.on_step_end()
    assert session.state == "done" and switcher.switches == []
    assert any("too few for a cached trial and an after-window" in n for n in session.outcome.notes)


def test_a_cache_trial_starts_in_a_short_fit_with_its_windows_cut_to_what_is_left():
    """Steps of 10 ms and ``window_s`` of 3 s: windows of 300 steps, three of which a fit with 400 steps left cannot
    hold. ``measure`` would cut them to a third of what is left, so the trial starts (found on a GPU: a store full
    with 800 steps to go, refused for needing 1,405)."""
    switcher = FakeSwitcher()
    switcher.current = EIGHT
    session = CacheSession(switcher, windows=TrialWindows(lambda *args: None, window=20, min_window_s=3.0,
                                                          steps_left=lambda: 400),
                           warm=lambda: True, fills=lambda: True)
    session.begin(0.6)
    for _ in range(2):  # the store is warm: the window before, then the trial
        session.on_window(make_window(samples_per_s=3200.0, step_time_s=0.01, data_wait_frac=0.6, rate_rel_se=0.01))
        session.on_step_end()
    assert session.state == "trial" and [s.cache for s in switcher.switches] == [True]


def test_under_dali_no_store_is_filled_that_the_fit_could_not_try_after_the_epoch_that_made_it():
    """The store is read from the epoch after the one that made it: a fill that leaves no room for a cached trial
    and its after-window then costs the rest of the epoch at the filling DataLoader's pace, for nothing."""
    dali, two = LoaderSettings.dali_on("cpu"), dataclasses.replace(EIGHT, num_workers=2)
    for left, filled in ((400, True), (150, False)):
        switcher = FakeSwitcher()
        switcher.current = dali
        session = CacheSession(switcher, windows=TrialWindows(lambda *args: None, window=20,
                                                              steps_left=lambda left=left: left),
                               warm=lambda: False, fills=lambda: False, to_warm=lambda: 100)
        session.begin(0.3, two)
        filler = dataclasses.replace(two, cache=True)
        assert switcher.switches == ([filler] if filled else []) and (session.state == "done") != filled
    assert any("too few to fill the store until the next epoch (100), then for a cached trial" in n
               for n in session.outcome.notes), session.outcome.notes


def test_every_rank_leaves_the_room_to_warm_that_the_rank_needing_most_does():
    """Nodes each have a store: a kept one may hold an epoch already on one node (no steps to wait) and have been
    made in this epoch on another (100 steps left in it). Every rank decides the room for a fill on the most any
    rank needs - one that filled and tried while another gave up would measure its windows, and call the
    collectives at their ends, at steps the other does not."""
    dali, two = LoaderSettings.dali_on("cpu"), dataclasses.replace(EIGHT, num_workers=2)

    def fills(other_rank_to_warm: float) -> bool:
        switcher = FakeSwitcher()
        switcher.current = dali

        def agree(values):  # the one-field figures: the steps each rank's store still needs to warm
            return [max(values[0], other_rank_to_warm)] if len(values) == 1 else list(values)

        session = CacheSession(switcher, windows=TrialWindows(lambda *args: None, window=20, steps_left=lambda: 150),
                               warm=lambda: False, fills=lambda: False, to_warm=lambda: 0, agree=agree)
        session.begin(0.3, two)
        return switcher.switches == [dataclasses.replace(two, cache=True)] and session.state != "done"

    assert fills(other_rank_to_warm=0.0)  # this rank's store holds an epoch, and so does every other's: room
    assert not fills(other_rank_to_warm=100.0)  # another rank's store was made this epoch: no room on any rank


def test_when_the_main_process_alone_keeps_pace_no_workers_are_kept():
    def world(settings):
        if settings.cache:  # the store removed the work: the workers' processes only cost CPU and IPC
            return (1000.0 if settings.num_workers == 0 else 900.0), 0.01
        return 400.0, 0.6

    session, switcher = run(world)
    assert [(s.num_workers, s.cache) for s in switcher.switches[:2]] == [(8, True), (0, True)]
    assert session.kept == dataclasses.replace(EIGHT.with_workers(0, persistent=True), cache=True)
    assert {c.knob: (c.before, c.after) for c in session.outcome.changes} == {
        "cache": (False, True), "num_workers": (8, 0)}


def test_whole_items_try_the_main_process_alone_first_and_stop_there_when_the_loop_no_longer_waits():
    def world(settings):  # whole items in the store: reading one is all that is left
        if settings.cache:
            return (1000.0, 0.03) if settings.num_workers == 0 else (900.0, 0.02)
        return 400.0, 0.6

    session, switcher = run(world, alone_first=True)
    assert [(s.num_workers, s.cache) for s in switcher.switches] == [(0, True)]  # one trial, then its after-window
    assert session.kept == dataclasses.replace(EIGHT.with_workers(0, persistent=True), cache=True)


def test_whole_items_still_try_the_workers_when_the_main_process_alone_leaves_a_wait():
    def world(settings):
        if settings.cache:
            return (600.0, 0.4) if settings.num_workers == 0 else (1000.0, 0.02)
        return 400.0, 0.6

    session, switcher = run(world, alone_first=True)
    tried = [(s.num_workers, s.cache) for s in switcher.switches]
    assert tried[:3] == [(0, True), (8, True), (4, True)]  # alone, the workers in place, then halving
    assert session.kept is not None and session.kept.cache and session.kept.num_workers >= 1



@pytest.mark.parametrize("cpu_main_pct", [199.0, 120.0])
def test_whole_items_try_the_workers_only_where_the_training_process_leaves_cpus_idle_for_their_loading(cpu_main_pct):
    """On the rank's 2 CPUs, the main process alone reading from the store (5 ms of 32 samples a 100 ms step, 320
    samples/s: 0.05 CPUs busy loading) used 199 %: workers could only take CPU time from the step - not tried, and
    the report says why. Using 120 %, 0.8 CPUs were idle: the workers in place are tried."""
    from pipeopt.measure.resources import ResourceFigures

    def world(settings):
        if settings.cache and settings.num_workers == 0:  # the loop still waits 25 % of a step: the read
            return 320.0, 0.25, {"fetch_cpu_s": 0.005, "resources": ResourceFigures(cpu_main_pct=cpu_main_pct)}
        return (330.0, 0.02) if settings.cache else (100.0, 0.6)

    session, switcher = run(world, alone_first=True, max_workers=2)
    tried = [(s.num_workers, s.cache) for s in switcher.switches]
    if cpu_main_pct > 190:
        assert tried == [(0, True)]  # the main process alone, then its after-window
        change = next(c for c in session.outcome.changes if c.knob == "num_workers")
        assert "workers were not tried" in change.reason and "room -0.04 CPUs" in change.reason
    else:
        assert tried[:2] == [(0, True), (2, True)]  # the workers in place, at most one per CPU
    assert session.kept is not None and session.kept.cache


def test_a_fit_that_ends_mid_session_says_where_it_stopped():
    notes = {}
    for windows in range(1, 12):
        session, switcher = run(world_storage_bound, windows=windows)
        notes.setdefault(session.state, session.report().notes[0])
        assert session.report().changes == session.outcome.changes
    assert "before the store held an epoch" in notes["wait"]
    assert "while the cache was being tried; it ended on num_workers=" in notes["trial"]
    assert "after-window of num_workers=2" in notes["after"] and "unverified" in notes["after"]
    assert notes["done"].startswith("sample cache kept")


def test_the_window_before_pools_the_last_waiting_windows_until_they_span_a_trial():
    windows = [(Rate(100.0, 0.01), 1.0, 0.9), (Rate(300.0, 0.01), 1.0, 0.5), (Rate(500.0, 0.01), 2.0, 0.3)]
    rate, wait = pool_recent(windows, 3.0)  # the last two span 3 s: time-weighted, the first left out
    assert rate.value == (300.0 + 2 * 500.0) / 3 and wait == (0.5 + 2 * 0.3) / 3
    assert rate.rel_se >= 200.0 / 2 ** 0.5 / 2 / rate.value  # their spread counts, not only their own noise
    assert pool_recent(windows, 5.0) is None  # all of them span less: a window of its own is measured


def provisional_before(cached: float | None, before_now: float, current: LoaderSettings = EIGHT):
    """A session whose one window of the settings in place (1 s at 400 samples/s, waiting 60 %) finds the store warm,
    against a window before of 3 s asked; every cached setting then reads ``cached`` samples/s (None: its loader
    fails), and a window before measured later ``before_now``. The session, its windows' labels and the switcher."""
    labels: list[str] = []
    switcher = FakeSwitcher()
    switcher.current = current
    session = CacheSession(switcher, windows=TrialWindows(lambda label, *shape: labels.append(label),
                                                          min_window_s=3.0),
                           warm=lambda: True, fills=lambda: True)
    session.begin(0.6)
    for _ in range(20):
        if session.state == "done":
            break
        if labels[-1] == "cache: before":
            rate, wait = before_now, 0.6
        elif not switcher.current.cache:
            rate, wait = 400.0, 0.6
        else:
            switcher.failed = None if cached is not None else RuntimeError("a loader worker died")
            rate, wait = cached or 0.0, 0.1
        window_ends(session, labels, rate, wait)
    return session, labels, switcher


def test_windows_before_spanning_too_little_are_measured_again_only_when_no_cached_trial_is_clearly_faster():
    """A window of the slow settings measured before the trials could take most of a warm epoch on a fast step (2.4 s
    of a 3.8 s one, on 2 CPUs): where the windows waited span less than a trial, the cached trials go first, judged
    against them. A trial clearly faster (twice the gap ``faster`` asks) settles it - no window of the settings in
    place is measured. Otherwise one is, after the trials, and the choice is made against it alone: the short
    windows may have read the settings in place faster (or slower) than they run."""
    session, labels, _ = provisional_before(cached=1000.0, before_now=400.0)
    assert "cache: before" not in labels and session.kept is not None
    assert session.before is not None and session.before.value == 400.0
    assert session.outcome.changes[0].measured_speedup == 2.5

    for before_now, kept in ((300.0, True), (420.0, False)):  # 430 is faster than 400, not clearly
        session, labels, _ = provisional_before(cached=430.0, before_now=before_now)
        trials = [i for i, label in enumerate(labels) if label.startswith("cache trial")]
        assert labels.count("cache: before") == 1 and trials and labels.index("cache: before") > trials[-1]
        assert session.before is not None and session.before.value == before_now
        assert (session.kept is not None) == kept, session.outcome.notes

    session, labels, _ = provisional_before(cached=None, before_now=400.0)  # no cached trial measured: nothing to judge
    assert "cache: before" not in labels and session.kept is None and session.state == "done"

    # the user's own settings: measured again after the trials on pipeopt's copy of their loader, which fills the
    # store; not kept, the user's own loader is back
    session, labels, switcher = provisional_before(cached=430.0, before_now=420.0, current=USER)
    assert labels.count("cache: before") == 1 and session.kept is None and switcher.restored


def test_too_little_waited_for_a_window_before_measures_one():
    """Windows waited that say the loop hardly waited are no window before, short or not: one is measured first."""
    labels: list[str] = []
    switcher = FakeSwitcher()
    switcher.current = EIGHT
    windows = TrialWindows(lambda label, *shape: labels.append(label), min_window_s=10.0)
    session = CacheSession(switcher, windows=windows, warm=lambda: True, fills=lambda: True)
    session.begin(0.6)
    session.on_window(make_window(samples_per_s=400.0, data_wait_frac=0.03, rate_rel_se=0.01))  # 1 s, hardly waiting
    session.on_step_end()
    assert labels[-1] == "cache: before" and session.before is None and switcher.switches == []


def window_before(quiet_flags, rates, min_window_s, other_busy=()):
    """The window before of a session fed 1 s windows (10 steps of 100 ms) at ``rates``, warm at the last: this
    rank's backfill ran beside the windows ``quiet_flags`` says are not quiet, another rank's beside those whose
    indices are in ``other_busy``. Its rate (None: not had yet) and the windows' labels."""
    labels: list[str] = []
    switcher = FakeSwitcher()
    switcher.current = EIGHT
    seen = {"n": 0}
    flags = iter(quiet_flags)

    def agree(values):
        values = list(values)
        if seen["n"] - 1 in other_busy:
            values[BESIDE] = 1.0  # another rank's backfill ran beside this window
        return values

    session = CacheSession(switcher, windows=TrialWindows(lambda label, *shape: labels.append(label),
                                                          min_window_s=min_window_s),
                           warm=lambda: seen["n"] >= len(rates), fills=lambda: True, quiet=lambda: next(flags),
                           agree=agree)
    session.begin(0.6)
    for rate in rates:
        session.on_window(make_window(samples_per_s=rate, data_wait_frac=0.6, rate_rel_se=0.01))
        seen["n"] += 1
        session.on_step_end()
    return session.before, labels


def test_windows_that_ran_beside_the_backfill_are_not_pooled_into_the_window_before():
    """The store's missing items are made in the background before the cache is tried: the windows measured
    meanwhile are not the settings in place alone (their rate reads low), so the window before pools only the quiet
    ones - and measures one of its own when those span too little."""
    rate, _ = window_before([True, True, False, False], [400.0, 400.0, 100.0, 100.0], 2.0)
    assert rate is not None and rate.value == 400.0  # the two quiet windows, not the two beside the backfill
    rate, labels = window_before([True, False, False], [400.0, 100.0, 100.0], 2.0)
    assert rate is not None and rate.value == 400.0  # one quiet second spans too little: the trials go first
    rate, labels = window_before([False, False], [100.0, 100.0], 2.0)
    assert rate is None and labels[-1] == "cache: before"  # none quiet: a window of its own


def test_a_window_any_rank_ran_beside_its_backfill_is_pooled_on_none():
    """Each rank makes its own share of the missing items, so the ranks' backfills end at different times. A window
    quiet on one rank and not on another is left out on both: every rank pools the same windows into the same
    window before (a rank that pooled one window more would judge the trials against another rate - and, where
    that window completed its window before, start its trials while the others measured one: their windows, and
    the collectives at their ends, at different steps)."""
    here = window_before([True, True, True], [400.0, 400.0, 100.0], 2.0, other_busy={2})
    there = window_before([True, True, False], [400.0, 400.0, 100.0], 2.0)
    assert here == there and here[0] is not None and here[0].value == 400.0
    alone = window_before([True, True, True], [400.0, 400.0, 100.0], 2.0)  # quiet on every rank: pooled
    assert alone[0] is not None and alone[0].value == 250.0


@pytest.mark.parametrize("other_rank_cold", [False, True])
def test_an_epoch_whose_start_finds_the_store_warm_tries_the_cache_at_its_first_step(other_rank_cold):
    """The store filled in the epoch before: the trials begin at the new epoch's first step end, with the windows
    waited as the window before - not at the end of the window running across the epoch's start, whose steps would
    load the slow way. Only when every rank's store may be read (one collective, on every rank at that step)."""
    labels: list[str] = []
    switcher = FakeSwitcher()
    switcher.current = EIGHT
    state = {"epoch": 0}
    session = CacheSession(switcher, windows=TrialWindows(lambda label, *shape: labels.append(label),
                                                          min_window_s=2.0),
                           warm=lambda: state["epoch"] > 0, fills=lambda: True,
                           agree=lambda values: [1.0] * len(values) if other_rank_cold else values)
    session.begin(0.6)
    for _ in range(3):  # 1 s windows filling the store, in epoch 0
        window_ends(session, labels, 400.0, 0.6)
    session.on_step_end()  # a step end within a window: nothing happens
    assert switcher.switches == [] and session.state == "wait"
    state["epoch"] = 1
    session.epoch_started()
    session.on_step_end()  # the new epoch's first step: no window ended
    if other_rank_cold:
        assert switcher.switches == [] and session.state == "wait"
        return
    assert switcher.switches == [dataclasses.replace(EIGHT, cache=True, give_way=True)]
    assert labels[-1].startswith("cache trial") and session.before is not None and session.before.value == 400.0
    session.on_step_end()  # the next step end is not an epoch's first: nothing more
    assert len(switcher.switches) == 1


@pytest.mark.parametrize("when", ["warm", "another rank cold", "the fit's end"])
def test_an_epoch_that_ends_with_the_store_warm_starts_the_next_on_the_first_cached_trial(when):
    """At an epoch's end, before the next one starts its loader: where every rank's store may be read (one
    collective, on every rank), the first cached trial goes in place then - the next epoch's first batch is read
    from the store, not made by the loader in place - and its first step end does not look again. Not at the fit's
    end: no trial would run."""
    labels: list[str] = []
    switcher = FakeSwitcher()
    switcher.current = EIGHT
    left = {"steps": 0 if when == "the fit's end" else 500}
    collectives = []

    def agree(values):
        collectives.append(list(values))
        return [1.0] * len(values) if when == "another rank cold" else values

    session = CacheSession(switcher, windows=TrialWindows(lambda label, *shape: labels.append(label),
                                                          min_window_s=2.0, steps_left=lambda: left["steps"]),
                           warm=lambda: state["warm"], fills=lambda: True, agree=agree)
    state = {"warm": False}
    left["steps"] += 1000  # (room to wait)
    session.begin(0.6)
    for _ in range(3):  # 1 s windows filling the store, in epoch 0
        window_ends(session, labels, 400.0, 0.6)
    left["steps"] -= 1000
    state["warm"] = True  # its last samples stored at the epoch's last step
    before = len(collectives)
    session.epoch_ended()
    if when == "the fit's end":
        assert switcher.switches == [] and session.state == "wait" and len(collectives) == before
        return
    assert len(collectives) == before + 1
    if when == "another rank cold":
        assert switcher.switches == [] and session.state == "wait"
        return
    assert switcher.switches == [dataclasses.replace(EIGHT, cache=True, give_way=True)]
    assert labels[-1].startswith("cache trial") and session.before is not None and session.before.value == 400.0
    session.epoch_started()
    session.on_step_end()  # the new epoch's first step end: the trial is in place already
    assert len(switcher.switches) == 1 and len(collectives) == before + 1


def test_the_window_an_epochs_end_closes_is_the_settings_in_place_not_the_trial_started_there():
    """An epoch's last step is timed at its end, so the window it completes closes then, just before the session's
    epoch-end decision. That window measured the settings in place: it is pooled into the window before, and the
    cached trial the decision starts is judged on windows measured after its switch, not on it."""
    labels: list[str] = []
    switcher = FakeSwitcher()
    switcher.current = EIGHT
    state = {"warm": False}
    session = CacheSession(switcher, windows=TrialWindows(lambda label, *shape: labels.append(label),
                                                          min_window_s=2.0, steps_left=lambda: 1000),
                           warm=lambda: state["warm"], fills=lambda: True)
    session.begin(0.6)
    for _ in range(3):  # 1 s windows filling the store
        window_ends(session, labels, 400.0, 0.6)
    state["warm"] = True
    session.on_window(make_window(samples_per_s=100.0, data_wait_frac=0.6, rate_rel_se=0.01))  # at the epoch's end
    session.epoch_ended()
    assert switcher.switches == [dataclasses.replace(EIGHT, cache=True, give_way=True)]
    assert session.before is not None and session.before.value < 400.0  # the slow window is the settings in place
    session.epoch_started()
    session.on_step_end()  # the next epoch's first step end: no window closed since the switch
    assert session.state == "trial" and session.trials == [] and len(switcher.switches) == 1


@pytest.mark.parametrize("where", ["here", "another rank", "making epoch", "nothing ahead"])
def test_past_the_epoch_that_made_the_store_the_filling_loader_reads_it_while_its_misses_are_made(where):
    """At an epoch's first step past the epoch that made the store, while what it misses is made ahead: the filling
    loader reads what the store holds and makes only the rest (making it all again takes the CPUs from that work).
    Its windows read from the store, so they are not pooled into the window before: the trials are judged against
    the windows of the settings in place before it. Not in the epoch that made the store (on any rank: it holds
    nothing that epoch draws again), nor with nothing being made ahead (on every rank: the windows are the settings
    in place, which the window before pools)."""
    labels: list[str] = []
    switcher = FakeSwitcher()
    switcher.current = EIGHT
    state = {"epoch": 0, "warm": False}

    def agree(values):  # _Cold: cold, making, ahead - another rank making its misses ahead, in the next epoch
        values = list(values)
        if where == "another rank" and len(values) == 3:
            values[2] = 1.0
        return values

    session = CacheSession(switcher, windows=TrialWindows(lambda label, *shape: labels.append(label),
                                                          min_window_s=2.0),
                           warm=lambda: state["warm"], fills=lambda: True, agree=agree,
                           to_warm=lambda: 50 if where == "making epoch" else 0,
                           making_ahead=lambda: where in ("here", "making epoch") and not state["warm"])
    session.begin(0.6)
    window_ends(session, labels, 400.0, 0.6)  # 1 s of the settings in place, quiet
    state["epoch"] = 1
    session.epoch_started()
    session.on_step_end()  # the next epoch's first step: its misses are being made
    reads = where in ("here", "another rank")
    reading = dataclasses.replace(EIGHT, cache=True)
    assert switcher.switches == ([reading] if reads else []) and session.state == "wait"
    assert (labels[-1] == "filling the sample cache") == reads
    for warm in (False, True):  # it reads the store fast; then the store is warm: the trials
        state["warm"] = warm
        window_ends(session, labels, 2000.0 if switcher.current.cache else 400.0, 0.2 if reads else 0.6)
    assert session.before is not None and session.before.value == 400.0  # the windows that read: not pooled
    assert labels[-1].startswith("cache trial")


def test_waiting_asks_warm_at_once_and_at_each_epoch_start_not_only_at_window_ends():
    """``warm`` starts what it waits for (the store's missing items, made ahead): asked when the wait begins and at
    every epoch start while waiting, that work starts there rather than a window later; not once the session is
    done."""
    asked: list[str] = []
    switcher = FakeSwitcher()
    switcher.current = EIGHT
    session = CacheSession(switcher, windows=TrialWindows(lambda *args: None),
                           warm=lambda: asked.append("warm") or False, fills=lambda: True)
    session.epoch_started()
    assert asked == []  # not begun: the other groups are still measuring
    session.begin(0.6)
    assert asked == ["warm"]
    session.epoch_started()
    assert asked == ["warm", "warm"]
    session.state = "done"
    session.epoch_started()
    assert asked == ["warm", "warm"]


def world_oversubscribed(settings: LoaderSettings) -> tuple[float, float]:
    """CPUs oversubscribed: read from the store, workers at the usual priority hold up the step's threads (slower
    than the settings in place); giving way, they beat them. The main process alone is slower still."""
    if settings.cache:
        if settings.num_workers == 0:
            return 300.0, 0.5
        return (600.0, 0.2) if settings.give_way else (380.0, 0.4)
    return 400.0, 0.6


def test_cached_workers_give_way_and_the_choice_is_tried_last_at_the_usual_priority():
    """Every cached trial's workers give way to the training process; last, the cached setting that would be chosen
    is tried once more at the usual priority - giving way is kept (reported as a change) only where that trial is
    beaten beyond noise, and the cache only when a cached trial beat the window before."""
    session, switcher = run(world_oversubscribed)
    tried = [(s.num_workers, s.cache, s.give_way) for s in switcher.switches]
    # giving way, 8 workers beat the settings in place; alone is slower; halving keeps pace down to one worker
    assert tried[:6] == [(8, True, True), (0, True, False), (4, True, True), (2, True, True), (1, True, True),
                         (1, True, False)]
    assert session.kept == dataclasses.replace(EIGHT, num_workers=1, cache=True, give_way=True)
    changes = {c.knob: c for c in session.outcome.changes}
    assert {k: (c.before, c.after) for k, c in changes.items()} == {
        "cache": (False, True), "num_workers": (8, 1), "give_way": (False, True)}
    assert "at it, another cached trial beat them beyond noise" in changes["give_way"].reason
    assert "workers giving way" in session.kept.describe()

    def no_better(settings):  # the same, but giving way changes nothing: the cache never beats the window before
        return world_oversubscribed(dataclasses.replace(settings, give_way=False))

    session, switcher = run(no_better)
    assert session.kept is None and switcher.current == EIGHT
    assert [(s.num_workers, s.cache, s.give_way) for s in switcher.switches] == [
        (8, True, True), (0, True, False), (8, True, False), (8, False, False)]

    def equal(settings):  # giving way changes nothing, and the cache pays: at the tie, the usual priority is kept
        return world_storage_bound(settings)

    session, switcher = run(equal)
    assert session.kept == dataclasses.replace(EIGHT, num_workers=2, cache=True)
    assert "give_way" not in {c.knob for c in session.outcome.changes}


def _parts_tried(world, shapes: list[tuple[str, int]] | None = None):
    """The labels of the windows a session measured in ``world`` (whole items, the main process alone first), each
    trial's window asking for 10 s - five parts of 20 steps at 100 ms a step; each label and its steps in
    ``shapes``."""
    labels: list[str] = []
    shapes = [] if shapes is None else shapes

    def window(label: str, skip: int, steps: int, blocks: int) -> None:
        labels.append(label)
        shapes.append((label.split(",")[0], steps))

    switcher = FakeSwitcher()
    switcher.current = EIGHT
    session = CacheSession(switcher, windows=TrialWindows(window, min_window_s=10.0),
                           warm=lambda: True, fills=lambda: True, alone_first=True)
    session.begin(0.6)
    for _ in range(40):
        if session.state == "done":
            break
        rate, wait = world(switcher.current)
        session.on_window(make_window(samples_per_s=rate, data_wait_frac=wait, rate_rel_se=0.01))
        session.on_step_end()
    return session, [label.split(",")[0] for label in labels]


def test_a_cached_trial_slower_beyond_noise_than_another_stops_after_its_first_part():
    """The main process alone reads the store at 1000/s but still waits, so the 8 workers are tried: their first
    part reads 500/s, slower beyond noise than the main process alone - the rest of their window is not measured,
    the report says so, and the main process alone is kept. A trial within noise of the best runs its whole
    window."""
    def world(settings, workers_rate):
        if settings.cache:
            return (1000.0, 0.2) if settings.num_workers == 0 else (workers_rate, 0.1)
        return 400.0, 0.6

    session, labels = _parts_tried(lambda settings: world(settings, 500.0))
    assert labels.count("cache trial: num_workers=0") == 5  # beats the window before: every part
    assert labels.count("cache trial: num_workers=8") == 1  # beaten by the main process alone after one part
    assert session.kept is not None and session.kept.num_workers == 0
    assert session.trials[1].rate is not None and session.trials[1].rate.value == 500.0
    assert any("stopped after 1 of its 5 parts (20 of 100 steps)" in note and "num_workers=0" in note.split("than")[-1]
               for note in session.outcome.notes)

    session, labels = _parts_tried(lambda settings: world(settings, 980.0))  # within the 5 % floor
    assert labels.count("cache trial: num_workers=8") == 5
    assert not any("stopped after" in note for note in session.outcome.notes)


def test_an_after_window_ends_at_its_first_part_that_is_clearly_faster_and_runs_whole_when_close():
    """The after-window (10 s at 100 ms a step: three even parts) of a cache that reads 2.5x the window before ends
    after its first part - the gain is measured after the change, and the rest of the window could not undo it; a
    gain just beyond noise (430 against 400/s) is kept only after the whole window."""
    def world(cached_rate):
        return lambda settings: (cached_rate, 0.01) if settings.cache else (400.0, 0.6)

    shapes: list[tuple[str, int]] = []
    session, _ = _parts_tried(world(1000.0), shapes)
    assert [steps for label, steps in shapes if label == "cache: after"] == [34]  # one part of 34 steps, not 100
    assert session.kept is not None and session.kept.num_workers == 0
    assert session.outcome.changes[0].measured_speedup == 2.5
    assert any("ended after 1 of its 3 parts (34 of 102 steps)" in note and "clearly faster" in note
               for note in session.outcome.notes)

    shapes.clear()
    session, _ = _parts_tried(world(430.0), shapes)
    assert [steps for label, steps in shapes if label == "cache: after"] == [34, 34, 34]
    assert not any("clearly faster" in note for note in session.outcome.notes)
    assert session.kept is not None and round(session.outcome.changes[0].measured_speedup, 3) == 1.075


def test_cached_trials_start_no_more_workers_than_the_cpus():
    """Eight workers hid the storage's latency; reading from the store in memory leaves CPU work, which more workers
    than the rank's 2 CPUs cannot do faster: the cached trials start from 2 (then the main process alone, then
    halving), never 8 - and the report names the cut from 8."""
    session, switcher = run(world_storage_bound, max_workers=2)
    tried = [(s.num_workers, s.cache, s.give_way) for s in switcher.switches]
    assert tried[:4] == [(2, True, True), (0, True, False), (1, True, True), (2, True, False)]
    assert max(s.num_workers for s in switcher.switches if s.cache) == 2
    assert session.kept == dataclasses.replace(EIGHT, num_workers=2, cache=True)
    assert {c.knob: (c.before, c.after) for c in session.outcome.changes} == {"cache": (False, True),
                                                                           "num_workers": (8, 2)}
