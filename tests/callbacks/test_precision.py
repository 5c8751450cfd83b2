"""Precision tuning in real fits on CPU: probes leave no trace; bf16 only when measured faster and safe."""

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

import pipeopt.apply.precision as precision_apply
from pipeopt.tuning.noise import Rate
from tests.helpers import (
    Regressor,
    SleepyDataset,
    StateAtTrainEnd,
    quiet_pipeopt,
    quiet_trainer_kwargs,
)


def _timed(bf16_speedup):
    """Real probe steps and losses; the clock says bf16 ran ``bf16_speedup`` x the fp32 rate."""
    real = precision_apply._time

    def timing(precision, step, **kwargs):
        _, losses = real(precision, step, **kwargs)
        return Rate(100.0 * (bf16_speedup if precision == "bf16-mixed" else 1.0), 0.01), losses

    return timing


def _fit(callbacks, seed=7, **trainer_kwargs):
    pl.seed_everything(seed, verbose=False)
    model = Regressor(hidden=32, dropout=0.3, batchnorm=True)
    loader = DataLoader(SleepyDataset(n=96, delay_s=0.0), batch_size=8, shuffle=True)
    trainer = pl.Trainer(max_epochs=2, callbacks=callbacks, **quiet_trainer_kwargs(**trainer_kwargs))
    trainer.fit(model, loader)
    return model, trainer


def test_probes_leave_every_state_as_it_was(monkeypatch):
    monkeypatch.setattr(precision_apply, "_time", _timed(0.5))  # bf16 slower: fp32 stays
    plain, _ = _fit([])
    callback = quiet_pipeopt(tune=("precision",))
    probed, trainer = _fit([callback])
    assert trainer.precision == "32-true"
    assert any("precision probes on the first batch" in n for n in callback.report.notes)
    # weights, batch-norm statistics, optimizer momentum and the dropout RNG stream all as without probes
    for name, value in plain.state_dict().items():
        assert torch.equal(value, probed.state_dict()[name]), name


def test_bf16_is_chosen_when_measured_faster_and_its_loss_is_close(monkeypatch):
    monkeypatch.setattr(precision_apply, "_time", _timed(1.6))
    callback = quiet_pipeopt(tune=("precision",))
    state = StateAtTrainEnd(callback)
    model, trainer = _fit([callback, state])
    assert trainer.precision == "bf16-mixed"  # the running fit was switched
    change = next(c for c in callback.report.changes if c.knob == "precision")
    assert (change.before, change.after) == ("32-true", "bf16-mixed") and "1.60x" in change.reason
    assert "Trainer(..., precision='bf16-mixed')" in callback.report.suggestions
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert state.state["tuned"]["precision"] == "bf16-mixed"


def test_bf16_is_not_chosen_when_its_loss_is_off(monkeypatch):
    real = _timed(1.6)

    def off_loss(precision, step, **kwargs):
        rate, losses = real(precision, step, **kwargs)
        return rate, tuple(x * 1.1 for x in losses) if precision == "bf16-mixed" else losses

    monkeypatch.setattr(precision_apply, "_time", off_loss)
    callback = quiet_pipeopt(tune=("precision",))
    _, trainer = _fit([callback])
    assert trainer.precision == "32-true"
    assert any("loss differs from fp32's" in n for n in callback.report.notes)


def test_an_explicit_precision_is_respected():
    callback = quiet_pipeopt(tune=("precision",))
    with pytest.warns(UserWarning, match="you chose precision='bf16-mixed'"):
        _, trainer = _fit([callback], precision="bf16-mixed")
    assert trainer.precision == "bf16-mixed"
    assert any(s.group == "precision" and "respects it" in s.reason for s in callback.report.skipped)
