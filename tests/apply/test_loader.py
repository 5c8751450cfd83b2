"""Handing a running epoch from one DataLoader to another: same samples, same order, each once."""

import itertools
import multiprocessing
import os
import time

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from pipeopt import _dataloader
from pipeopt.apply.handover import Handover
from pipeopt.apply.index_stream import IndexStream, peek_seed
from pipeopt.apply.loader import WORKER_NICENESS, GiveWay, build_loader, start_loader, unsupported
from pipeopt.tuning.loader_search import LoaderSettings
from tests.apply.datasets import CrashesOn, CrashesWithManyWorkers, Indexed
from tests.batches import KINDS, ShapedCollate, ids_of

FOUR = LoaderSettings(num_workers=4, prefetch_factor=2, persistent_workers=False, pin_memory=False)
TWO = LoaderSettings(num_workers=2, prefetch_factor=2, persistent_workers=True, pin_memory=False)
MAIN = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False)


def flat(batches):
    return [int(i) for b in batches for i in b.flatten()]


def user_loader(workers=0, **kw):
    return DataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=workers,
                      generator=torch.Generator().manual_seed(1), **kw)


def reference_epochs(workers, epochs=2):
    loader = user_loader(workers)
    return [flat(loader) for _ in range(epochs)]


def start(user, settings, stream, timeout=None):
    private = torch.Generator().manual_seed(peek_seed(user.generator))
    return start_loader(user, settings, first=stream, generator=private, timeout=timeout)


@pytest.mark.parametrize("user_workers", [0, 2])
def test_handover_mid_epoch_keeps_order_and_later_epochs_match(user_workers):
    expected = reference_epochs(user_workers)
    user = user_loader(user_workers)
    live = iter(user)
    seen = flat(itertools.islice(live, 5))  # 5 batches in; workers have more in flight
    stream = IndexStream(_dataloader.take_index_stream(live))
    handover = Handover(stream, live, user, fallback=lambda err: pytest.fail(str(err)))
    it, new = start(user, FOUR, stream)
    handover.add(it, new)
    seen += flat(itertools.islice(handover, 7))
    it2, newer = start(user, TWO, stream)  # a second switch while the first may still hold batches
    handover.add(it2, newer)
    seen += flat(handover)
    assert seen == expected[0]
    assert flat(newer) == expected[1]  # the next epoch: the user's sampler, the user's order
    handover.close()
    _dataloader.shutdown_iterator(_dataloader.cached_iterator(newer))


@pytest.mark.parametrize("settings", [MAIN, TWO], ids=["main-process", "persistent-workers"])
def test_a_loader_switched_in_after_the_last_batch_trains_a_whole_next_epoch(settings):
    """A switch at an epoch's last step: the new loader is first asked in the next epoch, which is then its own
    (all samples, the user's order) - not the empty rest of the epoch that ended."""
    expected = reference_epochs(0, epochs=3)
    user = user_loader(0)
    live = iter(user)
    seen = flat(live)  # the whole epoch, as Lightning's fetcher has it before the last step ends
    stream = IndexStream(_dataloader.take_index_stream(live))
    handover = Handover(stream, live, user, fallback=lambda err: pytest.fail(str(err)))
    it, new = start(user, settings, stream)
    handover.add(it, new)  # never asked: the fetcher had the epoch's end before the switch
    stream.epoch_over = True  # the switcher's end of epoch
    handover.close(keep=_dataloader.cached_iterator(new))
    assert seen == expected[0] and flat(new) == expected[1] and flat(new) == expected[2]
    _dataloader.shutdown_iterator(_dataloader.cached_iterator(new))


@pytest.mark.parametrize("kind", KINDS)
def test_a_handover_keeps_every_sample_of_every_batch_shape_once_in_order(kind):
    def user():
        return DataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=2, collate_fn=ShapedCollate(kind),
                          generator=torch.Generator().manual_seed(1))

    expected = [i for b in user() for i in ids_of(b)]
    loader = user()
    live = iter(loader)
    seen = [i for b in itertools.islice(live, 5) for i in ids_of(b)]
    stream = IndexStream(_dataloader.take_index_stream(live))
    handover = Handover(stream, live, loader, fallback=lambda err: pytest.fail(str(err)))
    handover.add(*start(loader, FOUR, stream))  # not persistent: no worker outlives the test
    seen += [i for b in handover for i in ids_of(b)]
    assert seen == expected
    handover.close()


def test_a_crashing_candidate_is_survived_without_losing_or_repeating_a_batch():
    expected = reference_epochs(0, epochs=1)[0]
    user = DataLoader(CrashesWithManyWorkers(crash_at=2), batch_size=4, shuffle=True,
                      generator=torch.Generator().manual_seed(1))
    live = iter(user)
    seen = flat(itertools.islice(live, 3))
    stream = IndexStream(_dataloader.take_index_stream(live))
    fallbacks = []

    def fallback(err):
        fallbacks.append(err)
        return start(user, MAIN, stream)

    handover = Handover(stream, live, user, fallback)
    handover.add(*start(user, FOUR, stream, timeout=5))
    seen += flat(handover)
    assert seen == expected
    assert len(fallbacks) == 1 and "exited unexpectedly" in str(fallbacks[0])
    handover.close()
    assert psutil.Process().children() == []


def test_a_trial_timeout_bounds_only_workers_the_main_process_loads_without_one():
    # a trial's loader gets a timeout (a hung worker is discarded); the main process alone cannot take one (torch
    # refuses it), as when the user's own settings are measured again in a trial window
    expected = reference_epochs(0, epochs=1)[0]
    user = user_loader()
    live = iter(user)
    seen = flat(itertools.islice(live, 3))
    stream = IndexStream(_dataloader.take_index_stream(live))
    handover = Handover(stream, live, user, lambda err: (_ for _ in ()).throw(err))
    handover.add(*start(user, MAIN, stream, timeout=5))
    seen += flat(handover)
    assert seen == expected


def test_errors_from_the_users_dataset_are_not_swallowed():
    class Broken(Indexed):
        def __getitem__(self, i):
            raise KeyError(f"sample {i} is missing")

    user = DataLoader(Broken(), batch_size=4)
    live = iter(user)
    stream = IndexStream(_dataloader.take_index_stream(live))
    handover = Handover(stream, live, user, fallback=lambda err: pytest.fail("not a worker failure"))
    handover.add(*start(user, TWO, stream))
    with pytest.raises(KeyError, match="sample .* is missing"):
        next(handover)
    handover.close()


def test_unsupported_loaders_say_why():
    class MyLoader(DataLoader):
        pass

    assert "not a torch.utils.data.DataLoader" in unsupported(MyLoader(Indexed()))
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert "IterableDataset" in unsupported(DataLoader(Stream()))
    assert unsupported(user_loader()) is None


def test_without_automatic_batching_the_sampler_is_resumed():
    user = DataLoader(Indexed(12), batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(2))
    expected = [int(x) for x in DataLoader(Indexed(12), batch_size=None, shuffle=True,
                                           generator=torch.Generator().manual_seed(2))]
    live = iter(user)
    seen = [int(x) for x in itertools.islice(live, 3)]
    stream = IndexStream(_dataloader.take_index_stream(live))
    handover = Handover(stream, live, user, fallback=lambda err: pytest.fail(str(err)))
    handover.add(*start(user, TWO, stream))
    seen += [int(x) for x in handover]
    assert seen == expected
    handover.close()


def test_ready_batches_of_a_handover_count_every_source():
    user = user_loader(2)
    live = iter(user)
    next(live)
    stream = IndexStream(_dataloader.take_index_stream(live))
    handover = Handover(stream, live, user, fallback=lambda err: pytest.fail(str(err)))
    it, new = start(user, FOUR, stream)
    handover.add(it, new)
    try:
        deadline = time.monotonic() + 20
        while handover.ready_batches() != 4 + 8:  # the old one's 2 x 2 (refilled after next) + the new one's 4 x 2
            assert time.monotonic() < deadline, f"ready batches stayed at {handover.ready_batches()}"
            time.sleep(0.05)
    finally:
        handover.close()


def test_live_ready_batches_names_the_running_epoch():
    import pytorch_lightning as pl

    from pipeopt.apply.loader import live_ready_batches
    from tests.helpers import Regressor, SleepyDataset, quiet_trainer_kwargs

    readings = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            readings.append(live_ready_batches(trainer))

    loader = DataLoader(SleepyDataset(n=32, delay_s=0.0), batch_size=4, num_workers=2, persistent_workers=True)
    pl.Trainer(max_epochs=2, callbacks=[Probe()], **quiet_trainer_kwargs()).fit(Regressor(), loader)
    assert len(readings) == 16 and all(r is not None and 0 <= r[1] <= 4 for r in readings)
    epochs = [r[0] for r in readings]
    assert all(e == epochs[0] for e in epochs[:8]) and all(e == epochs[8] for e in epochs[8:])
    assert epochs[8] != epochs[0]  # a new epoch is a new token, even with persistent workers


class Priority(torch.utils.data.Dataset):
    """Each item: the CPU priority (niceness) of the process that made it, and whether the user's init ran there."""

    initialised = False

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return os.getpriority(os.PRIO_PROCESS, 0), Priority.initialised


def _users_init(worker_id):
    Priority.initialised = True


@pytest.mark.skipif(not hasattr(os, "nice"), reason="os.nice: POSIX only")
def test_workers_that_give_way_run_below_the_training_process_after_the_users_init_is_kept():
    """Settings with ``give_way``: the workers run below the training process's CPU priority, and the user's
    worker_init_fn still runs in each; without it (and in the user's own loader) they run at its priority."""
    here = os.getpriority(os.PRIO_PROCESS, 0)
    user = DataLoader(Priority(), batch_size=2, num_workers=2, worker_init_fn=_users_init)
    settings = LoaderSettings(num_workers=2, prefetch_factor=2, persistent_workers=False, pin_memory=False)
    made = {}
    for give_way in (True, False):
        loader = build_loader(user, settings.__class__(**{**settings.as_kwargs(), "give_way": give_way}), first=None,
                              before_epoch=None, generator=torch.Generator())
        assert isinstance(loader.worker_init_fn, GiveWay) == give_way
        made[give_way] = {tuple(map(int, row)) for batch in loader for row in zip(*batch)}
    assert made == {True: {(min(here + WORKER_NICENESS, 19), 1)}, False: {(here, 1)}}
    assert {tuple(map(int, row)) for batch in user for row in zip(*batch)} == {(here, 1)}
    assert os.getpriority(os.PRIO_PROCESS, 0) == here  # the training process keeps its own
    assert "workers giving way" in LoaderSettings(2, 2, False, False, give_way=True).describe()
    assert not LoaderSettings(2, 2, False, False, give_way=True).with_workers(0, persistent=False).give_way


class _Epochs:
    """What ``LoaderSwitcher`` reads of a trainer: the fit's combined loader (``flattened``) and the running epoch's
    iterators - a new epoch starts an iterator of the loader installed, as Lightning's fetcher does."""

    def __init__(self, loader):
        self.flattened = [loader]
        self._iterator = None

    def epoch(self):
        self._iterator = type("Running", (), {"iterators": [iter(self.flattened[0])]})()
        return self._iterator.iterators


@pytest.mark.parametrize("where", ["mid-epoch", "an epoch's first loader", "the user's loader"])
def test_a_switch_that_takes_back_makes_the_old_loaders_undelivered_batches_in_the_new_one(where):
    """``switch(take_back=True)``: the batches the loaders in place dispatched and did not deliver are made by the
    new loader - none more comes from the old one, whose workers end on their own (exit code 0: no user code is cut
    short) - and the epoch keeps every sample once, in order. The user's own loader, whose undelivered batches
    pipeopt does not know, is drained as before."""
    from pipeopt.apply.loader import LoaderSwitcher

    users = 2 if where == "the user's loader" else 0  # (its workers hold batches in flight too)
    expected = reference_epochs(users, epochs=2)
    combined = _Epochs(user_loader(users))
    switcher = LoaderSwitcher(type("Trainer", (), {"fit_loop": type("Fit", (), {"_combined_loader": combined})})())
    live = combined.epoch()
    seen = [flat(itertools.islice(live[0], 3))]
    if where != "the user's loader":
        switcher.switch(TWO)  # pipeopt's loader, persistent workers: 2 x 2 batches in flight once it delivers
        seen.append(flat(itertools.islice(live[0], 2)))
    if where == "an epoch's first loader":
        seen.append(flat(live[0]))
        switcher.settle()
        switcher.end_of_epoch()
        live = combined.epoch()  # its workers, reused: 2 x 2 batches dispatched at once
        seen.append(flat(itertools.islice(live[0], 1)))
    old = switcher.handover.current[0] if switcher.handover else live[0]
    delivered = old._num_yielded
    switcher.switch(FOUR, take_back=True)
    seen.append(flat(live[0]))
    later = old._num_yielded - delivered  # delivered by the old loader after the switch
    assert [i for part in seen for i in part] == expected[0] + (expected[1] if where == "an epoch's first loader"
                                                                else [])
    switcher.end_of_epoch()
    switcher.close()
    if where == "the user's loader":
        assert later == 2 * 2  # drained: all it held
    else:
        assert later == 0
        assert [w.exitcode for w in old._workers] == [0, 0]
    assert psutil.Process().children() == []


@pytest.mark.parametrize("settings", [TWO, FOUR], ids=["persistent-workers", "workers-each-epoch"])
def test_a_trial_an_epoch_begins_on_falls_back_when_its_workers_die(settings):
    """A trial switched in at an epoch's last step is the next epoch's loader, started by the training loop, not by
    a switch: from the epoch's first batch on a worker death falls back to the settings before the trial, as it
    does mid-epoch - every sample once, in order, the failure kept for the tuner - instead of ending the fit."""
    from pipeopt.apply.loader import LoaderSwitcher

    expected = reference_epochs(0, epochs=2)
    dies = expected[1][0]  # the next epoch's first sample: its worker dies before the training loop has a batch
    user = DataLoader(CrashesOn({dies}), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    combined = _Epochs(user)
    switcher = LoaderSwitcher(type("Trainer", (), {"fit_loop": type("Fit", (), {"_combined_loader": combined})})())
    live = combined.epoch()
    seen = flat(live[0])  # the whole epoch, as the fetcher has it before the last step ends
    switcher.switch(settings, timeout_s=5)  # a trial, started at the epoch's last step
    switcher.end_of_epoch()
    live = combined.epoch()
    seen += flat(live[0])
    assert seen == expected[0] + expected[1]
    failure = switcher.take_failure()
    assert failure is not None and "exited unexpectedly" in str(failure)
    assert switcher.current == MAIN and combined.flattened[0].num_workers == 0  # the settings before the trial
    switcher.end_of_epoch()
    switcher.close()
    assert psutil.Process().children() == []


def test_settled_settings_an_epoch_begins_on_are_not_guarded():
    """Settings that were kept are not guarded: their failures are the user's, as without pipeopt (torch's own
    iterator, its SIGCHLD watch in place)."""
    from pipeopt.apply.loader import LoaderSwitcher

    combined = _Epochs(user_loader(0))
    switcher = LoaderSwitcher(type("Trainer", (), {"fit_loop": type("Fit", (), {"_combined_loader": combined})})())
    live = combined.epoch()
    flat(live[0])
    switcher.switch(TWO)
    switcher.settle()  # kept: the user's own semantics from here on
    switcher.end_of_epoch()
    live = combined.epoch()
    assert _dataloader.stoppable(live[0]) and live[0]._worker_pids_set
    assert switcher.handover is None
    flat(live[0])
    switcher.end_of_epoch()
    switcher.close()
    _dataloader.shutdown_iterator(_dataloader.cached_iterator(combined.flattened[0]))


def test_a_fallback_that_fails_too_raises_as_the_users_loader_would():
    """The settings a failed trial falls back to are the ones known to work (the user's here, 2 workers). Where
    their own worker dies as well - the dataset kills any worker given that sample - the error is the user's, as
    without pipeopt: it propagates, and pipeopt does not fall back again and again."""
    from pipeopt.apply.loader import LoaderSwitcher

    started = multiprocessing.Value("i", 0)  # worker processes started, counted by each one

    def count(worker_id):
        with started.get_lock():
            started.value += 1

    user = DataLoader(CrashesOn({50}), batch_size=4, num_workers=2, worker_init_fn=count)
    combined = _Epochs(user)
    switcher = LoaderSwitcher(type("Trainer", (), {"fit_loop": type("Fit", (), {"_combined_loader": combined})})())
    live = combined.epoch()
    seen = flat(itertools.islice(live[0], 2))
    switcher.switch(FOUR, timeout_s=5)
    # torch's error for a dead worker: "exited unexpectedly", or the dead worker's batch unreadable in transit
    with pytest.raises((RuntimeError, EOFError, ConnectionError)):
        for batch in live[0]:
            seen += flat([batch])
    assert seen == list(range(len(seen))) and len(seen) <= 48  # no batch repeated, none past the fatal one
    assert switcher.current == switcher.user_settings and "exited unexpectedly" in str(switcher.take_failure())
    switcher.close()
    assert psutil.Process().children() == []
    # the user's loader, the trial's, one fallback: none started after it failed. At most: a worker that was still
    # starting as another one died may have been shut down before counting itself (7 was read once, 8 just after)
    assert started.value <= 2 + 4 + 2


def test_an_epochs_iterator_is_not_kept_once_the_epoch_is_over():
    """The switcher lets go of a past epoch's iterators (Lightning drops them; torch frees their workers with them)."""
    import gc
    import weakref

    from pipeopt.apply.loader import LoaderSwitcher

    combined = _Epochs(DataLoader(Indexed(), batch_size=4))  # torch's sequential order: decided ahead
    switcher = LoaderSwitcher(type("Trainer", (), {"fit_loop": type("Fit", (), {"_combined_loader": combined})})())
    live = combined.epoch()
    users = weakref.ref(live[0])
    flat(itertools.islice(live[0], 2))
    switcher.switch(MAIN)
    flat(live[0])
    switcher.end_of_epoch()
    gc.disable()  # freed by reference counting, as torch's workers are
    try:
        del live
        combined.epoch()  # the next epoch: Lightning's running iterators are new ones
        assert users() is None
    finally:
        gc.enable()
        switcher.close()
