"""Faults during loader tuning: the run completes (or stops as asked), the user's data is intact, the report says
what happened, and no process or thread is left behind."""

import errno
import os
import signal
import threading
import time

import psutil
import pytest
import pytorch_lightning as pl
from torch.utils.data import DataLoader, get_worker_info

from pipeopt.measure.tap import ProfilerTap
from tests.helpers import Regressor, SleepyDataset, controlled_wait, quiet_pipeopt, quiet_trainer_kwargs

tuner = quiet_pipeopt


def fit(callbacks, dataset, model=None, epochs=1):
    pl.seed_everything(3, verbose=False)
    model = model or Regressor()
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, **quiet_trainer_kwargs())
    trainer.fit(model, DataLoader(dataset, batch_size=8, shuffle=True))
    return model, trainer


@pytest.fixture
def no_leaks():
    before = set(threading.enumerate())  # threads of earlier tests may end meanwhile: only new ones are leaks

    def started_here():
        return [t for t in threading.enumerate() if t not in before]

    yield
    deadline = time.monotonic() + 10
    while (psutil.Process().children() or started_here()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert psutil.Process().children() == []
    assert started_here() == []


def in_worker_of_at_least(n):
    info = get_worker_info()
    return info is not None and info.num_workers >= n


class HangsWithTwoWorkers(SleepyDataset):
    def __getitem__(self, i):
        if in_worker_of_at_least(2):
            time.sleep(600)
        return super().__getitem__(i)


class SharedMemoryFullWithTwoWorkers(SleepyDataset):
    def __getitem__(self, i):
        if in_worker_of_at_least(2):  # what torch raises in a worker when /dev/shm is full
            raise RuntimeError(f"unable to write to file </torch_{os.getpid()}_1_0>: No space left on device (28)")
        return super().__getitem__(i)


class MissingSample(SleepyDataset):
    def __getitem__(self, i):
        if i == 37:
            raise KeyError(f"sample {i} is missing from the store")
        return super().__getitem__(i)


class DiesInAWorker(SleepyDataset):
    """A worker process dies (no exception, no cleanup) on the first item it makes; the main process makes them."""

    def __getitem__(self, i):
        if get_worker_info() is not None:
            os._exit(3)
        return super().__getitem__(i)


class TrialAtTheFirstEpochsEnd(pl.Callback):
    """At the first epoch's last batch: pipeopt's switcher switches to 2 persistent workers, unsettled - a trial the
    next epoch begins on, as the sample cache's first trial or a loader-search trial switched in then is."""

    def __init__(self, pipeopt):
        self.pipeopt = pipeopt

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == trainer.num_training_batches - 1:
            from pipeopt.tuning.loader_search import LoaderSettings

            self.pipeopt._run.switcher.switch(LoaderSettings(2, 2, True, False), timeout_s=10)


def test_a_trial_the_next_epoch_begins_on_falls_back_when_its_workers_die(no_leaks, monkeypatch):
    """Lightning, not a switch, starts the iterator of an epoch that begins on a trial's loader. A worker death in it -
    in the epoch's first batch here, before any hook of the epoch's steps - falls back to the settings before the
    trial (the user's here), as mid-epoch: the fit ends, every sample trained once in order, the weights those of a
    run without pipeopt."""
    import torch

    data = DiesInAWorker(n=128, delay_s=0.0)
    plain, _ = fit([], data, epochs=3)
    controlled_wait(monkeypatch, 0.01)  # compute-bound: the search ends at once and leaves the switcher to the test
    callback = tuner()
    tuned, trainer = fit([callback, TrialAtTheFirstEpochsEnd(callback)], data, epochs=3)
    assert tuned.seen == plain.seen
    for name, value in plain.state_dict().items():
        assert torch.equal(value, tuned.state_dict()[name]), name
    assert trainer.train_dataloader.num_workers == 0  # the user's settings, from the failure on


@pytest.mark.parametrize(
    ("dataset_cls", "error"),
    [(HangsWithTwoWorkers, "timed out"), (SharedMemoryFullWithTwoWorkers, "No space left on device")],
)
def test_a_hanging_or_shm_starved_candidate_is_discarded(no_leaks, room_for_a_trial, dataset_cls, error,
                                                         monkeypatch):
    # The count tried first follows the before-window's wait (tests/tuning/test_loader_search.py pins that rule on
    # synthetic windows): fixed at half of each step, the model picks 2 workers on any machine - which fail here.
    controlled_wait(monkeypatch, 0.5)
    data = dataset_cls(n=1024, delay_s=0.003)
    plain, _ = fit([], SleepyDataset(n=1024, delay_s=0.003))
    callback = tuner(budget_s=30)
    tuned, trainer = fit([callback], data)
    assert tuned.seen == plain.seen
    failed = [t for t in callback.report.trials if t.status == "failed"]
    assert [t.settings["num_workers"] for t in failed] == [2]
    assert all(error in t.error for t in failed)
    assert all(t.settings["num_workers"] < 2 for t in callback.report.trials if t.status == "ok")
    assert trainer.train_dataloader.num_workers < 2


def test_the_users_dataset_error_surfaces_unchanged(no_leaks):
    callback = tuner()
    with pytest.raises(KeyError, match="sample 37 is missing from the store"):
        fit([callback], MissingSample(n=256, delay_s=0.003))


def test_keyboard_interrupt_during_tuning_stops_cleanly(no_leaks, room_for_a_trial):
    interrupted_in = []

    class Interrupted(Regressor):
        def training_step(self, batch, batch_idx):  # the first batch of a loader trial, whatever the machine's pace
            session = callback._run.session if callback._run is not None else None
            if session is not None and session.state == "trial":
                interrupted_in.append(session.state)
                raise KeyboardInterrupt
            return super().training_step(batch, batch_idx)

    callback = tuner()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=1, callbacks=[callback], **quiet_trainer_kwargs())
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown exits after tearing down
            trainer.fit(Interrupted(), DataLoader(SleepyDataset(n=512, delay_s=0.003), batch_size=8))
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores SIGINT after one
    assert interrupted_in == ["trial"]  # it was tuning
    assert not isinstance(trainer.profiler, ProfilerTap)


def test_a_full_disk_for_the_report_warns_and_training_goes_on(tmp_path, monkeypatch):
    import pipeopt.files as files

    real_fdopen = files.os.fdopen

    class Full:
        """A file on a full disk: opening works, writing fails."""

        def __init__(self, fd, *args, **kwargs):
            self._file = real_fdopen(fd, *args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._file.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fdopen", Full)
    callback = tuner(tune=(), report_dir=tmp_path)
    with pytest.warns(UserWarning, match="could not write its report.*No space left on device"):
        _, trainer = fit([callback], SleepyDataset(n=96, delay_s=0.0))
    assert trainer.state.finished and list(tmp_path.iterdir()) == []


def test_a_fit_that_fails_after_tuning_gives_the_trainer_back_its_own_loader_and_accumulation(monkeypatch):
    """The user's own exception ends the fit unchanged; the trainer keeps no loader or plan of pipeopt's."""
    from pipeopt.tuning.batch import BatchPlan
    from tests.helpers import Regressor, controlled_rates

    class Boom(Regressor):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 24:  # of 32 (2 epochs of 16 steps), after the decision
                self.accumulating = self.trainer.accumulate_grad_batches
                raise ZeroDivisionError("user bug")
            return super().training_step(batch, batch_idx)

    # A fold of the user's 8 x 4 into 32 x 1 measures faster: kept, then the user's step fails.
    controlled_rates(monkeypatch, lambda tried: 300.0 if tried == BatchPlan(32, 1) else 100.0)
    callback = tuner(tune=("batch",))
    loader = DataLoader(SleepyDataset(n=512, delay_s=0.0), batch_size=8)
    trainer = pl.Trainer(max_epochs=2, accumulate_grad_batches=4, callbacks=[callback], **quiet_trainer_kwargs())
    model = Boom(hidden=16)
    with pytest.raises(ZeroDivisionError, match="user bug"):
        trainer.fit(model, loader)
    assert model.accumulating == 1  # the fold was kept and applied when the step failed
    assert trainer.train_dataloader is loader and trainer.accumulate_grad_batches == 4
