"""Precision tried on the live run (CPU, bf16 autocast): every step measured is a step the model trains on; a
candidate is kept only when its window is faster beyond noise with its loss in line, and reverted otherwise."""

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from tests.helpers import (
    Regressor,
    SleepyDataset,
    StateAtTrainEnd,
    controlled_rates,
    quiet_pipeopt,
    quiet_trainer_kwargs,
)


class Counted(Regressor):
    """Counts its training_step calls and records whether each ran under CPU autocast (bf16-mixed)."""

    def __init__(self, nan_under_autocast=False, **kwargs):
        super().__init__(**kwargs)
        self.autocast, self.nan_under_autocast = [], nan_under_autocast  # Regressor counts the calls

    def training_step(self, batch, batch_idx):
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        loss = super().training_step(batch, batch_idx)
        if self.nan_under_autocast and self.autocast[-1]:  # the value turns NaN; the gradients stay finite
            nan = torch.tensor(float("nan"))
            loss = loss + (nan - nan.detach())
        return loss


def _fit(callbacks, *, model=None, seed=7, epochs=2, **trainer_kwargs):
    pl.seed_everything(seed, verbose=False)
    model = model or Counted(hidden=32, dropout=0.3, batchnorm=True)
    loader = DataLoader(SleepyDataset(n=96, delay_s=0.0), batch_size=8, shuffle=True)
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, **quiet_trainer_kwargs(**trainer_kwargs))
    trainer.fit(model, loader)
    return model, trainer


def test_bf16_is_tried_on_the_live_run_and_kept_when_faster(monkeypatch):
    controlled_rates(monkeypatch, lambda p: 160.0 if p == "bf16-mixed" else 100.0)
    callback = quiet_pipeopt(tune=("precision",))
    state = StateAtTrainEnd(callback)
    model, trainer = _fit([callback, state])
    assert trainer.precision == "bf16-mixed"  # the running fit was switched, and stays so
    assert model.calls == 24  # 12 batches x 2 epochs: training_step ran once per trained batch, never more
    assert True in model.autocast and model.autocast[-1]  # the trial and the rest of the fit trained in bf16
    change = next(c for c in callback.report.changes if c.knob == "precision")
    assert (change.before, change.after) == ("32-true", "bf16-mixed") and "1.60x" in change.reason
    assert "live trial window" in change.reason
    assert "Trainer(..., precision='bf16-mixed')" in callback.report.suggestions
    assert (change.predicted_speedup, change.measured_speedup) == (pytest.approx(1.6), pytest.approx(1.6))
    assert callback.report.after.label == "after: bf16-mixed"  # the window that verified it is the report's after
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert state.state["tuned"]["precision"] == "bf16-mixed"


def test_a_candidate_that_is_not_faster_is_reverted(monkeypatch):
    controlled_rates(monkeypatch, lambda p: 50.0 if p == "bf16-mixed" else 100.0)
    callback = quiet_pipeopt(tune=("precision",))
    model, trainer = _fit([callback])
    assert trainer.precision == "32-true" and not model.autocast[-1]
    assert model.calls == 24
    assert True in model.autocast  # it was tried: a window of real steps in bf16
    assert any("not faster beyond noise" in n for n in callback.report.notes)
    assert callback.report.changes == []


def test_a_kept_precision_whose_after_window_is_not_faster_is_rolled_back(monkeypatch):
    seen = {"bf16-mixed": 0}

    def rate(p):  # bf16 is fast in its trial window, then no faster than fp32 in the window after the change
        if p != "bf16-mixed":
            return 100.0
        seen[p] += 1
        return 160.0 if seen[p] == 1 else 101.0

    controlled_rates(monkeypatch, rate)
    callback = quiet_pipeopt(tune=("precision",))
    model, trainer = _fit([callback])
    assert trainer.precision == "32-true" and not model.autocast[-1]  # back in fp32 for the rest of the fit
    assert model.calls == 24
    assert callback.report.changes == []
    note = next(n for n in callback.report.notes if n.startswith("precision: rolled back"))
    assert "its after-window measured 101.0 samples/s against fp32's 100.0: not faster beyond noise" in note


def test_a_non_finite_loss_reverts_at_once(monkeypatch):
    controlled_rates(monkeypatch, lambda p: 500.0 if p == "bf16-mixed" else 100.0)  # however fast it looks
    callback = quiet_pipeopt(tune=("precision",))
    model, trainer = _fit([callback], model=Counted(nan_under_autocast=True, hidden=32))
    assert trainer.precision == "32-true"
    assert model.autocast.count(True) == 1  # the step after the first NaN loss already ran in fp32 again
    assert any("bf16-mixed failed (its loss turned nan)" in n for n in callback.report.notes)
    assert callback.report.changes == []


def test_every_trained_batch_runs_training_step_once_and_the_users_metrics_are_a_plain_runs(tmp_path, monkeypatch):
    # nothing kept: the user's logged rows are the plain run's (the trial's steps are real, trained steps)
    controlled_rates(monkeypatch, lambda p: 50.0 if p == "bf16-mixed" else 100.0)

    def rows(callbacks, name):
        logger = pl.loggers.CSVLogger(tmp_path, name=name)

        class Logs(Counted):
            def training_step(self, batch, batch_idx):
                loss = super().training_step(batch, batch_idx)
                self.log("user_loss", loss.detach())
                self.log("user_samples", float(len(batch[1])), reduce_fx="sum")
                return loss

        model, _ = _fit(callbacks, model=Logs(hidden=32), logger=logger, log_every_n_steps=1)
        import csv

        with open(logger.experiment.metrics_file_path) as handle:
            data = [{k: v for k, v in r.items() if v and not k.startswith("pipeopt/")} for r in csv.DictReader(handle)]
        return model, [r for r in data if set(r) - {"step", "epoch"}]

    plain_model, plain = rows([], "plain")
    tuned_model, tuned = rows([quiet_pipeopt(tune=("precision",))], "tuned")
    assert tuned_model.calls == plain_model.calls == 24
    assert [(r["step"], sorted(r)) for r in tuned] == [(r["step"], sorted(r)) for r in plain]
    assert [r["user_samples"] for r in tuned] == [r["user_samples"] for r in plain]


def test_an_explicit_precision_is_respected():
    callback = quiet_pipeopt(tune=("precision",))
    with pytest.warns(UserWarning, match="you chose precision='bf16-mixed'"):
        _, trainer = _fit([callback], precision="bf16-mixed")
    assert trainer.precision == "bf16-mixed"
    assert any(s.group == "precision" and "respects it" in s.reason for s in callback.report.skipped)
