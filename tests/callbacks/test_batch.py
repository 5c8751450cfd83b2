"""Micro-batch x accumulation in real fits on CPU, with an injected device-memory probe."""

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

import pipeopt.apply.batch as batch_apply
from tests.helpers import (
    Regressor,
    SamplesPerStep,
    SleepyDataset,
    StateAtTrainEnd,
    TightMemory,
    quiet_pipeopt,
    quiet_trainer_kwargs,
)


def _fit(callbacks, batchnorm=False):
    pl.seed_everything(3, verbose=False)
    model = Regressor(hidden=16, batchnorm=batchnorm)
    loader = DataLoader(SleepyDataset(n=256, delay_s=0.0), batch_size=32, shuffle=True)
    trainer = pl.Trainer(max_epochs=2, callbacks=callbacks, **quiet_trainer_kwargs())
    trainer.fit(model, loader)
    return model, trainer


def test_a_batch_that_does_not_fit_trains_as_accumulated_micro_batches(monkeypatch):
    plain, _ = _fit([])
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory())
    counter, callback = SamplesPerStep(), quiet_pipeopt(tune=("batch",))
    state = StateAtTrainEnd(callback)
    model, trainer = _fit([counter, callback, state])
    assert trainer.accumulate_grad_batches == 4 and trainer.train_dataloader.batch_size is None  # 8 x 4
    assert counter.per_step == [32] * 16  # the user's effective batch at every optimizer step, as many steps
    assert model.seen[-len(plain.seen):] == plain.seen  # the same samples in the same order (after the probes)
    for name, value in plain.state_dict().items():  # the same gradients, summed in another order
        assert torch.allclose(value, model.state_dict()[name], atol=1e-5), name
    changes = {c.knob: (c.before, c.after) for c in callback.report.changes}
    assert changes == {"batch_size": (32, 8), "accumulate_grad_batches": (1, 4)}
    assert any("does not fit" in c.reason for c in callback.report.changes)
    assert state.state["tuned"]["batch"] == {"micro": 8, "accumulate": 4}


def test_an_out_of_memory_probe_backs_off_and_training_goes_on(monkeypatch):
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory(oom_above=4))
    counter, callback = SamplesPerStep(), quiet_pipeopt(tune=("batch",))
    _, trainer = _fit([counter, callback])
    assert trainer.accumulate_grad_batches == 8 and counter.per_step == [32] * 16
    assert any("out of memory" in n for n in callback.report.notes)


def test_a_batch_norm_model_keeps_its_micro_batch_when_it_fits(monkeypatch):
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory(budget=10**9))
    callback = quiet_pipeopt(tune=("batch",))
    _, trainer = _fit([callback], batchnorm=True)
    assert trainer.accumulate_grad_batches == 1
    assert any("batch norm" in n for n in callback.report.notes)


def test_loader_trials_mid_epoch_keep_the_micro_batches_and_the_order(monkeypatch):
    def fit(callbacks):
        pl.seed_everything(3, verbose=False)
        model = Regressor(hidden=16)
        loader = DataLoader(SleepyDataset(n=512, delay_s=0.002), batch_size=32, shuffle=True)
        trainer = pl.Trainer(max_epochs=2, callbacks=callbacks, **quiet_trainer_kwargs())
        trainer.fit(model, loader)
        return model, trainer

    plain, _ = fit([])
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory())
    counter, callback = SamplesPerStep(), quiet_pipeopt(tune=("batch", "loader"))
    model, trainer = fit([counter, callback])
    before = callback.windows[0]
    assert before.label == "before" and before.first_step + before.steps < 16  # the first trial's switch came
    assert any(w.label.startswith("trial") for w in callback.windows)  # inside the first, re-cut, epoch
    assert trainer.accumulate_grad_batches == 4 and counter.per_step == [32] * 32
    assert model.seen[-len(plain.seen):] == plain.seen


class SkipsOddBatches(Regressor):
    def training_step(self, batch, batch_idx):
        self.calls = getattr(self, "calls", 0) + 1
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


class IteratorStep(Regressor):
    def training_step(self, dataloader_iter):
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


class OwnTransfer(Regressor):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch


class NeedsClosure(torch.optim.SGD):
    def step(self, closure):
        return super().step(closure)


class ClosureOnly(Regressor):
    def configure_optimizers(self):
        return NeedsClosure(self.parameters(), lr=0.01)


@pytest.mark.parametrize(("model", "trainer_kwargs", "reason"), [
    (SkipsOddBatches(hidden=16), {}, "returned no loss tensor for a probe batch"),
    (IteratorStep(hidden=16), {}, "takes the dataloader iterator"),
    (ClosureOnly(hidden=16), {}, "steps only with a closure"),
    (OwnTransfer(hidden=16), {}, "own hooks (OwnTransfer.on_after_batch_transfer)"),
    (Regressor(hidden=16), {"fast_dev_run": 3}, "fast_dev_run"),
    (Regressor(hidden=16), {"overfit_batches": 2}, "overfit_batches"),
    (Regressor(hidden=16), {"limit_train_batches": 1}, "limit_train_batches is set"),  # 1 batch, not 100 %
    (Regressor(hidden=16), {"val_check_interval": "00:00:00:01"}, "counts batches or time"),
], ids=["none-returning-step", "dataloader-iter-step", "closure-only-optimizer", "own-transfer-hooks", "fast-dev-run", "overfit-batches",
        "one-batch-per-epoch", "time-based-validation"])
def test_a_valid_program_the_batch_group_cannot_plan_is_left_alone_and_finishes(model, trainer_kwargs, reason,
                                                                              monkeypatch):
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory())  # the user's batch "does not fit": a plan would apply
    callback = quiet_pipeopt(tune=("batch",))
    pl.seed_everything(0, verbose=False)
    kwargs = {"max_epochs": 1, **trainer_kwargs}
    trainer = pl.Trainer(callbacks=[callback], **quiet_trainer_kwargs(**kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(SleepyDataset(n=64, delay_s=0.0), batch_size=32))
    assert trainer.state.finished
    assert any(s.group == "batch" and reason in s.reason for s in callback.report.skipped)
    assert trainer.accumulate_grad_batches == 1


def test_a_custom_collate_fn_is_never_called_outside_training(monkeypatch):
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory())
    calls = []

    def collate(samples):
        calls.append(len(samples))
        return torch.utils.data.default_collate(samples)

    callback = quiet_pipeopt(tune=("batch",))
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=1, callbacks=[callback], **quiet_trainer_kwargs())
    trainer.fit(Regressor(hidden=16), DataLoader(SleepyDataset(n=64, delay_s=0.0), batch_size=32, collate_fn=collate))
    assert calls == [32, 32]  # the two batches trained, nothing else
    assert any(s.group == "batch" and "its own collate_fn" in s.reason for s in callback.report.skipped)
