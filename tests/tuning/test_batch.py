"""Choosing micro-batch x accumulation: the user's effective batch, the memory budget, batch norm."""

from pipeopt.tuning.batch import BatchPlan, BatchProbe, choose_batch, plans
from pipeopt.tuning.noise import Rate

USER = BatchPlan(32, 1)


def probe(micro, rate=100.0, peak=None, oom=False):
    return BatchProbe(BatchPlan(micro, 32 // micro), peak_bytes=peak, oom=oom, rate=None if oom else Rate(rate, 0.01))


def test_plans_keep_the_effective_batch_and_split_or_fold_whole_batches():
    assert [(p.micro, p.accumulate) for p in plans(USER)] == [(32, 1), (16, 2), (8, 4), (4, 8), (2, 16), (1, 32)]
    folded = plans(BatchPlan(16, 4))
    assert {p.effective for p in folded} == {64}
    assert BatchPlan(64, 1) in folded and BatchPlan(32, 2) in folded and BatchPlan(8, 8) in folded


def test_a_batch_that_does_not_fit_runs_as_the_largest_micro_batch_that_does():
    probes = [probe(32, peak=3200), probe(16, peak=1600), probe(8, peak=800), probe(4, peak=400, rate=130.0)]
    choice = choose_batch(USER, probes, budget_bytes=1000, batchnorm=False)
    assert choice.plan == BatchPlan(8, 4) and "does not fit" in choice.reason


def test_out_of_memory_counts_as_not_fitting():
    probes = [probe(32, oom=True), probe(16, peak=10)]
    assert choose_batch(USER, probes, budget_bytes=None, batchnorm=False).plan == BatchPlan(16, 2)


def test_batch_norm_keeps_the_micro_batch_unless_it_does_not_fit():
    fast_split = [probe(32, rate=100.0, peak=10), probe(16, rate=200.0, peak=5)]
    kept = choose_batch(USER, fast_split, budget_bytes=1000, batchnorm=True)
    assert kept.plan == USER and "batch norm" in kept.reason
    too_big = [probe(32, oom=True), probe(16, peak=5)]
    forced = choose_batch(USER, too_big, budget_bytes=1000, batchnorm=True)
    assert forced.plan == BatchPlan(16, 2) and "batch norm" in forced.reason  # said in the report


def test_a_faster_plan_that_fits_is_taken_only_beyond_noise():
    assert choose_batch(USER, [probe(32, 100.0), probe(16, 103.0)], budget_bytes=None, batchnorm=False).plan == USER
    faster = choose_batch(USER, [probe(32, 100.0), probe(16, 150.0)], budget_bytes=None, batchnorm=False)
    assert faster.plan == BatchPlan(16, 2) and "1.50x" in faster.reason


def test_nothing_fits_keeps_the_users_plan():
    choice = choose_batch(USER, [probe(32, oom=True), probe(16, oom=True)], budget_bytes=1000, batchnorm=False)
    assert choice.plan == USER and "no plan fits" in choice.reason
