"""Tuned settings travel in the checkpoint: a resumed run applies them without trials."""

import io

import pytorch_lightning as pl
import torch
from rich.console import Console
from torch.utils.data import DataLoader

from pipeopt import PipeOpt
from tests.helpers import Regressor, SleepyDataset, controlled_rates, quiet_trainer_kwargs


def run(tmp_path, epochs, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    callback = PipeOpt(tune=("loader",), window=4, window_s=0, warmup=2, budget_s=2, report_dir=None,
                       console=Console(file=io.StringIO()))
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[callback, checkpoint],
                         **quiet_trainer_kwargs(enable_checkpointing=True))
    trainer.fit(Regressor(), DataLoader(SleepyDataset(n=4096, delay_s=0.003), batch_size=8, shuffle=True),
                ckpt_path=ckpt_path)
    return callback, trainer


def test_resume_applies_the_tuned_settings_with_zero_trials(tmp_path, monkeypatch):
    controlled_rates(monkeypatch, lambda s: 300.0 if s.num_workers else 100.0)  # workers must win and be kept
    first, trainer = run(tmp_path, epochs=2)
    assert first.report.trials, "the first run tuned"
    assert not any("ended before loader tuning finished" in n for n in first.report.notes)
    kept = {c.knob: c.after for c in first.report.changes}
    assert kept["num_workers"] > 0 and trainer.train_dataloader.num_workers == kept["num_workers"]
    resumed, trainer2 = run(tmp_path, epochs=3, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.report.trials == []
    assert {c.knob: c.after for c in resumed.report.changes} == kept
    loader = trainer2.train_dataloader
    assert loader.num_workers == kept["num_workers"]
    assert any("resumed from a checkpoint" in note for note in resumed.report.notes)
    # the kept settings ran from the resumed fit's first step: its report does not call that window "before"
    assert first.report.before_ran is None
    assert resumed.report.before_ran.startswith("the loader settings the run this one resumes kept (num_workers=")


def test_resume_applies_the_tuned_precision_and_batch_plan_without_trying_again(tmp_path, monkeypatch):
    import pipeopt.apply.batch as batch_apply
    from tests.helpers import SamplesPerStep, TightMemory

    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory())  # 32 samples do not fit; 8 x 4 does
    controlled_rates(monkeypatch, lambda p: 160.0 if p == "bf16-mixed" else 100.0)  # bf16 measured faster

    def fit(epochs, ckpt_path=None):
        pl.seed_everything(0, verbose=False)
        callback = PipeOpt(tune=("precision", "batch"), window=4, window_s=0, warmup=2, report_dir=None,
                           console=Console(file=io.StringIO()))
        counter = SamplesPerStep()
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
        trainer = pl.Trainer(max_epochs=epochs, callbacks=[callback, counter, checkpoint],
                             **quiet_trainer_kwargs(enable_checkpointing=True))
        trainer.fit(Regressor(), DataLoader(SleepyDataset(n=512, delay_s=0.0), batch_size=32, shuffle=True),
                    ckpt_path=ckpt_path)
        return callback, counter, trainer

    first, _, trainer = fit(epochs=2)
    assert trainer.precision == "bf16-mixed" and trainer.accumulate_grad_batches == 4
    assert any("batch windows on the live run" in n for n in first.report.notes)
    assert any("precision windows on the live run" in n for n in first.report.notes)
    resumed, counter, trainer2 = fit(epochs=3, ckpt_path=tmp_path / "last.ckpt")
    assert trainer2.precision == "bf16-mixed" and trainer2.accumulate_grad_batches == 4
    assert not any("precision windows" in n or "batch windows" in n  # applied at once, not tried again
                   for n in resumed.report.notes)
    assert not any(w.label.startswith(("batch", "precision")) for w in resumed.windows)
    assert counter.per_step == [32] * 16  # the resumed epoch: the same effective batch, in micro-batches of 8
    assert {c.knob: c.after for c in resumed.report.changes} == {
        "precision": "bf16-mixed", "batch_size": 8, "accumulate_grad_batches": 4}


def test_resume_reads_from_the_sample_cache_again_without_a_trial_and_trains_as_without_pipeopt(tmp_path,
                                                                                                 monkeypatch):
    controlled_rates(monkeypatch, lambda s: 300.0 if s.cache else 100.0)  # reading from the store wins

    def fit(epochs, callbacks, ckpt_path=None, directory=tmp_path / "ckpt"):
        pl.seed_everything(0, verbose=False)
        model = Regressor(dropout=0.5)
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath=directory, save_last=True)
        trainer = pl.Trainer(max_epochs=epochs, callbacks=[*callbacks, checkpoint],
                             **quiet_trainer_kwargs(enable_checkpointing=True))
        trainer.fit(model, DataLoader(SleepyDataset(n=128, delay_s=0.001), batch_size=8, shuffle=True),
                    ckpt_path=ckpt_path)
        return model

    def tuner():
        return PipeOpt(tune=("cache",), window=4, window_s=0, warmup=2, report_dir=tmp_path / "reports",
                       cache=False, console=Console(file=io.StringIO()))

    first = tuner()
    fit(5, [first])
    assert [c.knob for c in first.report.changes] == ["cache"]
    resumed = tuner()
    model = fit(7, [resumed], ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert [c.knob for c in resumed.report.changes] == ["cache"]
    assert not any(w.label.startswith("cache") for w in resumed.windows)  # no trial, no waiting: applied at once
    rows = resumed.report.sample_cache.epochs
    assert [r["reading"] for r in rows] == [True, True] and rows[-1]["hit_rate"] == 1.0  # refilled, then read
    plain_first = fit(5, [], directory=tmp_path / "plain")
    plain = fit(7, [], ckpt_path=tmp_path / "plain" / "last.ckpt", directory=tmp_path / "plain")
    assert plain_first is not None
    for name, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
