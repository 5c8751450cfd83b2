"""The sample cache on real, tiny Lightning fits: the same samples in the same order, final weights bit-identical to a
run without pipeopt, items taken from the store once it is warm, random datasets refused, the store removed."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import psutil
import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, default_collate

from pipeopt import PipeOpt, _dataloader, _lightning
from pipeopt.callbacks import cache_start
from tests.helpers import (
    Regressor,
    SleepyDataset,
    controlled_cpu_room,
    controlled_rates,
    controlled_wait,
    quiet_pipeopt,
    quiet_trainer_kwargs,
)


class CountingDataset(SleepyDataset):
    """Storage-bound items (1 ms each), counting how many were made in this process."""

    made = 0

    def __getitem__(self, i: int):
        CountingDataset.made += 1
        return super().__getitem__(i)


class RandomItems(SleepyDataset):
    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return x + torch.rand(self.dim), y


def fit(callbacks, dataset, *, epochs=5, seed=3, collate_fn=None, **loader):
    pl.seed_everything(seed, verbose=False)
    model = Regressor(hidden=32, dropout=0.5, batchnorm=True)
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, **quiet_trainer_kwargs())
    trainer.fit(model, DataLoader(dataset, batch_size=8, shuffle=True, collate_fn=collate_fn, **loader))
    return model, trainer


class Collates(pl.Callback):
    """The collate function of the train loader each epoch ended with."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.seen.append(_lightning.train_combined_loader(trainer).flattened[0].collate_fn)


def users_collate(batch):
    return default_collate(batch)


def _cached_faster(monkeypatch):
    # The decisions in a controlled world (reading from the store 3x faster); the fit, its data and order are real.
    controlled_rates(monkeypatch, lambda settings: 300.0 if getattr(settings, "cache", False) else 100.0)


@pytest.mark.parametrize("collate_fn", [None, users_collate], ids=["torch's collate", "the user's collate"])
def test_a_kept_cache_serves_items_from_the_store_and_the_weights_are_bit_identical(monkeypatch, tmp_path,
                                                                                     collate_fn):
    data = CountingDataset(n=128, delay_s=0.001)
    CountingDataset.made = 0
    plain, _ = fit([], data, collate_fn=collate_fn)
    made_plain, plain_rng = CountingDataset.made, torch.get_rng_state()
    _cached_faster(monkeypatch)
    CountingDataset.made = 0
    callback, collates = quiet_pipeopt(tune=("cache",), report_dir=tmp_path, cache=False), Collates()
    tuned, _ = fit([callback, collates], data, collate_fn=collate_fn)
    # whole items are read a batch at a time only where torch's collate made the user's batches
    assert collates.seen[-1] is (_dataloader.collate_rows if collate_fn is None else users_collate)
    report = callback.report
    assert [c.knob for c in report.changes] == ["cache"]
    assert tuned.seen == plain.seen
    for name, value in plain.state_dict().items():
        assert torch.equal(value, tuned.state_dict()[name]), name
    assert torch.equal(torch.get_rng_state(), plain_rng)  # the determinism check put the generators back
    figures = report.sample_cache
    assert figures is not None and figures.kept and figures.stored == 128 and figures.fill_s > 0
    # not tried in the epoch that made the store (16 steps): the samples still to come there are not in it
    assert min(w.first_step for w in report.timeline if w.label.startswith("cache trial")) >= 16
    reading = [row for row in figures.epochs if row["reading"]]
    assert reading and reading[-1]["hit_rate"] == 1.0 and reading[-1]["misses"] == 0
    # samples trained with settings that read the store: every one of an epoch read throughout, none of the first
    assert all(row["read"] == row["samples"] for row in reading) and figures.epochs[0]["read"] == 0
    # every item made at most once by the fill, plus the determinism check's six: the reading epochs made none
    assert CountingDataset.made < made_plain
    assert not Path(figures.directory).exists()  # the store is removed at fit end
    assert psutil.Process().children() == []


def test_a_cache_that_is_not_faster_is_given_back_and_kept_stores_stay(monkeypatch, tmp_path):
    controlled_rates(monkeypatch, lambda settings: 100.0)
    data = SleepyDataset(n=128, delay_s=0.001)
    plain, _ = fit([], data, epochs=4)
    callback = quiet_pipeopt(tune=("cache",), report_dir=tmp_path, cache=False, keep_sample_cache=True)
    tuned, _ = fit([callback], data, epochs=4)
    assert callback.report.changes == [] and tuned.seen == plain.seen
    assert any("sample cache not kept" in n for n in callback.report.notes)
    # the epochs say what they did: the store read while the trial ran, and not once it was given back
    rows = callback.report.sample_cache.epochs
    assert any(row["read"] for row in rows) and rows[-1]["read"] == 0
    assert all(row["read"] <= row["samples"] for row in rows)
    kept = list((tmp_path / "sample-cache").iterdir())
    assert len(kept) == 1 and (kept[0] / "index").exists()


@pytest.mark.parametrize("case", ["room", "no room", "kept"])
def test_a_store_removed_at_fit_end_lives_in_shared_memory_when_it_has_room_else_under_the_report_dir(
        monkeypatch, tmp_path, case):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(cache_start, "SHARED_MEMORY", shm)
    monkeypatch.setattr(cache_start, "_ram_backed", lambda path: path == shm)
    # the room asked for beside the budget: none, or more than the (stand-in) file system has free
    monkeypatch.setattr(cache_start, "SHARED_MEMORY_SPARE", shutil.disk_usage(shm).free + 1 if case == "no room" else 0)
    _cached_faster(monkeypatch)
    callback = quiet_pipeopt(tune=("cache",), report_dir=tmp_path / "reports", cache=False, sample_cache_share=0.001,
                             keep_sample_cache=case == "kept")  # a budget of 0.1 % of free memory fits any machine
    fit([callback], SleepyDataset(n=128, delay_s=0.001), epochs=4)
    figures = callback.report.sample_cache
    assert figures is not None and figures.kept and figures.stored == 128
    where = Path(figures.directory).parent
    assert where == (shm / "pipeopt-sample-cache" if case == "room" else tmp_path / "reports" / "sample-cache")
    assert Path(figures.directory).exists() == (case == "kept")


def test_a_random_dataset_is_refused_with_the_reason_and_trains_as_without_pipeopt():
    data = RandomItems(n=64, delay_s=0.0)
    plain, _ = fit([], data, epochs=2)
    callback = quiet_pipeopt(tune=("cache",))
    tuned, _ = fit([callback], data, epochs=2)
    skipped = {s.group: s.reason for s in callback.report.skipped}
    assert "draws from a global random generator" in skipped["cache"]
    for name, value in plain.state_dict().items():
        assert torch.equal(value, tuned.state_dict()[name]), name


def test_a_fit_of_one_epoch_does_not_build_a_cache():
    callback = quiet_pipeopt(tune=("cache",))
    fit([callback], SleepyDataset(n=256, delay_s=0.0), epochs=1)
    skipped = {s.group: s.reason for s in callback.report.skipped}
    assert "from the second epoch" in skipped["cache"] and callback.report.sample_cache is None


def test_bad_sample_cache_options_name_the_argument():
    with pytest.raises(ValueError, match="sample_cache_share"):
        PipeOpt(sample_cache_share=0)
    with pytest.raises(ValueError, match="keep_sample_cache"):
        PipeOpt(keep_sample_cache="yes")


def test_a_run_the_loader_does_not_limit_never_has_its_dataset_called_outside_training(monkeypatch):
    # The judgement in a controlled world (the loop waits for data 2 % of each step, however busy the machine is:
    # a busy one once read 10 % and tried a loader); the fit, its data and what the dataset is asked stay real.
    controlled_wait(monkeypatch, 0.02)

    def heavy_fit(callbacks):
        pl.seed_everything(3, verbose=False)
        model = Regressor(hidden=1024, depth=6)  # a step of ~10 ms of compute against microseconds of loading
        trainer = pl.Trainer(max_epochs=3, callbacks=callbacks, **quiet_trainer_kwargs())
        trainer.fit(model, DataLoader(CountingDataset(n=192, delay_s=0.0), batch_size=8))

    CountingDataset.made = 0
    heavy_fit([])
    plain, CountingDataset.made = CountingDataset.made, 0
    callback = quiet_pipeopt(tune=("loader", "cache"))
    heavy_fit([callback])
    assert callback.report.trials[1:] == [] and any("compute-bound" in n for n in callback.report.notes)
    assert CountingDataset.made == plain  # no determinism check, no store: the dataset saw only training
    assert callback.report.sample_cache is None


def test_the_store_is_warm_at_its_share_of_what_pipeopts_loaders_could_fill():
    """The samples the first epoch drew before the store existed (the user's own loader made them) are not held
    against it: a store holding 80 % of the rest is warm; a full budget is warm whatever it holds."""
    from pipeopt.apply.sample_store import StoreStats
    from pipeopt.callbacks.cache_start import holds_epoch

    def stats(stored, unstored=0):
        return StoreStats(stored=stored, length=4096, bytes_used=0, budget_bytes=1, fill_s=0.0, unstored=unstored)

    assert not holds_epoch(stats(3264), 4096, 0)  # 79.7 % of an epoch
    assert holds_epoch(stats(3264), 4096, 832)  # all 3,264 the filling loaders could make
    assert not holds_epoch(stats(2000), 4096, 832)
    assert holds_epoch(stats(100, unstored=5), 4096, 0) and not holds_epoch(None, 4096, 0)


def test_the_loader_search_ends_in_time_for_a_store_of_whole_items_to_be_made_and_read_from_the_next_epoch():
    """The steps until the store is read - the rest of the epoch that makes it, less the steps the loader would take
    to draw what it misses of what the epoch drew (the user's own loader made those: they are made ahead once the
    cache's session begins) - bound the loader search's windows only while the store is made in this epoch and its
    budget holds an epoch at the bytes an item took so far."""
    from types import SimpleNamespace

    from pipeopt.apply.sample_store import StoreStats
    from pipeopt.callbacks.cache_start import steps_to_read

    progress = SimpleNamespace(current=SimpleNamespace(ready=90))  # 90 batches of 32 drawn: 2,880 samples
    trainer = SimpleNamespace(current_epoch=0, num_training_batches=128, accumulate_grad_batches=1,
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))

    def cache(stored, item_bytes=1000, unstored=0):
        stats = StoreStats(stored=stored, length=4096, bytes_used=stored * item_bytes, budget_bytes=4096 * 1000,
                           fill_s=0.0, unstored=unstored)
        return SimpleNamespace(store=SimpleNamespace(stats=lambda: stats))

    assert steps_to_read(trainer, cache(2880), 0, 4096, 32) == 38  # the 128 - 90 steps left of the making epoch
    assert steps_to_read(trainer, cache(2560), 0, 4096, 32) == 28  # 320 missing: 10 steps' worth to make them
    assert steps_to_read(trainer, cache(1000), 0, 4096, 32) == 0  # more missing than the epoch has steps left
    assert steps_to_read(trainer, None, 0, 4096, 32) is None  # no store yet
    assert steps_to_read(trainer, cache(2880), -1, 4096, 32) is None  # kept warm by an earlier run
    assert steps_to_read(trainer, cache(2880, item_bytes=1001), 0, 4096, 32) is None  # an epoch would not fit
    assert steps_to_read(trainer, cache(2880, unstored=1), 0, 4096, 32) is None  # the budget is spent
    trainer.current_epoch = 1
    assert steps_to_read(trainer, cache(4096), 0, 4096, 32) == 0  # past the making epoch: read it now


class WhereMade(SleepyDataset):
    """Storage-bound items, recording the training step at which each was made in this process (the main one:
    worker processes record into their own copies)."""

    step = -1
    made_at: list[int] = []

    def __getitem__(self, i: int):
        WhereMade.made_at.append(WhereMade.step)
        return super().__getitem__(i)


class _Steps(pl.Callback):
    def on_train_batch_start(self, trainer, *args):
        WhereMade.step = trainer.global_step


def test_the_samples_drawn_before_the_store_existed_are_made_ahead_and_cached_trials_make_none(monkeypatch, tmp_path):
    """The user's loader drew the fit's first batches before the store existed; the cache's first trial, reading in
    the main process, would make each of those in line with the step. They are made ahead in worker processes, and
    the weights stay those of a run without pipeopt."""
    data = WhereMade(n=128, delay_s=0.002)
    plain, _ = fit([], data)
    _cached_faster(monkeypatch)
    WhereMade.made_at = []
    callback = quiet_pipeopt(tune=("cache",), report_dir=tmp_path, cache=False)
    tuned, _ = fit([callback, _Steps()], data)
    report = callback.report
    first_trial = min(w.first_step for w in report.timeline if w.label.startswith("cache trial"))
    assert [step for step in WhereMade.made_at if step >= first_trial] == []  # all from the store
    made_ahead = [n for n in report.notes if "made ahead" in n]
    assert len(made_ahead) == 1 and "in 1 worker process" in made_ahead[0], report.notes
    assert "samples drawn before the store existed were made ahead of the cache's trials, beside the rest of the " \
           "epoch that made the store, in 1 worker process(es)" in made_ahead[0]  # (its order read ahead)
    assert [c.knob for c in report.changes] == ["cache"] and tuned.seen == plain.seen
    for name, value in plain.state_dict().items():
        assert torch.equal(value, tuned.state_dict()[name]), name
    assert psutil.Process().children() == []


class _StoreCompleteAtEpochEnd(pl.Callback):
    """At the last batch of the fit's first epoch: waits (30 s at most) until the store holds every sample and
    nothing is being made ahead any more, so that the store is complete when that epoch ends."""

    def __init__(self, pipeopt: PipeOpt, samples: int) -> None:
        self.pipeopt, self.samples = pipeopt, samples

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == trainer.num_training_batches - 1:
            run, deadline = self.pipeopt._run, time.monotonic() + 30
            while time.monotonic() < deadline and (run.sample_cache._making_ahead()
                                                   or run.switcher.cache.store.stats().stored < self.samples):
                time.sleep(0.01)


def test_a_store_complete_when_its_epoch_ends_is_read_from_the_next_epochs_first_batch(monkeypatch, tmp_path):
    """The store is made in the first epoch; where it holds every sample when that epoch ends, the first cached trial
    starts with the next epoch: its first batch is read from the store, not made by the loader in place."""
    data = WhereMade(n=128, delay_s=0.002)
    plain, _ = fit([], data)
    _cached_faster(monkeypatch)
    WhereMade.step, WhereMade.made_at = -1, []  # (a step left by an earlier fit would read as this one's)
    callback = quiet_pipeopt(tune=("cache",), report_dir=tmp_path, cache=False)
    tuned, trainer = fit([callback, _Steps(), _StoreCompleteAtEpochEnd(callback, len(data))], data)
    report = callback.report
    # a batch is fetched a step ahead of its own: the next epoch's first at the last step of this one (15)
    assert [step for step in WhereMade.made_at if step >= trainer.num_training_batches - 1] == []
    assert [c.knob for c in report.changes] == ["cache"] and tuned.seen == plain.seen
    for name, value in plain.state_dict().items():
        assert torch.equal(value, tuned.state_dict()[name]), name
    assert psutil.Process().children() == []


class UsersSampler(torch.utils.data.Sampler[int]):
    """A sampler of the user's own: a shuffle of its own each epoch, recording the training step at which it gave
    each index - it could decide its order as it goes, so pipeopt must not ask it for an index ahead of time."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.given_at = n, 0, list[tuple[int, int]]()  # (epoch, step) for each index given

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        for i in torch.randperm(self.n, generator=torch.Generator().manual_seed(epoch)).tolist():
            self.given_at.append((epoch, WhereMade.step))
            yield i

    def __len__(self) -> int:
        return self.n


def test_a_users_sampler_is_never_read_ahead_and_what_the_store_misses_is_made_at_the_next_epochs_start(
        monkeypatch, tmp_path):
    """Where the epoch's order is the user's to decide, the samples drawn before the store existed are not known
    until the epoch ends: they are made at the next epoch's start, and the sampler is asked for each index when a
    DataLoader without pipeopt would ask (a batch or two ahead of its step), never at once."""
    data = WhereMade(n=128, delay_s=0.002)

    def users_fit(callbacks):
        pl.seed_everything(3, verbose=False)
        model, sampler = Regressor(hidden=32), UsersSampler(len(data))
        trainer = pl.Trainer(max_epochs=4, callbacks=[*callbacks, _Steps()], **quiet_trainer_kwargs())
        trainer.fit(model, DataLoader(data, batch_size=8, sampler=sampler))
        return model, sampler

    plain, _ = users_fit([])
    _cached_faster(monkeypatch)
    callback = quiet_pipeopt(tune=("cache",), report_dir=tmp_path, cache=False)
    tuned, sampler = users_fit([callback])
    made_ahead = [n for n in callback.report.notes if "made ahead" in n]
    assert len(made_ahead) == 1 and made_ahead[0].split(" were made")[0].endswith("samples the store missed")
    assert [c.knob for c in callback.report.changes] == ["cache"] and tuned.seen == plain.seen
    steps = len(data) // 8
    for k, (epoch, step) in enumerate(sampler.given_at):
        assert step >= epoch * steps + (k % len(data)) // 8 - 2, (k, epoch, step)  # at most two batches early
    assert psutil.Process().children() == []


def test_while_the_next_epoch_makes_what_the_store_misses_the_filling_loader_reads_it_and_nothing_changes(
        monkeypatch, tmp_path):
    """A sampler of the user's own: what the store misses is made at the next epoch's start, in a worker process.
    Meanwhile the filling loader reads what the store holds instead of making every sample again (a switch at that
    epoch's first step to the same settings, reading) - and the model still sees the same samples in the same
    order, its weights bit for bit those of a run without pipeopt, no process left behind."""
    # an epoch long enough that the store holds its share of the next at its start (the user's 2 workers: the
    # filler's settings then, where the cached trials' differ)
    data = WhereMade(n=256, delay_s=0.01)
    held = threading.Event()  # the backfill makes nothing until the second step of epoch 1: running at its first

    class HeldBackfill(cache_start.Backfill):
        def _run(self, iterator):
            held.wait(60)
            super()._run(iterator)

    class Release(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.current_epoch >= 1 and batch_idx >= 1:
                held.set()

    monkeypatch.setattr(cache_start, "Backfill", HeldBackfill)

    def users_fit(callbacks):
        pl.seed_everything(3, verbose=False)
        model = Regressor(hidden=32, dropout=0.5, batchnorm=True)
        trainer = pl.Trainer(max_epochs=4, callbacks=[*callbacks, _Steps(), Release()], **quiet_trainer_kwargs())
        trainer.fit(model, DataLoader(data, batch_size=8, sampler=UsersSampler(len(data)), num_workers=2,
                                      persistent_workers=True))
        return model

    plain = users_fit([])
    _cached_faster(monkeypatch)
    switched = []
    switch = cache_start.LoaderSwitcher.switch
    monkeypatch.setattr(cache_start.LoaderSwitcher, "switch",
                        lambda self, settings, **kw: switched.append(settings) or switch(self, settings, **kw))
    callback = quiet_pipeopt(tune=("cache",), report_dir=tmp_path, cache=False)
    tuned = users_fit([callback])
    first_read = next(s for s in switched if s.cache)  # not a cached trial: their workers give way (or are none)
    assert (first_read.num_workers, first_read.give_way) == (2, False), switched
    assert "cache" in [c.knob for c in callback.report.changes] and tuned.seen == plain.seen
    for name, value in plain.state_dict().items():
        assert torch.equal(value, tuned.state_dict()[name]), name
    assert psutil.Process().children() == []


def test_the_backfill_makes_this_ranks_share_of_what_is_missing_when_each_epoch_draws_every_sample(tmp_path):
    """What the store misses is made ahead only when each epoch draws every sample of the data set - every missing
    one is then drawn in the next; a sampler that draws a part of it leaves the rest to be made when drawn. The
    node's ranks split what is missing."""
    import time
    from types import SimpleNamespace

    from pipeopt.apply.sample_cache import SampleCache, plan
    from pipeopt.apply.sample_store import SampleStore
    from pipeopt.callbacks.cache_start import StoreCompletion
    from pipeopt.tuning.loader_search import LoaderSettings

    def completion(draws_all, *, local_rank=0, devices=1):
        data = SleepyDataset(n=40, delay_s=0.0)
        split = plan(data)
        cache = SampleCache(split, SampleStore(tmp_path / f"s{draws_all}-{local_rank}", len(split), 1 << 20))
        reader = cache.dataset(read=True)
        for i in range(30):
            reader[i]  # 30 of 40 stored: 30..39 miss
        switcher = SimpleNamespace(cache=cache, user=DataLoader(data, batch_size=4),
                                   current=LoaderSettings(num_workers=2, prefetch_factor=2, persistent_workers=True,
                                                          pin_memory=False))
        notes: list[str] = []
        ahead = StoreCompletion(SimpleNamespace(local_rank=local_rank, num_devices=devices), switcher,
                                draws_all=draws_all, say=lambda line: None, note=notes.append)
        deadline = time.monotonic() + 60
        while not ahead.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        missing = cache.store.missing()
        cache.close()
        return missing, notes

    missing, notes = completion(True)
    assert missing == [] and len(notes) == 1 and notes[0].startswith("10 of the 10 samples the store missed were made "
                                                                      "ahead of the cache's trials, in 2 worker")
    assert completion(False) == (list(range(30, 40)), [])  # an epoch draws a part: made when drawn
    missing, notes = completion(True, local_rank=1, devices=2)
    assert missing == list(range(30, 40, 2)) and notes[0].startswith("5 of the 5 samples")  # rank 1's half
    assert psutil.Process().children() == []


def test_after_a_tuning_cache_hit_the_epoch_is_counted_in_samples_and_the_missing_ones_are_made_ahead(
        monkeypatch, tmp_path):
    """A rerun applies the loader configuration the tuning cache holds before the sample cache starts: the loader
    in place is then pipeopt's, whose batch sampler names no batch size. The epoch is still counted in the user's
    samples (it was counted in batches: 16, not 128), so the store's warmth and the backfill see the whole data
    set."""
    controlled_rates(monkeypatch, lambda s: (300.0 if getattr(s, "cache", False) else 100.0)
                     * (2 if getattr(s, "num_workers", 0) else 1))
    controlled_wait(monkeypatch, 0.5)
    controlled_cpu_room(monkeypatch, 1.0)
    data = SleepyDataset(n=128, delay_s=0.001)

    def run():
        callback = quiet_pipeopt(tune=("loader", "cache"), report_dir=tmp_path / "reports",
                                 cache=tmp_path / "tuning.json")
        fit([callback], data, epochs=6)
        return callback.report

    first = run()
    assert any(c.knob == "num_workers" for c in first.changes), first.notes
    # kept with the cache: the code that keeps it without pipeopt is the loader search's, and says so
    assert [c.knob for c in first.changes].count("cache") == 1
    assert len(first.suggestions) == 1 and first.suggestions[0].startswith("DataLoader(..., num_workers=")
    assert first.suggestions[0].endswith("(the loader settings alone: the sample cache needs pipeopt)")
    assert first.before_ran is None  # its before-window measured the user's settings
    second = run()
    assert any("applied the cached loader configuration" in n for n in second.notes), second.notes
    # the cached settings ran from the first step: the report does not call its first window "before"
    assert second.before_ran is not None and "an earlier run of this fit cached (num_workers=" in second.before_ran
    # made in the first epoch, while it drew the rest: the cached configuration's switch came before the epoch's
    # first index was drawn, and the stream is read ahead once it was (at the cache's start)
    assert any("made ahead" in n and "beside the rest of the epoch that made the store" in n
               for n in second.notes), second.notes
    assert psutil.Process().children() == []


@pytest.mark.parametrize("cached_rate", [50.0, 300.0], ids=["slower", "faster"])
def test_a_cached_trial_in_parts_stops_after_its_first_when_slower_and_runs_them_all_when_faster(
        monkeypatch, tmp_path, cached_rate):
    """A cached trial's window cut into parts on a real fit: the rates are controlled and so is the pace that sizes
    the windows (10 ms a step: a window of 30 steps, a first part of `window` steps then four of 7), so the cut is
    known. Slower than the window before it beyond noise, the trial stops after its first part and the report says
    so; faster, every part runs and the cache is kept. Either way the model trains on the same samples in the same
    order as without pipeopt."""
    from pipeopt.tuning import cache_session, session

    data = CountingDataset(n=128, delay_s=0.001)
    plain, _ = fit([], data, epochs=12)
    controlled_rates(monkeypatch, lambda settings: cached_rate if getattr(settings, "cache", False) else 100.0)
    monkeypatch.setattr(session.TrialWindows, "_step_s", lambda self, settings: 0.01)
    callback = quiet_pipeopt(tune=("cache",), report_dir=tmp_path, cache=False, window=2, window_s=0.1)
    tuned, _ = fit([callback], data, epochs=12)
    parts = [w for w in callback.windows if w.label.startswith("cache trial")]
    notes = callback.report.notes
    if cached_rate < 100.0:
        assert len(parts) == 1 and parts[0].steps == 2 and callback.report.changes == []
        assert any(f"stopped after 1 of its {cache_session.TRIAL_PARTS} parts (2 of 30 steps)" in n for n in notes)
    else:
        assert len(parts) == cache_session.TRIAL_PARTS and [c.knob for c in callback.report.changes] == ["cache"]
        assert [w.steps for w in parts] == [2, 7, 7, 7, 7]  # the first `window` steps, the rest in equal parts
        assert all(b.first_step == a.first_step + a.steps for a, b in zip(parts, parts[1:]))  # one after another
        assert not any("stopped after" in n for n in notes)
        # 3x the window before: the after-window (30 steps, three parts of 10) ends after its first part
        after = [w for w in callback.windows if w.label == "cache: after"]
        assert after[0].steps == 10
        assert any(f"ended after 1 of its {cache_session.AFTER_PARTS} parts (10 of 30 steps)" in n for n in notes)
    assert tuned.seen == plain.seen
    for name, value in plain.state_dict().items():
        assert torch.equal(value, tuned.state_dict()[name]), name


def test_a_cached_trial_starts_no_more_workers_than_the_rank_has_cpus(monkeypatch, tmp_path):
    """The user's loader has 2 workers and the rank may use 1 CPU (the seam: ``cache_start.rank_cpus``). Reading
    from a store in memory leaves CPU work only, which more processes than CPUs cannot do faster: the cached trials
    run the main process alone, then 1 worker - never 2 - and the model trains on the same samples in the same
    order as without pipeopt."""
    data = CountingDataset(n=128, delay_s=0.001)
    loader = dict(num_workers=2, persistent_workers=True)
    plain, _ = fit([], data, epochs=6, **loader)
    _cached_faster(monkeypatch)
    controlled_wait(monkeypatch, 0.5)  # the main process alone still waits: the workers' trial follows it
    controlled_cpu_room(monkeypatch, 1.0)  # ... where the step leaves CPUs idle for them, however busy the machine
    monkeypatch.setattr(cache_start, "rank_cpus", lambda trainer, agree: 1)
    callback = quiet_pipeopt(tune=("cache",), report_dir=tmp_path, cache=False)
    tuned, _ = fit([callback], data, epochs=6, **loader)
    tried = {w.label.split(",")[0] for w in callback.windows if w.label.startswith("cache trial")}
    assert tried == {"cache trial: num_workers=0", "cache trial: num_workers=1"}
    assert tuned.seen == plain.seen
    assert psutil.Process().children() == []
