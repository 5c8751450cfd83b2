import dataclasses
import io

from rich.console import Console

from pipeopt.report.console import cache_lines, print_report
from pipeopt.report.model import Report
from tests.helpers import make_window
from tests.report.test_json import ENV, full_report


def rendered(report):
    buf = io.StringIO()
    print_report(report, Console(file=buf, width=100, color_system=None))
    return buf.getvalue()


def row(text, label):
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"│ {label} ")]
    return [cell.strip() for cell in line.strip("│").split("│")]


def test_before_after_table():
    text = rendered(full_report())
    assert "pipeopt: before / after" in text
    assert row(text, "samples/s") == ["samples/s", "320.0", "640.0", "2.00x"]
    assert row(text, "data wait") == ["data wait", "40%", "2%", ""]
    assert row(text, "CPU main process") == ["CPU main process", "98 %", "98 %", ""]
    assert row(text, "GPU utilisation") == ["GPU utilisation", "n/a", "n/a", ""]
    assert "GPU monitoring: n/a (no NVIDIA driver)" in text
    assert "Verdict: input-bound" in text
    assert "Changed num_workers: 0 -> 2 (fastest within noise)" in text
    assert "Measured speedup (after over before): 2.00x (the prediction was off by 5%)" in text
    (trial_row,) = [ln for ln in text.splitlines() if "2 workers" in ln]
    assert [c.strip() for c in trial_row.strip("│").split("│")][2:4] == ["600.0", "640.0"]  # predicted, measured
    assert "Skipped dali: DALI is not installed" in text


def test_observe_only_with_no_window_yet():
    text = rendered(Report(mode="observe", environment=ENV, steps_measured=3))
    assert "first / last window (observe only)" in text
    assert "not enough steps were measured for a window (3 steps seen)" in text
    assert row(text, "samples/s") == ["samples/s", "-", "-", ""]
    assert "Nothing was changed (observe only)." in text


def test_gpu_figures_when_sampled():
    from pipeopt.measure.resources import ResourceFigures

    res = ResourceFigures(peak_mem_bytes=2**31, gpu_util_pct=97.0, gpu_mem_used_bytes=3 * 2**30, gpu_power_w=612.0,
                          gpu_status="sampled")
    w = make_window(resources=res)
    text = rendered(Report(mode="observe", environment=ENV, before=w, after=w))
    assert row(text, "GPU utilisation")[1:3] == ["97 %", "97 %"]
    assert row(text, "peak device memory")[1] == "2.00 GiB"
    assert row(text, "GPU power")[1] == "612 W"


def test_trial_settings_read_as_a_user_would_say_them():
    from pipeopt.report.console import settings_text
    from pipeopt.tuning.loader_search import LoaderSettings

    workers = LoaderSettings(num_workers=4, prefetch_factor=2, persistent_workers=True, pin_memory=True)
    assert settings_text(workers.as_kwargs()) == "4 workers, prefetch 2, persistent, pinned"
    user = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False)
    assert settings_text(user.as_kwargs()) == "main process"
    assert settings_text(LoaderSettings.dali_on("mixed").as_kwargs()) == "DALI (mixed decoding)"
    cached = LoaderSettings(num_workers=2, prefetch_factor=2, persistent_workers=True, pin_memory=False, cache=True)
    assert settings_text(cached.as_kwargs()) == "2 workers, prefetch 2, persistent, sample cache"
    assert settings_text(user.as_kwargs()) == "main process"  # no "cache=False"
    giving = LoaderSettings(num_workers=2, prefetch_factor=2, persistent_workers=True, pin_memory=False, cache=True,
                            give_way=True)
    assert settings_text(giving.as_kwargs()) == "2 workers, prefetch 2, persistent, sample cache, giving way"


def test_sample_cache_section():
    flat = " ".join(rendered(full_report()).replace("│", " ").split())
    for words in ("Sample cache", "Cached: each image read and decoded (uint8); kept: the run ended reading from it",
                  "Stored 96 of 96 items, 3.0 MiB of a 1.00 GiB budget", "Fill cost: 0.25 s of CPU in all",
                  "Best cached trial: 1.60x the window before it",
                  "Epoch 0: 96 samples, 96 made for the store, not read from the store (filling it)",
                  "Epoch 1: 96 samples, 0 made for the store, read from the store in part: settings that read it "
                  "were in place for 32 of its samples",
                  "Epoch 2: 96 samples, 0 made for the store, read from the store throughout: hit rate 100.0%"):
        assert words in flat, words
    # a cache given back after its trial: the epochs after it neither read the complete store nor filled it
    figures = full_report().sample_cache
    given_back = dataclasses.replace(figures, kept=False, epochs=[
        *figures.epochs[:2], dict(epoch=2, reading=False, samples=96, read=0, misses=0, hit_rate=None)])
    assert cache_lines(given_back)[0].endswith("not kept")
    assert cache_lines(given_back)[-1] == "Epoch 2: 96 samples, 0 made for the store, not read from the store"


def test_fit_and_cost_section():
    text = rendered(full_report())
    assert "Fit and cost" in text
    flat = " ".join(text.replace("│", " ").split())
    for words in ("parameters 400.0 MiB, gradients 400.0 MiB, optimizer state 800.0 MiB, activations 2.00 GiB",
                  "Limit: compute-bound", "Accelerator health: n/a (no NVIDIA driver)",
                  "Time per epoch (500 optimizer steps, at the before and after windows' measured pace): 50.0 s before "
                  "-> 25.0 s after", "Whole fit (5000 optimizer steps): 500.0 s before -> 250.0 s after",
                  "Epochs run to their end, wall time: 61.0, 48.5 s",
                  "whole fit 0.5556 before -> 0.2778 after, saving 0.2778", "16 GiB T4, V100 16GB fits fits"):
        assert words in flat, words


def test_a_first_window_that_ran_an_earlier_runs_settings_is_not_called_before():
    """Applied from the tuning cache (or a checkpoint) from the first step, the report has no window of the user's
    settings: the column, the speedup line and the time lines say "first window" and name what it ran."""
    report = full_report()
    report.before_ran = "the loader settings an earlier run of this fit cached (num_workers=2, ...)"
    text = rendered(report)
    assert "first window" in text.splitlines()[2] and "before" not in text.splitlines()[2]  # the column headers
    assert "after over before" not in text and "(from the first window)" in text
    assert "pipeopt: first window / after" in text
    measured = " ".join(text.replace("│", " ").split())  # wrapped in the panel
    assert "Measured speedup (after over the first window, which ran the loader settings an earlier run of " \
           "this fit cached (num_workers=2, ...)): 2.00x" in measured
    assert "prediction was off" not in measured  # its prediction was over another window
    assert "s first window -> " in measured and " s before" not in measured  # the time lines
