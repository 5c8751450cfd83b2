import pytest

from pipeopt.verdict import BALANCED, COMPUTE_BOUND, INPUT_BOUND, judge
from tests.helpers import make_window


@pytest.mark.parametrize(
    ("wait_frac", "kind"),
    [(0.0, COMPUTE_BOUND), (0.09, COMPUTE_BOUND), (0.1, BALANCED), (0.29, BALANCED), (0.3, INPUT_BOUND),
     (0.9, INPUT_BOUND)],
)
def test_kind_follows_the_data_wait_fraction(wait_frac, kind):
    w = make_window(data_wait_frac=wait_frac, wait_s=wait_frac * 0.1, compute_s=0.01)
    assert judge(w).kind == kind


def test_input_free_speedup_is_step_time_over_input_free_step_time():
    w = make_window(step_time_s=0.1, wait_s=0.075, compute_s=0.02, transfer_s=0.0, data_wait_frac=0.75)
    assert judge(w).input_free_speedup == pytest.approx(0.1 / 0.025)


def test_device_time_bounds_the_prediction_when_the_wait_overlapped_device_work():
    # CUDA: the host waited 60 ms, but the device computed for 80 ms of the 100 ms step meanwhile.
    w = make_window(step_time_s=0.1, wait_s=0.06, compute_s=0.08, transfer_s=0.0, data_wait_frac=0.6)
    assert judge(w).input_free_speedup == pytest.approx(0.1 / 0.08)


def test_reason_states_the_measured_share():
    assert "waited for data 40% of each step" in judge(make_window()).reason
