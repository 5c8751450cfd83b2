"""PipeOpt in observe mode on real, tiny Lightning fits (CPU)."""

import csv
import io
import json
import warnings

import jsonschema
import pytest
import pytorch_lightning as pl
import torch
from rich.console import Console
from torch.utils.data import DataLoader

from pipeopt import PipeOpt
from pipeopt.measure.tap import ProfilerTap
from pipeopt.report.json_io import SCHEMA_PATH
from tests.helpers import Regressor, SleepyDataset, quiet_pipeopt, quiet_trainer_kwargs, resident_dataset


def observe(**kwargs):
    return quiet_pipeopt(**{"tune": (), "window": 5, **kwargs})


def test_storage_latency_run_is_input_bound():
    callback = observe()
    trainer = pl.Trainer(max_steps=20, callbacks=[callback], **quiet_trainer_kwargs())
    # 20 ms of storage latency a sample, 160 ms a batch, against a step of a tiny MLP (about 1 ms): input-bound by
    # a margin no busy machine closes (at 3 ms a sample, two other processes on 2 cores once brought it to 45 %)
    trainer.fit(Regressor(), DataLoader(SleepyDataset(delay_s=0.02), batch_size=8))
    report = callback.report
    assert report.before.data_wait_frac > 0.5
    assert report.verdict.kind == "input-bound"
    assert report.verdict.input_free_speedup > 2
    assert report.before.samples == 5 * 8


def test_resident_tensors_are_compute_bound():
    callback = observe()
    trainer = pl.Trainer(max_steps=20, callbacks=[callback], **quiet_trainer_kwargs())
    # a step of ~130 ms against a fetch of well under 1 ms: a wait of 10 % needs a stall no busy machine gave (with
    # hidden=1024, a ~65 ms step, one busy-core run judged it balanced once)
    trainer.fit(Regressor(dim=256, hidden=2048, depth=3), DataLoader(resident_dataset(), batch_size=64))
    report = callback.report
    assert report.before.data_wait_frac < 0.2
    assert report.verdict.kind == "compute-bound"
    assert report.before.busy_frac > 0.5


def test_json_report_is_written_and_matches_its_schema(tmp_path):
    callback = observe(report_dir=tmp_path / "reports")
    trainer = pl.Trainer(max_steps=14, callbacks=[callback], **quiet_trainer_kwargs())
    trainer.fit(Regressor(), DataLoader(SleepyDataset(delay_s=0.001), batch_size=4))
    assert callback.report_path.parent == tmp_path / "reports"
    data = json.loads(callback.report_path.read_text())
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["mode"] == "observe" and data["steps_measured"] == 14
    assert data["before"]["first_step"] == 2 and data["after"]["first_step"] == 12


def _fit_weights(callbacks, seed=7):
    pl.seed_everything(seed, verbose=False)
    model = Regressor(hidden=32, dropout=0.3, batchnorm=True)
    loader = DataLoader(SleepyDataset(n=96, delay_s=0.0), batch_size=8, shuffle=True)
    trainer = pl.Trainer(max_epochs=2, callbacks=callbacks, **quiet_trainer_kwargs())
    trainer.fit(model, loader)
    return model.state_dict(), model.seen


def test_observing_changes_nothing_the_model_learns():
    plain_weights, plain_order = _fit_weights([])
    observed_weights, observed_order = _fit_weights([observe(window=3, warmup=1)])
    assert observed_order == plain_order
    assert plain_weights.keys() == observed_weights.keys()
    for name, value in plain_weights.items():
        assert torch.equal(value, observed_weights[name]), name


def test_window_figures_reach_the_trainers_loggers(tmp_path):
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    callback = observe()
    trainer = pl.Trainer(max_steps=20, callbacks=[callback], **quiet_trainer_kwargs(logger=logger))
    trainer.fit(Regressor(), DataLoader(SleepyDataset(delay_s=0.001), batch_size=4))
    with open(logger.experiment.metrics_file_path) as handle:
        rows = list(csv.DictReader(handle))
    waits = [float(r["pipeopt/data_wait_frac"]) for r in rows if r.get("pipeopt/data_wait_frac")]
    assert len(waits) == len(callback.windows) == 4
    assert waits == pytest.approx([w.data_wait_frac for w in callback.windows])
    assert any(r.get("pipeopt/measured_speedup") for r in rows)


def test_gradient_accumulation_windows_count_optimizer_steps():
    callback = observe(window=3, warmup=1)
    trainer = pl.Trainer(max_steps=10, accumulate_grad_batches=3, callbacks=[callback], **quiet_trainer_kwargs())
    trainer.fit(Regressor(), DataLoader(SleepyDataset(delay_s=0.0), batch_size=4))
    assert callback.windows, "no window was measured"
    for w in callback.windows:
        assert w.samples == w.steps * 3 * 4


def test_validation_time_is_not_counted_as_training_time():
    class SlowValidation(Regressor):
        def validation_step(self, batch, batch_idx):
            import time

            time.sleep(0.5)

    callback = observe(window=4, warmup=1)
    trainer = pl.Trainer(max_steps=16, val_check_interval=3, limit_val_batches=1, num_sanity_val_steps=0,
                         callbacks=[callback], **quiet_trainer_kwargs())
    trainer.fit(SlowValidation(), DataLoader(SleepyDataset(delay_s=0.0), batch_size=4),
                DataLoader(SleepyDataset(n=8, delay_s=0.0), batch_size=4))
    assert len(callback.windows) >= 3
    # a validation every 3 steps costs 0.5 s: counted, it would add over 0.12 s to every step of a window; the
    # steps themselves (a tiny MLP on 4 samples) take milliseconds even on a busy machine
    assert max(w.step_time_s for w in callback.windows) < 0.1


def test_dali_is_skipped_with_its_reason_for_a_dataset_it_cannot_rebuild():
    with pytest.warns(UserWarning, match="not tuning the dali") as record:
        callback = PipeOpt(window=3, warmup=1, report_dir=None, console=Console(file=io.StringIO()))
        trainer = pl.Trainer(max_steps=12, callbacks=[callback], **quiet_trainer_kwargs())
        trainer.fit(Regressor(), DataLoader(SleepyDataset(delay_s=0.0), batch_size=4))
    assert len([w for w in record if "PipeOpt" in str(w.message)]) == 1  # the cache's skip is in the report only
    skipped = {s.group: s.reason for s in callback.report.skipped}
    assert set(skipped) == {"dali", "cache"}
    assert "the dataset is a SleepyDataset, not a torchvision ImageFolder" in skipped["dali"]
    assert "from the second epoch" in skipped["cache"]


def test_observe_only_does_not_warn():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*PipeOpt.*")
        trainer = pl.Trainer(max_steps=6, callbacks=[observe()], **quiet_trainer_kwargs())
        trainer.fit(Regressor(), DataLoader(SleepyDataset(delay_s=0.0), batch_size=4))


def test_an_unwritable_report_dir_warns_and_training_completes(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    callback = observe(report_dir=blocker / "reports")
    trainer = pl.Trainer(max_steps=10, callbacks=[callback], **quiet_trainer_kwargs())
    with pytest.warns(UserWarning, match="could not write its report"):
        trainer.fit(Regressor(), DataLoader(SleepyDataset(delay_s=0.0), batch_size=4))
    assert trainer.global_step == 10 and callback.report is not None and callback.report_path is None


def test_the_users_profiler_still_profiles_and_is_restored():
    profiler = pl.profilers.SimpleProfiler()
    trainer = pl.Trainer(max_steps=8, profiler=profiler, callbacks=[observe()], **quiet_trainer_kwargs())
    trainer.fit(Regressor(), DataLoader(SleepyDataset(delay_s=0.0), batch_size=4))
    assert trainer.profiler is profiler
    assert len(profiler.recorded_durations["run_training_batch"]) == 8


def test_a_failing_step_surfaces_unchanged_and_cleans_up():
    class Boom(Regressor):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                raise ZeroDivisionError("user bug")
            return super().training_step(batch, batch_idx)

    trainer = pl.Trainer(max_steps=8, callbacks=[observe()], **quiet_trainer_kwargs())
    original = trainer.profiler
    with pytest.raises(ZeroDivisionError, match="user bug"):
        trainer.fit(Boom(), DataLoader(SleepyDataset(delay_s=0.0), batch_size=4))
    assert trainer.profiler is original and not isinstance(trainer.profiler, ProfilerTap)


def test_console_report_is_printed_at_the_end_of_fit():
    buf = io.StringIO()
    trainer = pl.Trainer(max_steps=12, callbacks=[observe(console=Console(file=buf, width=100, color_system=None))],
                         **quiet_trainer_kwargs())
    trainer.fit(Regressor(), DataLoader(SleepyDataset(delay_s=0.002), batch_size=4))
    text = buf.getvalue()
    assert "first / last window (observe only)" in text and "Verdict: input-bound" in text


def test_works_under_the_lightning_namespace():
    L = pytest.importorskip("lightning.pytorch", reason="the `lightning` package is not installed")

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = observe()
    trainer = L.Trainer(max_steps=12, callbacks=[callback], **quiet_trainer_kwargs())
    trainer.fit(Model(), DataLoader(SleepyDataset(delay_s=0.002), batch_size=4))
    assert callback.report.before.data_wait_frac > 0.5
    assert not isinstance(trainer.profiler, ProfilerTap)


def _logged_calls(tmp_path, callbacks):
    from unittest.mock import Mock

    class Logs(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("user_loss", loss)
            return loss

    logger = Mock()
    logger.save_dir = tmp_path
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=12, log_every_n_steps=1, callbacks=callbacks,
                         **quiet_trainer_kwargs(logger=logger))
    trainer.fit(Logs(), DataLoader(SleepyDataset(delay_s=0.001), batch_size=4))
    return [(c.args, c.kwargs) for c in logger.log_metrics.mock_calls]


def _metrics(call):
    args, kwargs = call
    return kwargs.get("metrics", args[0] if args else None)


def _step(call):
    args, kwargs = call
    return kwargs.get("step", args[1] if len(args) > 1 else None)


@pytest.mark.parametrize("window", [3, 50], ids=["windows", "no-window"])
def test_the_users_loggers_get_the_plain_runs_calls_plus_pipeopt_metrics_at_their_steps(tmp_path, window):
    plain = _logged_calls(tmp_path, [])
    observed = _logged_calls(tmp_path, [observe(window=window, warmup=1)])
    ours = [c for c in observed if any(k.startswith("pipeopt/") for k in _metrics(c))]
    theirs = [c for c in observed if c not in ours]
    assert [_step(c) for c in theirs] == [_step(c) for c in plain]  # the user's own calls, untouched
    assert [sorted(_metrics(c)) for c in theirs] == [sorted(_metrics(c)) for c in plain]
    for call in ours:  # never empty, only pipeopt's keys, at a step the run logged anyway
        assert _metrics(call) and all(k.startswith("pipeopt/") for k in _metrics(call))
        assert _step(call) in {_step(c) for c in plain}
    assert (len(ours) > 0) == (window == 3)  # 12 steps hold windows of 3, not of 50: then nothing at all (not
    # even the memory breakdown, which the report still has: loggers get pipeopt rows only for a measured fit)
    if window == 3:
        assert any("pipeopt/memory/params_mb" in _metrics(c) for c in ours)


def test_a_fit_too_short_to_pay_back_tuning_is_observed_only_with_one_warning():
    callback = PipeOpt(window=3, warmup=1, report_dir=None, console=Console(file=io.StringIO()))
    with pytest.warns(UserWarning) as record:
        trainer = pl.Trainer(max_steps=9, callbacks=[callback], **quiet_trainer_kwargs())  # 1 + 3 x 3 = 10 needed
        trainer.fit(Regressor(), DataLoader(SleepyDataset(delay_s=0.002), batch_size=4))
    ours = [str(w.message) for w in record if "PipeOpt" in str(w.message)]
    short = [m for m in ours if "too short for tuning to pay back its cost" in m]
    assert len(short) == 1 and "precision, batch, loader" in short[0] and "9 optimizer steps left" in short[0]
    skipped = {s.group: s.reason for s in callback.report.skipped}
    assert {"precision", "batch", "loader"} <= set(skipped) and "dali" in skipped  # DALI keeps its own reason
    # nothing tried: the windows are of the run as it is
    assert callback.windows and all(w.label == "observe" for w in callback.windows)
    assert trainer.train_dataloader.num_workers == 0 and not callback.report.changes
