"""Choosing micro-batch x accumulation from live windows: the user's effective batch, the memory budget, batch
norm, and speed beyond noise (synthetic windows: what is tried and kept is fixed by what they measured)."""

import pytest

from pipeopt.tuning.batch import BatchPlan, BatchSearch, PlanWindow, plans
from pipeopt.tuning.noise import Rate


def window(plan, rate=100.0, peak=None, error=None):
    return PlanWindow(plan, None if error else Rate(rate, 0.01), peak, error)


def run(search, measure):
    """Drive the search: each proposed plan measures ``measure(plan)`` (a PlanWindow); the plans tried, in order."""
    tried = []
    while (plan := search.propose()) is not None:
        tried.append(plan)
        search.record(measure(plan))
    return tried


def test_plans_keep_the_effective_batch_and_split_or_fold_whole_batches():
    assert [(p.micro, p.accumulate) for p in plans(BatchPlan(32, 1))] == [
        (32, 1), (16, 2), (8, 4), (4, 8), (2, 16), (1, 32)]
    folded = plans(BatchPlan(16, 4))
    assert {p.effective for p in folded} == {64}
    assert BatchPlan(64, 1) in folded and BatchPlan(32, 2) in folded and BatchPlan(8, 8) in folded


def test_a_plan_over_the_budget_tries_the_largest_split_predicted_to_fit_and_keeps_it_once_it_does():
    user = BatchPlan(32, 1)
    search = BatchSearch(user, budget_bytes=1000, static_bytes=200, batchnorm=False, may_fold=True)
    # 200 kept between steps, 100 a sample on top: 32 -> 3400; predicted 16 -> 1800, 8 -> 1000 (fits)
    tried = run(search, lambda p: window(p, peak=200 + 100 * p.micro))
    assert tried == [user, BatchPlan(8, 4)]
    assert search.choice.plan == BatchPlan(8, 4) and "largest micro-batch that fits" in search.choice.reason


def test_a_split_whose_measured_peak_is_still_over_tries_the_next_smaller_one():
    user = BatchPlan(32, 1)
    search = BatchSearch(user, budget_bytes=1000, static_bytes=0, batchnorm=False, may_fold=True)
    measured = {32: 3200, 8: 1100, 4: 600}  # 8 predicted at 800, measured over
    tried = run(search, lambda p: window(p, peak=measured[p.micro]))
    assert tried == [user, BatchPlan(8, 4), BatchPlan(4, 8)] and search.choice.plan == BatchPlan(4, 8)


def test_when_no_split_fits_the_users_plan_stays_because_it_runs():
    user = BatchPlan(32, 1)
    search = BatchSearch(user, budget_bytes=1000, static_bytes=0, batchnorm=False, may_fold=True)
    tried = run(search, lambda p: window(p, peak=10_000))
    assert tried[0] == user and search.choice.plan == user and "kept yours (it runs)" in search.choice.reason


def test_an_accumulating_plan_tries_its_largest_fold_and_keeps_it_only_beyond_noise():
    user = BatchPlan(8, 4)
    faster = BatchSearch(user, budget_bytes=None, static_bytes=None, batchnorm=False, may_fold=True)
    assert run(faster, lambda p: window(p, rate=300.0 if p.micro == 32 else 100.0)) == [user, BatchPlan(32, 1)]
    assert faster.choice.plan == BatchPlan(32, 1) and "3.00x" in faster.choice.reason
    tie = BatchSearch(user, budget_bytes=None, static_bytes=None, batchnorm=False, may_fold=True)
    run(tie, lambda p: window(p, rate=103.0 if p.micro == 32 else 100.0))
    assert tie.choice.plan == user and "not faster beyond noise" in tie.choice.reason


def test_a_fold_is_sized_by_the_predicted_peak_and_its_measured_peak_must_fit():
    user = BatchPlan(8, 4)
    search = BatchSearch(user, budget_bytes=2000, static_bytes=0, batchnorm=False, may_fold=True)
    # 8 -> 800: 32 predicted 3200 (over), 16 predicted 1600 (fits) - but measures 2400
    tried = run(search, lambda p: window(p, rate=300.0 if p.micro > 8 else 100.0,
                                         peak=800 if p.micro == 8 else 2400))
    assert tried == [user, BatchPlan(16, 2)] and search.choice.plan == user and "over" in search.choice.reason


@pytest.mark.parametrize(("user", "kwargs", "why"), [
    (BatchPlan(8, 4), {"batchnorm": True}, "batch norm"),
    (BatchPlan(32, 1), {}, "accumulates no batches"),
    (BatchPlan(8, 4), {"may_fold": False}, "its own collate_fn"),
])
def test_nothing_is_tried_where_no_other_plan_may_help(user, kwargs, why):
    # With a memory budget, the user's window is needed first: its peak may be over the budget.
    budgeted = BatchSearch(user, **{"budget_bytes": 10**9, "static_bytes": 0, "batchnorm": False,
                                    "may_fold": True, **kwargs})
    assert run(budgeted, lambda p: window(p, peak=100)) == [user]
    assert budgeted.choice.plan == user and why in budgeted.choice.reason
    # Without one (CPU), nothing is measured for it at all: the decision is known before any window.
    unbudgeted = BatchSearch(user, **{"budget_bytes": None, "static_bytes": None, "batchnorm": False,
                                      "may_fold": True, **kwargs})
    assert run(unbudgeted, lambda p: window(p)) == []
    assert unbudgeted.choice.plan == user and why in unbudgeted.choice.reason


def test_a_batch_norm_model_over_the_budget_still_shrinks_and_is_told_so():
    user = BatchPlan(32, 1)
    search = BatchSearch(user, budget_bytes=1000, static_bytes=0, batchnorm=True, may_fold=True)
    run(search, lambda p: window(p, peak=100 * p.micro))
    assert search.choice.plan == BatchPlan(8, 4) and "batch norm" in search.choice.reason


def test_a_failed_window_keeps_the_users_plan():
    user = BatchPlan(8, 4)
    failed_first = BatchSearch(user, budget_bytes=None, static_bytes=None, batchnorm=False, may_fold=True)
    assert run(failed_first, lambda p: window(p, error="no loss")) == [user]
    assert failed_first.choice.plan == user
    failed_trial = BatchSearch(user, budget_bytes=None, static_bytes=None, batchnorm=False, may_fold=True)
    run(failed_trial, lambda p: window(p, error="no loss") if p.micro == 32 else window(p))
    assert failed_trial.choice.plan == user and "failed" in failed_trial.choice.reason
