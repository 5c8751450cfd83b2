"""Fit and cost from measured figures: which cards a configuration fits, what limits a window, what an epoch and the
fit cost. Pure arithmetic on synthetic breakdowns and windows."""

import pytest

from pipeopt.measure.memory import MemoryBreakdown
from pipeopt.measure.resources import ResourceFigures
from pipeopt.report.fit import HALF, Fit, accelerator_sizes, fit_and_cost, fits_on, need_bytes, time_and_cost
from pipeopt.verdict import COMPUTE_BOUND, INPUT_BOUND, MEMORY_BOUND, TRANSFER_BOUND, limit
from tests.helpers import make_window

GIB = 1024**3


def breakdown(**overrides) -> MemoryBreakdown:
    """0.25 GiB of weights (0.25 each of gradients, 0.5 of Adam state); 64 samples of 10 MiB of activations (all
    float32) and 1 MiB of input each."""
    fields = dict(params_bytes=GIB // 4, grads_bytes=GIB // 4, optimizer_bytes=GIB // 2,
                  activations_bytes=64 * 10 * 2**20, activations_fp32_bytes=64 * 10 * 2**20, batch_bytes=64 * 2**20,
                  micro_batch=64, precision="32-true")
    fields.update(overrides)
    return MemoryBreakdown(**fields)


def test_need_is_the_counted_memory_moved_by_the_bytes_per_sample():
    m = breakdown()
    assert m.counted_bytes == GIB + 64 * 11 * 2**20
    assert m.per_sample_bytes == 11 * 2**20
    assert need_bytes(m, 64) == m.counted_bytes
    assert need_bytes(m, 16) == GIB + 16 * 11 * 2**20
    assert need_bytes(m, 64, peak=3 * GIB) == 3 * GIB  # on CUDA the allocator's peak is the ground truth
    assert need_bytes(m, 32, peak=3 * GIB) == 3 * GIB - 32 * 11 * 2**20
    # 16-bit mixed: float32 activations halve; autocast holds a 16-bit copy of the weights
    assert need_bytes(m, 64, half=True) == m.counted_bytes - 64 * 5 * 2**20 + GIB // 8


def test_fits_on_a_synthetic_budget_keeps_the_effective_batch():
    m = breakdown()  # needs 1.6875 GiB as it is; x 1.2 = 2.03, x 1.4 = 2.36
    rows = fits_on(m, accumulate=2, sizes=((4.0, "big"), (2.2, "mid"), (1.4, "small"), (0.5, "tiny")))
    by_size = {row.examples: row.fits for row in rows}
    assert by_size["big"] == [Fit(0.2, True), Fit(0.4, True)]
    # 2.2 GiB: fits with 20 %; with 40 % the micro-batch must shrink to a divisor of the effective 128: 32 x 4
    # (1 GiB + 32 x 11 MiB = 1.34 GiB; x 1.4 = 1.88 <= 2.2), as 64 would not
    assert by_size["mid"] == [Fit(0.2, True), Fit(0.4, False, 32, 4)]
    small = by_size["small"]  # 1.4 GiB: (1 GiB + m x 11 MiB) x 1.2 <= 1.4 GiB for m <= 15: 8 x 16; with 40 % the
    assert small == [Fit(0.2, False, 8, 16), Fit(0.4, False)]  # fixed 1 GiB alone is too much, in 16-bit too
    assert by_size["tiny"] == [Fit(0.2, False), Fit(0.4, False)]  # the weights alone do not fit
    assert [f.text() for f in by_size["mid"]] == ["fits", "32 x 4"]
    assert Fit(0.2, False, 8, 16, HALF).text() == f"8 x 16 ({HALF}, predicted)"


def test_a_32_bit_run_that_fits_nowhere_else_is_offered_16_bit_mixed():
    mib = 2**20
    m = breakdown(params_bytes=128 * mib, grads_bytes=128 * mib, optimizer_bytes=256 * mib,
                  activations_bytes=64 * 400 * mib, activations_fp32_bytes=64 * 400 * mib, batch_bytes=0)
    # 32-bit, one sample: 512 + 400 = 912 MiB, x 1.2 = 1094 > 942; 16-bit mixed: 512 + 64 (weights' copy) + 200
    # = 776 MiB, x 1.2 = 931 <= 942, x 1.4 = 1086 > 942
    (row,) = fits_on(m, accumulate=1, sizes=((942 / 1024, "card"),))
    assert row.fits == [Fit(0.2, False, 1, 64, HALF), Fit(0.4, False)]
    (row,) = fits_on(breakdown(precision="bf16-mixed"), accumulate=1, sizes=((0.5, "card"),))
    assert row.fits[0] == Fit(0.2, False)  # a run already in 16-bit is not offered it again


def test_the_table_of_cards_comes_from_the_data_file():
    sizes = accelerator_sizes()
    assert [gib for gib, _ in sizes] == [16, 24, 40, 48, 80, 94, 141, 192]
    assert all(examples for _, examples in sizes)


def test_limit_of_a_window():
    assert limit(make_window(data_wait_frac=0.4))[0] == INPUT_BOUND
    assert limit(make_window(data_wait_frac=0.05, transfer_frac=0.3))[0] == TRANSFER_BOUND
    assert limit(make_window(data_wait_frac=0.05), shrunk=True)[0] == MEMORY_BOUND
    near = make_window(data_wait_frac=0.05, resources=ResourceFigures(peak_mem_bytes=96))
    assert limit(near, budget_bytes=100)[0] == MEMORY_BOUND
    assert limit(near, budget_bytes=200)[0] == COMPUTE_BOUND
    assert limit(make_window(data_wait_frac=0.05))[0] == COMPUTE_BOUND


def test_time_and_cost_arithmetic():
    before = make_window(step_time_s=0.2)
    after = make_window(step_time_s=0.05)
    t = time_and_cost(before, after, steps_per_epoch=1000, planned_steps=10_000, epochs_measured_s=[190.0],
                      cost_per_hour=36.0)
    assert (t.epoch_s_before, t.epoch_s_after) == pytest.approx((200.0, 50.0))
    assert (t.fit_s_before, t.fit_s_after) == pytest.approx((2000.0, 500.0))
    assert (t.epoch_cost_before, t.epoch_cost_after) == pytest.approx((2.0, 0.5))  # 36 an hour = 0.01 a second
    assert (t.fit_cost_before, t.fit_cost_after, t.fit_saving) == pytest.approx((20.0, 5.0, 15.0))
    free = time_and_cost(before, after, steps_per_epoch=None, planned_steps=None, epochs_measured_s=[],
                         cost_per_hour=None)
    assert free.epoch_s_before is None and free.epoch_cost_before is None and free.fit_saving is None


def test_the_section_puts_the_device_in_use_first_and_reads_its_peak():
    m = breakdown()
    after = make_window(index=2, data_wait_frac=0.05,
                        resources=ResourceFigures(peak_mem_bytes=int(7.5 * GIB), peak_reserved_bytes=8 * GIB))
    section = fit_and_cost(windows=[make_window(), after], after=after, memory=m,
                           memory_note=None, accumulate=1, device_memory_bytes=8 * GIB, memory_fraction=0.9,
                           shrunk=False, time=time_and_cost(None, None, steps_per_epoch=None, planned_steps=None,
                                                            epochs_measured_s=[], cost_per_hour=None),
                           sizes=((16.0, "sixteen"),))
    assert [r.examples for r in section.fits_on] == ["this device", "sixteen"]
    here = section.fits_on[0]
    assert here.memory_gib == 8.0 and not here.fits[0].fits  # 7.5 GiB x 1.2 > 8: no 20 % buffer left at 64
    assert section.peak_bytes == int(7.5 * GIB) and section.budget_bytes == int(0.9 * 8 * GIB)
    assert section.limit == MEMORY_BOUND  # the peak is within 5 % of the budget (7.5 >= 0.95 x 7.2)
    assert section.window_limits == [(0, INPUT_BOUND), (2, MEMORY_BOUND)]
