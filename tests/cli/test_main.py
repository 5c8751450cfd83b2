"""``pipeopt tune`` / ``pipeopt report``: bad input gets a message and an exit status, never a pipeopt traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeopt.cli.main import main, parse_only

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train.py"


def cli(*args, cwd=None, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "pipeopt", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or ROOT)
    return proc.returncode, proc.stdout + proc.stderr


def test_missing_script(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["tune", str(tmp_path / "nope.py")])
    assert exit_.value.code == 2
    assert "nope.py: no such file" in capsys.readouterr().err


def test_unreadable_script(tmp_path, capsys, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    original = Path.read_bytes

    def denied(self):
        if self == script:
            raise PermissionError(13, "Permission denied")
        return original(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(SystemExit) as exit_:
        main(["tune", str(script)])
    assert exit_.value.code == 2
    assert "cannot be read (Permission denied)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tune", "x.py", "--speed", "9"], "unrecognized arguments: --speed"),
        (["tune", "x.py", "--only", "loader,turbo"], "unknown group(s) turbo"),
        (["tune", "x.py", "--budget", "-3"], "--budget (-3.0)` is not valid. Expected a number of seconds > 0"),
        (["tune", "x.py", "--budget", "soon"], "invalid float value: 'soon'"),
        (["tune", "x.py", "--cost-per-hour", "-1"], "--cost-per-hour (-1.0)` is not valid. Expected the price of one"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_options_print_usage_and_exit_2(tmp_path, capsys, args, message):
    (tmp_path / "x.py").write_text("")
    args = [str(tmp_path / a) if a == "x.py" else a for a in args]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err


def test_a_script_that_raises_shows_its_own_traceback(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("def load():\n    raise FileNotFoundError('data/train.csv')\n\nload()\n")
    status, out = cli("tune", script)
    assert status == 1
    assert "FileNotFoundError: data/train.csv" in out and 'broken.py", line 4' in out
    assert "runpy" not in out and "pipeopt/cli" not in out


def test_a_script_that_never_fits_is_told_so(tmp_path):
    script = tmp_path / "nofit.py"
    script.write_text("import pytorch_lightning as pl\ntrainer = pl.Trainer(logger=False)\nprint('built')\n")
    status, out = cli("tune", script)
    assert status == 3
    assert "never called Trainer.fit" in out


def test_a_script_without_a_trainer_is_told_so(tmp_path):
    script = tmp_path / "notrainer.py"
    script.write_text("print('nothing to train')\n")
    status, out = cli("tune", script)
    assert status == 3 and "never created a Trainer" in " ".join(out.split())  # the console wraps long lines


def test_ctrl_c_in_the_script_exits_130(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text("raise KeyboardInterrupt\n")
    status, out = cli("tune", script)
    assert status == 130 and "KeyboardInterrupt" in out


def test_a_script_with_its_own_pipeopt_is_tuned_with_it_and_gets_no_second(tmp_path):
    script = tmp_path / "own.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import pytorch_lightning as pl
from torch.utils.data import DataLoader
from pipeopt import PipeOpt
from tests.helpers import Regressor, SleepyDataset, quiet_trainer_kwargs

own = PipeOpt(tune=(), window=3, warmup=1, report_dir={str(tmp_path / "own")!r}, cache=False)
trainer = pl.Trainer(max_steps=10, callbacks=[own], **quiet_trainer_kwargs())
trainer.fit(Regressor(), DataLoader(SleepyDataset(delay_s=0.0), batch_size=4))
print("PipeOpts on the trainer:", sum(isinstance(c, PipeOpt) for c in trainer.callbacks))
""")
    status, out = cli("tune", script, "--report-dir", tmp_path / "cli")
    assert status == 0, out
    assert "PipeOpts on the trainer: 1" in out and "creates its own PipeOpt" in " ".join(out.split())
    assert len(list((tmp_path / "own").glob("*.json"))) == 1 and not (tmp_path / "cli").exists()
    assert "Report:" in out


def test_the_scripts_own_exit_status_is_kept(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text("import sys\nsys.exit(4)\n")
    assert cli("tune", script)[0] == 4


def test_parse_only():
    assert parse_only("loader, precision") == ("loader", "precision")
    assert parse_only("none") == ()
    with pytest.raises(ValueError, match="choose from loader, dali, precision, batch"):
        parse_only("")


def test_tune_stops_after_tuning_writes_reports_and_cache_then_hits_the_cache(tmp_path):
    cache = tmp_path / "tuned.json"
    reports = tmp_path / "reports"
    args = ("tune", EXAMPLE, "--only", "loader", "--budget", "20", "--report-dir", reports, "--cache", cache,
            "--cost-per-hour", "3.5", "--", "--steps", "20000", "--samples", "200000")
    status, out = cli(*args)
    assert status == 0, out
    (first,) = sorted(reports.glob("*.json"))
    report = json.loads(first.read_text())
    assert report["trials"] and report["steps_measured"] < 20000  # stopped once tuning was verified
    assert report["fit"]["time"]["cost_per_hour"] == 3.5 and "Fit and cost" in out
    assert first.with_suffix(".html").exists()
    stored = json.loads(cache.read_text())
    assert len(stored["entries"]) == 1
    assert "Report:" in out and "Tuning cache:" in out

    # The rerun verifies the cached configuration against the rate stored with it (within 20 %); how fast this
    # machine is right now must not decide the test, so the stored rate is one any machine reaches.
    (entry,) = stored["entries"].values()
    entry["samples_per_s"] = 1.0
    cache.write_text(json.dumps(stored))
    status, out = cli(*args)
    assert status == 0, out
    second = json.loads(max(reports.glob("*.json"), key=lambda p: p.stat().st_mtime_ns).read_text())
    assert second["trials"] == []
    assert any("applied the cached loader configuration" in n for n in second["notes"])


def test_a_corrupt_cache_is_survived_and_rewritten(tmp_path):
    cache = tmp_path / "tuned.json"
    cache.write_text("{ not json")
    status, out = cli("tune", EXAMPLE, "--only", "loader", "--budget", "10", "--report-dir", tmp_path / "r",
                      "--cache", cache, "--", "--steps", "20000", "--samples", "200000")
    assert status == 0, out
    assert "is corrupt" in out
    assert json.loads(cache.read_text())["pipeopt_cache"] == 1


def test_report_rerenders_a_saved_report(tmp_path):
    from pipeopt.report.json_io import write_report
    from tests.report.test_json import full_report

    path = write_report(full_report(), tmp_path)
    status, out = cli("report", path, "--html", tmp_path / "page.html")
    assert status == 0, out
    assert "pipeopt: before / after" in out and (tmp_path / "page.html").exists()
    assert "Fit and cost" in out and "Fit and cost" in (tmp_path / "page.html").read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    status, out = cli("report", bad)
    assert status == 2 and "is not a pipeopt report" in out
