"""The tuning session against a fake switcher and fake ranks: the agreed figures drive every decision."""

from pipeopt.tuning.agreement import agree
from pipeopt.tuning.loader_search import Budget, LoaderSettings
from pipeopt.tuning.session import Agreed, LoaderSession, TrialWindows
from tests.helpers import make_window

USER = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False)


class FakeSwitcher:
    def __init__(self):
        self.user_settings = self.current = self.fallback = USER
        self.failed = None
        self.switches = []
        self.restored = False

    def switch(self, settings, *, timeout_s=None):
        self.fallback, self.current = self.current, settings
        self.switches.append(settings)

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
    feed(s, 100.0, 0.5)  # before: half the step waiting, so 1 worker first
    assert switcher.switches[-1].num_workers == 1
    other_rank_failed["now"] = True
    feed(s, 300.0, 0.5)  # this rank measured fine; the other rank's workers died
    failed = [t for t in s.search.trials if not t.ok]
    assert failed and failed[0].settings.num_workers == 1 and "another rank" in failed[0].error


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
    feed(s, 150.0, 0.3)  # 1 worker: faster, but the budget is spent
    assert any("budget (10 s) ran out" in n for n in s.notes)
    assert s.state == "after" and s.chosen.settings.num_workers == 1


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
    feed(s, 700.0, 0.1)  # short of 80 %: measured once more
    assert s.state == "verify"
    feed(s, 1000.0, 0.05)  # together 850: within the tolerance
    assert s.state == "done" and s.kept == cached and s.search is None
    assert any("applied the cached loader configuration" in n for n in s.notes)


def test_a_cached_configuration_that_falls_short_is_tuned_afresh():
    s, switcher, _ = session()
    s.verify_cached(USER.with_workers(4, persistent=True), expected_rate=1000.0)
    feed(s, 500.0, 0.5)
    feed(s, 520.0, 0.5)
    assert s.state == "before" and switcher.restored and not s.from_cache
    feed(s, 100.0, 0.9)  # the before-window of the fresh tuning
    assert s.state == "trial"


def test_no_trial_starts_that_the_fit_cannot_finish():
    left = {"steps": 1000}
    switcher = FakeSwitcher()
    s = LoaderSession(switcher, budget=Budget(cpus=2), budget_s=60.0, windows=TrialWindows(lambda *args: None),
                      clock=lambda: 0.0, steps_left=lambda: left["steps"])
    feed(s, 100.0, 0.5)  # before: 1 worker predicted; 1000 steps left: room for it
    assert switcher.switches[-1].num_workers == 1
    left["steps"] = 30  # a trial window (20) and an after-window (20) no longer fit
    feed(s, 150.0, 0.3)
    assert switcher.switches[-1].num_workers == 1  # no new trial: the measured worker is chosen and verified
    assert s.state == "after"
    assert any("the fit has 30 optimizer steps left: too few for another trial" in n for n in s.notes)


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
