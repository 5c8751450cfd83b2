import pipeopt.report.metrics as metrics
from pipeopt.measure.resources import ResourceFigures
from pipeopt.report.model import Report
from pipeopt.verdict import judge
from tests.helpers import make_window
from tests.report.test_json import ENV, HEALTH, fit_section


def test_every_emitted_key_is_documented():
    full = make_window(resources=ResourceFigures(1.0, 2.0, 1, 10, 3.0, 20, 4.0, "sampled"))
    keys = set(metrics.window_metrics(full))
    keys |= set(metrics.window_metrics(make_window(resources=HEALTH)))
    w = make_window()
    keys |= set(metrics.summary_metrics(Report(mode="observe", environment=ENV, before=w, after=w, verdict=judge(w),
                                               fit=fit_section(w, w))))
    assert len(keys) == 28
    for key in keys:
        assert f"``{key}``" in metrics.__doc__


def test_unmeasured_figures_are_left_out_not_zero():
    emitted = metrics.window_metrics(make_window())
    assert "pipeopt/gpu_util_pct" not in emitted and "pipeopt/peak_mem_mb" not in emitted
    assert emitted["pipeopt/data_wait_frac"] == 0.4
    assert emitted["pipeopt/step_time_ms"] == 100.0


def test_figures_against_your_settings_are_not_logged_where_no_window_measured_them():
    before, after = make_window(), make_window(index=3, samples_per_s=640.0, steps_per_s=20.0)
    report = Report(mode="tune", environment=ENV, before=before, after=after, verdict=judge(before),
                    fit=fit_section(before, after), predicted_speedup=1.9)
    assert {"pipeopt/measured_speedup", "pipeopt/time/epoch_s_before", "pipeopt/cost/fit_saving",
            "pipeopt/prediction_error"} <= set(metrics.summary_metrics(report))
    report.before_ran = "the loader settings an earlier run of this fit cached (num_workers=2, ...)"
    emitted = metrics.summary_metrics(report)
    for key in ("pipeopt/measured_speedup", "pipeopt/prediction_error", "pipeopt/time/epoch_s_before",
                "pipeopt/cost/epoch_before", "pipeopt/cost/fit_saving"):
        assert key not in emitted, key
    assert emitted["pipeopt/time/epoch_s_after"] > 0 and emitted["pipeopt/predicted_speedup"] == 1.9
