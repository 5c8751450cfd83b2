"""pipeopt is invisible to the user's code: whatever it tunes, ``training_step`` runs once per trained batch, on
the same samples in the same order; loggers and metrics see what a plain run gives them (plus ``pipeopt/...``)."""

import csv
import warnings

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader

from pipeopt.config import TUNE_GROUPS
from pipeopt.tuning.batch import BatchPlan
from tests.helpers import (
    Regressor,
    SleepyDataset,
    controlled_rates,
    controlled_wait,
    quiet_pipeopt,
    quiet_trainer_kwargs,
)


class Counted(Regressor):
    """Counts its training steps and keeps torchmetrics state and logs the way users do."""

    def __init__(self):
        super().__init__(hidden=16)
        self.ids = torchmetrics.SumMetric()
        self.samples = torchmetrics.SumMetric()
        self.per_epoch: list[tuple[float, float]] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.ids.update(batch[1].float().sum())
        self.samples.update(torch.tensor(float(len(batch[1]))))
        self.log("user_loss", loss, on_step=True, on_epoch=True)
        return loss

    def on_train_epoch_end(self):
        self.per_epoch.append((float(self.ids.compute()), float(self.samples.compute())))
        self.ids.reset()
        self.samples.reset()


class BatchesTrained(pl.Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1


def _fit(callbacks, tmp_path=None):
    pl.seed_everything(7, verbose=False)
    model, trained = Counted(), BatchesTrained()
    logger = CSVLogger(tmp_path, name="run") if tmp_path is not None else False
    trainer = pl.Trainer(max_epochs=3, accumulate_grad_batches=2, log_every_n_steps=1,
                         callbacks=[*callbacks, trained], **quiet_trainer_kwargs(logger=logger))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(SleepyDataset(n=512, delay_s=0.0005), batch_size=16, shuffle=True))
    return model, trained, trainer


def _users(tried):
    """Whether ``tried`` is what the user has: fp32, micro-batch 16, the main process loading."""
    if isinstance(tried, str):
        return tried == "32-true"
    if isinstance(tried, BatchPlan):
        return tried.micro == 16
    return tried.num_workers == 0 and not tried.dali


def _nothing_kept(monkeypatch):
    """Every candidate measures slower than what the user has: whatever is tried is rolled back. Every window waits
    half its step for data: the loader model's pick (2 workers), and so the steps its trials leave the other
    groups, are the same however busy the machine is."""
    controlled_rates(monkeypatch, lambda tried: 100.0 if _users(tried) else 50.0)
    controlled_wait(monkeypatch, 0.5)


@pytest.mark.parametrize("tune", [(), ("loader",), ("precision",), ("batch",), ("precision", "batch"), TUNE_GROUPS],
                         ids=["observe", "loader", "precision", "batch", "precision+batch", "default"])
def test_training_step_runs_once_per_trained_batch_on_every_sample_in_order(tune, monkeypatch):
    plain, _, _ = _fit([])
    _nothing_kept(monkeypatch)
    callback = quiet_pipeopt(tune=tune, budget_s=30.0)  # the loader search ends by its own rule, not the clock
    model, trained, trainer = _fit([callback])
    assert model.calls == trained.batches  # no call of training_step outside a trained batch
    assert model.seen == plain.seen  # every sample once per epoch, in the user's order
    assert model.per_epoch == plain.per_epoch == [(sum(range(512)), 512.0)] * 3  # the user's metrics agree
    tried = {w.label.split(":")[0] for w in callback.windows}
    if "loader" in tune:
        assert "trial" in tried  # a loader with workers was tried, then the user's restored
    if "batch" in tune:
        assert "batch trial" in tried  # the plan was tried on the live run: a fold of two batches, then rolled back
    if "precision" in tune:
        assert "precision trial" in tried
    assert not callback.report.changes


def _rows(path):
    with open(next(path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    user = [{k: v for k, v in r.items() if not k.startswith("pipeopt/")} for r in rows]
    return [(r["epoch"], r["step"], sorted(k for k, v in r.items() if v and k not in ("epoch", "step")))
            for r in user if any(v for k, v in r.items() if k not in ("epoch", "step"))]


def test_a_csv_logger_gets_the_plain_runs_rows_when_precision_and_batch_are_tried_and_nothing_kept(tmp_path,
                                                                                                   monkeypatch):
    _fit([], tmp_path / "plain")
    _nothing_kept(monkeypatch)
    callback = quiet_pipeopt(tune=("precision", "batch"))
    _fit([callback], tmp_path / "tuned")
    assert {w.label.split(":")[0] for w in callback.windows} >= {"batch trial", "precision trial"}
    assert _rows(tmp_path / "tuned") == _rows(tmp_path / "plain")  # same steps, same user metrics, no extra row


@pytest.mark.parametrize(("window", "batches"), [(4, 16), (20, 2)], ids=["tuned", "too-short-to-tune"])
def test_no_loader_iterator_outlives_the_fit(window, batches):
    """Lightning drops the train loader's iterator at the fit's end, and torch shuts a loader's workers down as its
    iterator is freed - by reference counting, with no garbage collection in between (Lightning's own
    ``test_workers_are_shutdown`` counts on it). pipeopt keeps no reference to an iterator: a step's reading of the
    ready batches names its epoch by number."""
    import gc

    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from tests.helpers import Regressor

    gc.collect()
    gc.disable()
    try:
        callback = quiet_pipeopt(tune=("loader", "precision", "batch"), window=window)
        trainer = pl.Trainer(max_epochs=3, limit_train_batches=batches, callbacks=[callback], **quiet_trainer_kwargs())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Regressor(), DataLoader(SleepyDataset(n=64, delay_s=0.0), batch_size=4, num_workers=1))
        alive = [o for o in gc.get_objects() if isinstance(o, _BaseDataLoaderIter)]
    finally:
        gc.enable()
    assert alive == []
