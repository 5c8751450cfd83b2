"""Micro-batch x accumulation tried on the live run, in real fits on CPU: an injected device memory
(``pipeopt.apply.batch.MEMORY``) or controlled rates decide what is kept; the fit, its data and its order are real.
Whatever is tried, every optimizer step sees the user's effective batch, every sample is trained once per epoch in
the user's order, and ``training_step`` runs once per trained micro-batch."""

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

import pipeopt.apply.batch as batch_apply
from pipeopt.tuning.batch import BatchPlan
from tests.helpers import (
    Regressor,
    SamplesPerStep,
    SleepyDataset,
    StateAtTrainEnd,
    TightMemory,
    controlled_rates,
    quiet_pipeopt,
    quiet_trainer_kwargs,
)


def _fit(callbacks, *, batchnorm=False, batch_size=32, accumulate=1, n=256, epochs=2, delay_s=0.0, model=None,
         **loader_kwargs):
    pl.seed_everything(3, verbose=False)
    model = model or Regressor(hidden=16, batchnorm=batchnorm)
    loader = DataLoader(SleepyDataset(n=n, delay_s=delay_s), batch_size=batch_size, shuffle=True, **loader_kwargs)
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, accumulate_grad_batches=accumulate,
                         **quiet_trainer_kwargs())
    trainer.fit(model, loader)
    return model, trainer


def _same_training(model, plain):
    assert model.seen == plain.seen  # every sample once, in the same order: nothing trained twice or skipped
    for name, value in plain.state_dict().items():  # the same gradients, summed in another order
        assert torch.allclose(value, model.state_dict()[name], atol=1e-5), name


def test_a_batch_over_the_memory_budget_moves_to_accumulated_micro_batches_on_the_live_run(monkeypatch):
    plain, _ = _fit([])
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory())  # 100 bytes a sample, 1000 to spend: 32 is over
    counter, callback = SamplesPerStep(), quiet_pipeopt(tune=("batch",))
    state = StateAtTrainEnd(callback)
    model, trainer = _fit([counter, callback, state])
    assert trainer.accumulate_grad_batches == 4 and trainer.train_dataloader.batch_size == 8  # 8 x 4
    assert counter.per_step == [32] * 16  # the user's effective batch at every optimizer step, as many steps
    _same_training(model, plain)
    labels = [w.label for w in callback.windows]
    assert "batch: micro-batch 32 x accumulate 1" in labels and "batch trial: micro-batch 8 x accumulate 4" in labels
    changes = {c.knob: (c.before, c.after) for c in callback.report.changes}
    assert changes == {"batch_size": (32, 8), "accumulate_grad_batches": (1, 4)}
    assert any("largest micro-batch that fits" in c.reason for c in callback.report.changes)
    assert state.state["tuned"]["batch"] == {"micro": 8, "accumulate": 4}
    assert model.calls == trainer.fit_loop.total_batch_idx + 1  # one call per trained micro-batch


@pytest.mark.parametrize("faster", [True, False])
def test_an_accumulating_plan_is_folded_only_when_its_live_window_is_faster(faster, monkeypatch):
    plain, _ = _fit([], batch_size=8, accumulate=4, epochs=3)  # room for a window before, a trial and one after
    controlled_rates(monkeypatch, lambda plan: 300.0 if faster and plan == BatchPlan(32, 1) else 100.0)
    counter, callback = SamplesPerStep(), quiet_pipeopt(tune=("batch",))
    model, trainer = _fit([counter, callback], batch_size=8, accumulate=4, epochs=3)
    assert any(w.label == "batch trial: micro-batch 32 x accumulate 1" for w in callback.windows)
    assert trainer.accumulate_grad_batches == (1 if faster else 4)
    assert counter.per_step == [32] * 24
    _same_training(model, plain)
    assert bool(callback.report.changes) is faster
    if faster:  # the fold's trial predicted 3x; the window after the change measured it
        (size, _) = callback.report.changes
        assert (size.predicted_speedup, size.measured_speedup) == (pytest.approx(3.0), pytest.approx(3.0))


def test_a_fold_whose_after_window_is_not_faster_goes_back_to_the_users_plan(monkeypatch):
    plain, _ = _fit([], batch_size=8, accumulate=4, epochs=3)
    seen = {"fold": 0}

    def rate(plan):  # the fold is fast in its trial window, then no faster than the user's plan after the change
        if plan != BatchPlan(32, 1):
            return 100.0
        seen["fold"] += 1
        return 300.0 if seen["fold"] == 1 else 101.0

    controlled_rates(monkeypatch, rate)
    counter, callback = SamplesPerStep(), quiet_pipeopt(tune=("batch",))
    model, trainer = _fit([counter, callback], batch_size=8, accumulate=4, epochs=3)
    assert trainer.accumulate_grad_batches == 4 and callback.report.changes == []
    assert any(n.startswith("batch: rolled back micro-batch 32 x accumulate 1: its after-window measured 101.0 "
                            "samples/s") for n in callback.report.notes)
    assert counter.per_step == [32] * 24  # every optimizer step still saw the user's effective batch
    _same_training(model, plain)


def test_a_plan_tried_mid_epoch_with_the_loader_tuned_first_keeps_the_order(monkeypatch, room_for_a_trial):
    plain, _ = _fit([], n=512, delay_s=0.002, epochs=5)
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory())
    # room for a loader trial in this 80-step fit whatever the machine's pace: windows of `window` steps and at most
    # 4 workers (room_for_a_trial): a trial and its after-windows then need at most 1 + 9 + 9 + 2 x 9 of the 74
    # steps left after the before-window
    counter, callback = SamplesPerStep(), quiet_pipeopt(tune=("batch", "loader"), budget_s=0.5, window_s=0)
    model, trainer = _fit([counter, callback], n=512, delay_s=0.002, epochs=5)
    labels = [w.label for w in callback.windows]
    assert any(label.startswith("trial") for label in labels)  # the loader was tried, then the plan
    assert "batch trial: micro-batch 8 x accumulate 4" in labels and trainer.accumulate_grad_batches == 4
    assert counter.per_step == [32] * 80
    _same_training(model, plain)


def test_a_batch_norm_model_keeps_its_micro_batch_when_it_fits(monkeypatch):
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory(budget=10**9))
    callback = quiet_pipeopt(tune=("batch",))
    _, trainer = _fit([callback], batchnorm=True, batch_size=8, accumulate=4)
    assert trainer.accumulate_grad_batches == 4
    assert any("batch norm" in n for n in callback.report.notes)


class SkipsOddBatches(Regressor):
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


def test_a_step_that_skips_batches_keeps_the_users_plan(monkeypatch):
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory())
    callback = quiet_pipeopt(tune=("batch",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, trainer = _fit([callback], model=SkipsOddBatches(hidden=16))
    assert trainer.accumulate_grad_batches == 1 and not callback.report.changes
    assert any("no loss for some batches" in n for n in callback.report.notes)
    assert model.calls == 8 * 2 // 2  # the batches it trained, half of 8 a epoch (the rest returned None)


class IteratorStep(Regressor):
    def training_step(self, dataloader_iter):
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


class NeedsClosure(torch.optim.SGD):
    def step(self, closure):
        return super().step(closure)


class ClosureOnly(Regressor):
    def configure_optimizers(self):
        return NeedsClosure(self.parameters(), lr=0.01)


@pytest.mark.parametrize(("model", "trainer_kwargs", "reason"), [
    (IteratorStep(hidden=16), {}, "takes the dataloader iterator"),
    (ClosureOnly(hidden=16), {}, "steps only with a closure"),
    (Regressor(hidden=16), {"fast_dev_run": 3}, "fast_dev_run"),
    (Regressor(hidden=16), {"overfit_batches": 2}, "overfit_batches"),
    (Regressor(hidden=16), {"limit_train_batches": 1}, "limit_train_batches is set"),  # 1 batch, not 100 %
    (Regressor(hidden=16), {"val_check_interval": "00:00:00:01"}, "val_check_interval"),
    (Regressor(hidden=16), {"val_check_interval": 0.5}, "val_check_interval"),
], ids=["dataloader-iter-step", "closure-only-optimizer", "fast-dev-run", "overfit-batches",
        "one-batch-per-epoch", "time-based-validation", "validation-mid-epoch"])
def test_a_valid_program_the_batch_group_cannot_plan_is_left_alone_and_finishes(model, trainer_kwargs, reason,
                                                                              monkeypatch):
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory())  # the user's batch is over budget: a plan would apply
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


def test_a_custom_collate_fn_runs_only_for_trained_batches_and_its_batches_are_only_split(monkeypatch):
    calls = []

    def collate(samples):
        calls.append(len(samples))
        return torch.utils.data.default_collate(samples)

    controlled_rates(monkeypatch, lambda plan: 300.0 if plan.micro == 32 else 100.0)  # a fold would be kept
    callback = quiet_pipeopt(tune=("batch",))
    model, trainer = _fit([callback], batch_size=8, accumulate=4, collate_fn=collate)
    assert calls == [8] * 64  # the batches trained (32 an epoch, 2 epochs), nothing else
    assert trainer.accumulate_grad_batches == 4 and len(model.seen) == 512
    assert any("its own collate_fn" in n for n in callback.report.notes)


def test_an_epoch_whose_last_step_is_short_keeps_the_users_plan(monkeypatch):
    """72 samples in batches of 32: the last step holds 8, and Lightning divides its loss by the accumulation - a
    split of it into micro-batches would weigh those 8 samples differently."""
    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory())  # over budget: a split would otherwise be tried
    plain, _ = _fit([], n=72)
    callback = quiet_pipeopt(tune=("batch",))
    model, trainer = _fit([callback], n=72)
    assert trainer.accumulate_grad_batches == 1
    assert any(s.group == "batch" and "not whole optimizer steps of 32" in s.reason for s in callback.report.skipped)
    assert model.seen == plain.seen
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())


@pytest.mark.parametrize("tune", [(), ("loader", "precision"), ("batch",)])
def test_cuda_peak_memory_statistics_are_reset_only_for_the_batch_plans_windows(tune, monkeypatch):
    """``torch.cuda.max_memory_allocated`` is the user's too (their own logging, a ``DeviceStatsMonitor``): pipeopt
    resets it only where a window's own peak decides a batch plan - the user's plan, each trial, the window after
    the decision - and leaves it alone in a fit that does not tune the batch, and once the plan is decided."""
    import pipeopt.measure.resources as resources

    monkeypatch.setattr(batch_apply, "MEMORY", TightMemory())  # the batch plan's windows run on CPU
    callback, resets = quiet_pipeopt(tune=tune), []
    monkeypatch.setattr(resources, "reset_peak_memory",
                        lambda device: resets.append(callback._instruments.meter.steps_seen))
    _fit([callback], epochs=4)
    if "batch" not in tune:
        assert resets == [] and callback.windows  # measured all along, without touching the statistics
        return
    plan = [w for w in callback.windows if w.label.startswith("batch")]
    assert [w.label for w in plan] == ["batch: micro-batch 32 x accumulate 1",
                                       "batch trial: micro-batch 8 x accumulate 4"]
    verify = next(w for w in callback.windows if w.label == "after")  # the window that verifies the split
    assert all(w.first_step in resets for w in [*plan, verify])  # each read its own peak, not an earlier plan's
    later = [w for w in callback.windows if w.first_step > max(resets)]
    assert len(later) >= 2 and {w.label for w in later} == {"after"}  # then the statistics were left alone
