import shutil
import subprocess

import pytest

from pipeopt.measure.resources import ResourceFigures
from pipeopt.report.html import render_html, write_html
from pipeopt.report.model import Report
from tests.helpers import make_window
from tests.report.test_json import ENV, HEALTH, full_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_self_contained_page_with_every_section():
    page = render_html(full_report())
    assert "<script" not in page and "http://" not in page and "https://" not in page  # nothing fetched, nothing run
    for text in ("input-bound", "Before / after", "Where a step's time goes", "Trials on the live run",
                 "- DataLoader(..., num_workers=0)", "+ DataLoader(..., num_workers=2)", "worker crashed",
                 "Skipped dali: DALI is not installed"):
        assert text in page, text
    assert page.count("<svg") == 5  # step split, trials, throughput and time shares over the run, memory breakdown
    assert "memory (GiB)</b>: not measured on this run" in page  # a CPU run: no device memory
    for text in ("Fit and cost", "aria-label='memory breakdown'", "optimizer state 800.0 MiB", "+40 % buffer",
                 "Accelerator health: n/a (no NVIDIA driver)", "Cost at 4 an hour"):
        assert text in page, text
    for text in ("<h2>Sample cache</h2>", "Stored 96 of 96 items",
                 "Epoch 2: 96 samples, 0 made for the store, read from the store throughout: hit rate"):
        assert text in page, text
    assert "accelerator health (x: optimizer step)" not in page  # no NVML series: no chart of zeros


def test_accelerator_health_is_charted_when_nvml_sampled_it():
    report = full_report()
    report.timeline = [make_window(index=i, first_step=5 + 10 * i, resources=HEALTH) for i in range(3)]
    report.after = report.timeline[-1]
    page = render_html(report)
    assert "accelerator health (x: optimizer step)" in page
    assert "utilisation 91 % (p95 99 %), power 410 W (p95 470 W) of a 700 W limit, temperature 61 C (p95 64 C)" in page
    assert "clock events: power cap" in page


def test_text_from_the_run_is_escaped():
    report = full_report()
    report.notes.append("<img src=x onerror=alert(1)>")
    assert "<img src=x" not in render_html(report)


def test_unmeasured_gpu_series_say_so():
    windows = [make_window(index=i, first_step=5 + 10 * i, resources=ResourceFigures(gpu_status="n/a"))
               for i in range(3)]
    page = render_html(Report(mode="observe", environment=ENV, before=windows[0], after=windows[-1], timeline=windows))
    assert "memory (GiB)</b>: not measured on this run" in page


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (`make test` installs it with apt-get where "
                                             "it can: apt-get install chromium)")
def test_the_page_renders_in_a_real_browser(tmp_path):
    from PIL import Image

    page = write_html(full_report(), tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", "--window-size=1100,4000", f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=180,
    )
    assert shot.exists(), proc.stderr[-2000:]
    assert "Uncaught" not in proc.stderr and ":CONSOLE(" not in proc.stderr
    image = Image.open(shot).convert("RGB")
    colours = {c for _, c in image.getcolors(maxcolors=1_000_000)}
    assert len(colours) > 50  # not blank
    for bar in ((217, 83, 79), (92, 184, 92), (31, 119, 180), (225, 87, 89)):  # data wait, compute, trial bars and
        # the activations' share of the memory bar: the SVG rendered
        assert bar in colours


def test_a_first_window_that_ran_an_earlier_runs_settings_is_headed_so():
    report = full_report()
    report.before_ran = "the loader settings an earlier run of this fit cached (num_workers=2, ...)"
    page = render_html(report)
    assert "<th>first window</th>" in page and "<th>before</th>" not in page
    assert "Measured speedup (after over the first window, which ran the loader settings an earlier run" in page
    assert "(first window)." in page and "s first window -&gt; " in page and "(before window)" not in page
