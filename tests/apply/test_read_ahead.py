"""A loader with no workers reading whole items from the store reads the next batch while the step trains: in a
thread below every other, the batch it drew ahead delivered exactly once, in order, even when the loader is cut."""

import itertools
import os
import threading

import pytest
import torch
from torch.utils.data import DataLoader

from pipeopt import _dataloader
from pipeopt.apply.handover import Handover
from pipeopt.apply.index_stream import IndexStream, peek_seed
from pipeopt.apply.loader import start_loader
from pipeopt.apply.read_ahead import IdleReader, ReadAhead
from pipeopt.apply.sample_cache import SampleCache, plan
from pipeopt.apply.sample_store import SampleStore
from pipeopt.tuning.loader_search import LoaderSettings
from tests.apply.datasets import Indexed

CACHED = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False, cache=True)
MAIN = LoaderSettings(num_workers=0, prefetch_factor=None, persistent_workers=False, pin_memory=False)
THREAD = "pipeopt-read-ahead"


def flat(batches):
    return [int(i) for b in batches for i in b.flatten()]


def filled(tmp_path, dataset):
    cache = SampleCache(plan(dataset), SampleStore(tmp_path / "s", len(dataset), 1 << 20))
    for _ in DataLoader(cache.dataset(read=False), batch_size=8):
        pass
    return cache


def start(user, settings, stream, dataset=None):
    private = torch.Generator().manual_seed(peek_seed(user.generator))  # as the switcher seeds its own
    return start_loader(user, settings, first=stream, generator=private, timeout=None, dataset=dataset)


def readers(cache):
    """Which thread read each batch the store gave whole."""
    seen, get_rows = [], cache.store.get_rows

    def spy(positions):
        seen.append((threading.current_thread().name, list(positions)))
        return get_rows(positions)

    cache.store.get_rows = spy
    return seen


def test_a_loader_cut_mid_epoch_delivers_the_batch_it_drew_ahead_and_every_sample_once_in_order(tmp_path):
    """The cached loader with no workers draws one batch ahead and reads it in the reader thread; cut mid-epoch, it
    delivers that batch, then the next loader goes on after it: the epoch is the user's, every sample once, and the
    next epoch is the user's too. The reader's thread ends with the cache."""
    dataset = Indexed()
    cache = filled(tmp_path, dataset)
    user = DataLoader(dataset, batch_size=4, shuffle=True)  # the order decided at the epoch's first index
    torch.manual_seed(3)
    expected = [flat(user) for _ in range(2)]
    torch.manual_seed(3)
    live = iter(user)
    seen = flat(itertools.islice(live, 3))
    stream = IndexStream(_dataloader.take_index_stream(live))
    handover = Handover(stream, live, user, fallback=lambda err: pytest.fail(str(err)))
    read = readers(cache)
    it, cached = start(user, CACHED, stream, cache.dataset(read=True, rows=True))
    assert isinstance(cached.batch_sampler, ReadAhead)
    handover.add(it, cached)
    seen += flat(itertools.islice(handover, 5))
    held = cached.batch_sampler.upcoming()
    assert held is not None and stream.in_flight == 1  # drawn from the stream, not yet delivered
    it2, plain = start(user, MAIN, stream)
    handover.add(it2, plain)  # cuts the cached loader: it keeps the batch it drew ahead
    seen += flat(handover)
    assert seen == expected[0]
    assert flat(plain) == expected[1]
    assert [positions for _, positions in read] == [seen[12 + 4 * k:16 + 4 * k] for k in range(6)]
    assert [name.startswith(THREAD) for name, _ in read] == [False] + [True] * 5  # the first batch: no batch before
    assert [t for t in threading.enumerate() if t.name.startswith(THREAD)]
    handover.close()
    cache.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(THREAD)]


def test_a_loader_reads_ahead_only_what_the_epoch_has_decided_and_only_in_the_main_process(tmp_path):
    """A sampler of the user's generator (drawn from earlier than without pipeopt when read ahead), a loader with
    workers, a loader that makes what it reads: no read-ahead."""
    dataset = Indexed()
    cache = filled(tmp_path, dataset)
    own = DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    shuffled = DataLoader(dataset, batch_size=4, shuffle=True)
    two = LoaderSettings(num_workers=2, prefetch_factor=2, persistent_workers=False, pin_memory=False, cache=True)
    for user, settings, read in [(own, CACHED, True), (shuffled, two, True), (shuffled, CACHED, False)]:
        it, loader = start(user, settings, iter(user.batch_sampler), cache.dataset(read=read, rows=True))
        assert not isinstance(loader.batch_sampler, ReadAhead)
        _dataloader.shutdown_iterator(it)
    cache.close()


def test_a_batch_read_ahead_serves_only_the_indices_it_was_read_for(tmp_path):
    dataset = Indexed()
    cache = filled(tmp_path, dataset)
    reader = cache.dataset(read=True, rows=True)

    class Next:
        def upcoming(self):
            return [1, 2]

    reader.ahead = Next()
    read = readers(cache)
    assert flat(_dataloader.collate_rows(reader.__getitems__([0, 5]))) == [0, 5]
    assert flat(_dataloader.collate_rows(reader.__getitems__([3, 4]))) == [3, 4]  # not the batch read ahead
    assert flat(_dataloader.collate_rows(reader.__getitems__([1, 2]))) == [1, 2]
    names = {tuple(p): n.startswith(THREAD) for n, p in read}
    assert names == {(0, 5): False, (1, 2): True, (3, 4): False}
    cache.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's: elsewhere the reader runs at the "
                                                          "usual priority")
def test_the_reader_thread_runs_below_every_other_and_stop_ends_it():
    reader = IdleReader()
    assert reader.submit(os.sched_getscheduler, 0).result() == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the training thread keeps its own
    threads = [t for t in threading.enumerate() if t.name.startswith(THREAD)]
    assert len(threads) == 1
    reader.stop()
    assert not threads[0].is_alive()
