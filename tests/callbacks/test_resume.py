"""Tuned settings travel in the checkpoint: a resumed run applies them without trials."""

import io

import pytorch_lightning as pl
from rich.console import Console
from torch.utils.data import DataLoader

from pipeopt import PipeOpt
from tests.helpers import Regressor, SleepyDataset, quiet_trainer_kwargs


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


def test_resume_applies_the_tuned_settings_with_zero_trials(tmp_path):
    first, trainer = run(tmp_path, epochs=2)
    assert first.report.trials, "the first run tuned"
    assert not any("ended before loader tuning finished" in n for n in first.report.notes)
    kept = {c.knob: c.after for c in first.report.changes}
    resumed, trainer2 = run(tmp_path, epochs=3, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.report.trials == []
    assert {c.knob: c.after for c in resumed.report.changes} == kept
    loader = trainer2.train_dataloader
    expected = kept.get("num_workers", 0)
    assert loader.num_workers == expected
    assert any("resumed from a checkpoint" in note for note in resumed.report.notes)
