import json

import jsonschema
import pytest

from pipeopt.measure.memory import MemoryBreakdown
from pipeopt.measure.resources import ResourceFigures
from pipeopt.report.fit import fit_and_cost, time_and_cost
from pipeopt.report.json_io import SCHEMA_PATH, read_report, write_report
from pipeopt.report.model import Change, Environment, Report, SampleCacheFigures, Skipped, Trial, thin
from pipeopt.verdict import judge
from tests.helpers import make_window

ENV = Environment(
    accelerator="cpu", device_name="x86_64", device_count=1, world_size=1, cpu_count=2, python="3.11.7",
    torch="2.13.0", lightning={"pytorch-lightning": "2.6.6"}, pipeopt="0.1.0", gpu_monitoring="n/a (no NVIDIA driver)",
)


HEALTH = ResourceFigures(cpu_main_pct=98.0, peak_mem_bytes=6 * 2**30, peak_reserved_bytes=7 * 2**30,
                         gpu_util_pct=91.0, gpu_util_p95_pct=99.0, gpu_mem_used_bytes=7 * 2**30, gpu_power_w=410.0,
                         gpu_power_p95_w=470.0, gpu_power_limit_w=700.0, gpu_temp_c=61.0, gpu_temp_p95_c=64.0,
                         gpu_sm_clock_mhz=1980.0, gpu_sm_clock_p95_mhz=1980.0, gpu_throttle="power cap",
                         gpu_status="sampled")


def fit_section(before, after):
    memory = MemoryBreakdown(params_bytes=400 * 2**20, grads_bytes=400 * 2**20, optimizer_bytes=800 * 2**20,
                             activations_bytes=2 * 2**30, activations_fp32_bytes=2 * 2**30, batch_bytes=50 * 2**20,
                             micro_batch=32, precision="32-true", saved_tensors=120)
    time = time_and_cost(before, after, steps_per_epoch=500, planned_steps=5000, epochs_measured_s=[61.0, 48.5],
                         cost_per_hour=4.0)
    return fit_and_cost(windows=[before, after], after=after, memory=memory, memory_note=None,
                        accumulate=2, device_memory_bytes=None, memory_fraction=0.9, shrunk=False, time=time)


def full_report():
    before = make_window()
    after = make_window(index=3, first_step=35, samples_per_s=640.0, steps_per_s=20.0, data_wait_frac=0.02,
                        step_time_s=0.05)
    return Report(
        mode="tune", environment=ENV, before=before, after=after, verdict=judge(before),
        changes=[Change("num_workers", 0, 2, "fastest within noise")],
        trials=[Trial({"num_workers": 2}, 640.0, 0.02, "ok", predicted_samples_per_s=600.0),
                Trial({"num_workers": 8}, None, None, "failed", "worker crashed")],
        skipped=[Skipped("dali", "DALI is not installed")], notes=["a note"], timeline=[before, after],
        steps_measured=45,
        suggestions=["DataLoader(..., num_workers=2)"], predicted_speedup=1.9, fit=fit_section(before, after),
        sample_cache=SampleCacheFigures(
            cached="each image read and decoded (uint8)", directory="/tmp/store", kept=True, stored=96, length=96,
            bytes_used=3 * 2**20, budget_bytes=2**30, fill_s=0.25, trial_speedup=1.6,
            epochs=[dict(epoch=0, reading=False, samples=96, read=0, misses=96, hit_rate=None),
                    dict(epoch=1, reading=False, samples=96, read=32, misses=0, hit_rate=None),
                    dict(epoch=2, reading=True, samples=96, read=96, misses=0, hit_rate=1.0)]),
    )


def test_written_report_matches_the_schema_and_reads_back(tmp_path):
    report = full_report()
    path = write_report(report, tmp_path / "reports")
    data = json.loads(path.read_text())
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["measured_speedup"] == pytest.approx(2.0)
    assert data["predicted_speedup"] == pytest.approx(1.9)  # the change's own prediction, beside the measurement
    assert data["prediction_error"] == pytest.approx(0.05)  # |1.9 - 2.0| / 2.0
    assert data["trials"][0]["predicted_samples_per_s"] == 600.0
    assert data["sample_cache"]["epochs"][2]["hit_rate"] == 1.0
    assert read_report(path).sample_cache == report.sample_cache
    assert data["fit"]["memory"]["params_bytes"] == 400 * 2**20 and data["fit"]["time"]["fit_saving"] > 0
    assert read_report(path) == report
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_observe_report_without_windows_matches_the_schema(tmp_path):
    path = write_report(Report(mode="observe", environment=ENV), tmp_path)
    data = json.loads(path.read_text())
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["before"] is None and data["measured_speedup"] is None


def test_a_version_1_report_reads_with_its_one_predicted_speedup_split_in_two(tmp_path):
    data = full_report().to_dict()
    data["schema_version"] = 1
    data["verdict"]["predicted_speedup"] = data["verdict"].pop("input_free_speedup")
    data["changes"] = []  # without a change, version 1 put the verdict's estimate here
    data["predicted_speedup"] = data["verdict"]["predicted_speedup"]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    report = read_report(path)
    assert report.predicted_speedup is None
    assert report.verdict.input_free_speedup == pytest.approx(data["verdict"]["predicted_speedup"])


def test_a_version_2_report_reads_without_a_fit_section(tmp_path):
    data = full_report().to_dict()
    data["schema_version"] = 2
    del data["fit"], data["sample_cache"]
    for window in [data["before"], data["after"], *data["timeline"]]:
        for key in ("peak_reserved_bytes", "gpu_temp_c", "gpu_throttle"):
            del window["resources"][key]
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(data))
    report = read_report(path)
    assert report.fit is None and report.after.resources.gpu_temp_c is None and report.sample_cache is None


def test_what_the_before_window_ran_is_written_and_read_back_and_a_version_4_report_has_none(tmp_path):
    report = full_report()
    report.before_ran = "the loader settings the run this one resumes kept (num_workers=2, ...)"
    data = json.loads(write_report(report, tmp_path / "reports").read_text())
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["before_ran"] == report.before_ran and data["prediction_error"] is None
    assert data["measured_speedup"] == pytest.approx(2.0)  # after over that first window, which the line names
    old = {**full_report().to_dict(), "schema_version": 4}
    del old["before_ran"]
    path = tmp_path / "v4.json"
    path.write_text(json.dumps(old))
    assert read_report(path).before_ran is None


def test_a_foreign_schema_version_is_refused(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(ValueError, match="schema_version 99 is not supported"):
        read_report(path)


def test_timeline_is_thinned_keeping_first_and_last():
    windows = [make_window(index=i) for i in range(2000)]
    kept = thin(windows, 512)
    assert len(kept) == 512 and kept[0].index == 0 and kept[-1].index == 1999
