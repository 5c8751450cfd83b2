"""Loader tuning on real, tiny Lightning fits: the model sees exactly what it would have seen without pipeopt."""

import os
from types import SimpleNamespace

import psutil
import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeopt.callbacks import loader_start
from tests.helpers import (
    Regressor,
    SleepyDataset,
    controlled_rates,
    controlled_wait,
    quiet_pipeopt,
    quiet_trainer_kwargs,
    resident_dataset,
)

tuner = quiet_pipeopt


def fit(callbacks, dataset, *, epochs=2, batch_size=8, seed=3, model_kwargs=None):
    pl.seed_everything(seed, verbose=False)
    model = Regressor(**(model_kwargs or {}))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, **quiet_trainer_kwargs())
    trainer.fit(model, loader)
    return model, trainer


class CrashingWorkers(SleepyDataset):
    """Worker processes die outright: every candidate with workers crashes."""

    def __getitem__(self, i):
        info = get_worker_info()
        if info is not None:
            os._exit(3)
        return super().__getitem__(i)


def test_order_is_identical_and_a_switch_happened_mid_epoch(room_for_a_trial):
    data = SleepyDataset(n=512, delay_s=0.002)
    plain, _ = fit([], data)
    callback = tuner()
    tuned, trainer = fit([callback], data)
    assert tuned.seen == plain.seen
    assert len(callback.report.trials) >= 2  # the user's settings and at least one candidate
    assert callback.windows[1].label.startswith("trial")
    assert callback.windows[1].first_step < 512 // 8  # in the first epoch, i.e. mid-epoch
    assert psutil.Process().children() == []


def test_final_weights_are_bit_identical_with_dropout_and_batchnorm(room_for_a_trial):
    data = SleepyDataset(n=192, delay_s=0.001)
    model_kwargs = dict(hidden=32, dropout=0.5, batchnorm=True)
    plain, _ = fit([], data, epochs=3, model_kwargs=model_kwargs)
    callback = tuner(window=3, warmup=1)
    tuned, _ = fit([callback], data, epochs=3, model_kwargs=model_kwargs)
    assert any(t.settings["num_workers"] > 0 for t in callback.report.trials)
    assert tuned.seen == plain.seen
    for name, value in plain.state_dict().items():
        assert torch.equal(value, tuned.state_dict()[name]), name
    assert torch.equal(torch.get_rng_state(), _rng_after_plain_fit(data, model_kwargs))


def _rng_after_plain_fit(data, model_kwargs):
    fit([], data, epochs=3, model_kwargs=model_kwargs)
    return torch.get_rng_state()


def test_a_crashing_candidate_is_discarded_and_training_goes_on(monkeypatch):
    # Half of each step waits for data, however busy the machine is: the model picks 2 workers (the pick follows
    # the wait), whose trial and after-windows fit the fit's 64 steps; they crash, then 1 worker (the fallback).
    controlled_wait(monkeypatch, 0.5)
    data = CrashingWorkers(n=512, delay_s=0.002)
    plain, _ = fit([], data, epochs=1)
    callback = tuner(budget_s=30)
    tuned, trainer = fit([callback], data, epochs=1)
    assert tuned.seen == plain.seen  # every sample once, in order, despite the crash
    failed = [t for t in callback.report.trials if t.status == "failed"]
    assert [t.settings["num_workers"] for t in failed] == [2, 1]  # never above a count that failed
    assert all("exited unexpectedly" in t.error for t in failed)
    assert all(t.settings["num_workers"] == 0 for t in callback.report.trials if t.status == "ok")
    assert callback.report.changes == []  # nothing that crashed is kept
    assert psutil.Process().children() == []


def test_compute_bound_runs_keep_their_loader(private_tuning_cache, monkeypatch):
    controlled_wait(monkeypatch, 0.02)  # compute-bound however busy the machine is; the fit itself stays real
    callback = tuner()
    _, trainer = fit([callback], resident_dataset(), epochs=1, batch_size=64,
                     model_kwargs=dict(dim=256, hidden=1024, depth=3))
    report = callback.report
    assert report.changes == [] and len(report.trials) == 1
    assert any("compute-bound" in note for note in report.notes)
    assert trainer.train_dataloader.num_workers == 0
    assert not private_tuning_cache.exists()  # keeping the user's settings is not remembered


class Records(IterableDataset):
    def __init__(self, n=64):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.randn(16), torch.tensor(i)


def test_an_iterable_dataset_is_left_alone_and_yields_each_record_once_per_epoch():
    callback = tuner()
    pl.seed_everything(0, verbose=False)
    model = Regressor()
    trainer = pl.Trainer(max_epochs=2, callbacks=[callback], **quiet_trainer_kwargs())
    with pytest.warns(UserWarning, match="not tuning the loader: the dataset is an IterableDataset"):
        trainer.fit(model, DataLoader(Records(), batch_size=8))
    assert model.seen == list(range(64)) * 2
    assert [s.group for s in callback.report.skipped if s.group == "loader"] == ["loader"]


def test_a_tuned_run_reports_its_changes_and_the_code_to_keep_them():
    # 50 ms of storage latency per sample: loading a batch of 8 takes 0.4 s in the main process and sleeping
    # workers overlap it whatever else the machine runs, so more workers must win and be kept. Growth would go on
    # towards dozens of workers (the wait never vanishes against this tiny step): the budget ends the search, and
    # the fit stops once the after-window has confirmed the choice.
    data = SleepyDataset(n=4096, delay_s=0.05)
    callback = tuner(window=4, budget_s=6, stop_when_tuned=True)
    pl.seed_everything(3, verbose=False)
    trainer = pl.Trainer(max_steps=5000, callbacks=[callback], **quiet_trainer_kwargs())
    trainer.fit(Regressor(), DataLoader(data, batch_size=8, shuffle=True))
    report = callback.report
    assert report.mode == "tune"
    assert not any("ended before loader tuning finished" in n for n in report.notes)
    knobs = {c.knob: c.after for c in report.changes}
    assert knobs["num_workers"] > 0
    assert trainer.train_dataloader.num_workers == knobs["num_workers"]  # kept and applied to the running fit
    assert report.suggestions == [
        "DataLoader(..., " + ", ".join(f"{c.knob}={c.after!r}" for c in report.changes) + ")"
    ]
    assert report.predicted_speedup is not None and report.measured_speedup > 1.5  # loose: ideal is ~4x or more


def test_which_setting_is_kept_follows_the_measurements(monkeypatch):
    # A controlled world: 1 worker is 1.5x the main process, 2 or more are 3x and tie with each other, and every
    # window waits half its step for data (the first pick follows the wait: 2 workers, not the 1 a busy machine's
    # lower wait gave). The search keeps the cheapest of the tied best, applies it to the running fit, and
    # confirms it with an after-window.
    controlled_rates(monkeypatch, lambda s: {0: 100.0, 1: 150.0}.get(s.num_workers, 300.0))
    controlled_wait(monkeypatch, 0.5)
    callback = tuner(budget_s=120, stop_when_tuned=True)
    _, trainer = fit([callback], SleepyDataset(n=512, delay_s=0.002), epochs=50)
    report = callback.report
    assert not any("ended before loader tuning finished" in n for n in report.notes)
    tried = [t.settings["num_workers"] for t in report.trials if t.status == "ok"]
    kept = {c.knob: c.after for c in report.changes}
    assert tried[:2] == [0, 2] and len(tried) > 2  # the user's, the pick, then the refits' larger picks (all tie)
    assert kept["num_workers"] == 2  # the cheapest of the tied best
    assert trainer.train_dataloader.num_workers == kept["num_workers"]
    assert report.measured_speedup is not None


def test_every_rank_plans_workers_for_the_fewest_cpus_any_rank_may_use(monkeypatch):
    """A node's CPUs are shared by its ranks; nodes (or the CPUs each rank is bound to) may differ. Every rank takes
    the fewest any rank has, so the loader search and the cached trials propose the same worker counts on all."""
    monkeypatch.setattr(loader_start, "cpus_available", lambda: 16)
    trainer = SimpleNamespace(num_devices=2)
    assert loader_start.rank_cpus(trainer, lambda values: values) == 8  # one process: its share of the node

    def another_rank_has_three(values):  # the fewest is agreed as the largest of the negated counts
        return [max(values[0], -3.0)]

    assert loader_start.rank_cpus(trainer, another_rank_has_three) == 3
