"""The sample store and cache: shared by processes, bounded by its budget, items equal to the dataset's bit for bit,
and only datasets shown deterministic are cached."""

from __future__ import annotations

import errno
import mmap
import multiprocessing
import os
import random
import sys
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from pipeopt import _dataloader
from pipeopt.apply.sample_cache import CachedDataset, SampleCache, WholeSplit, plan, refusal
from pipeopt.apply.sample_store import SampleStore, decode, encode, sweep


class Counted(Dataset):
    """Deterministic items (a seeded tensor, a label, a dict), counting how often each is made in this process."""

    def __init__(self, n: int = 64) -> None:
        self.n = n
        self.made = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.made += 1
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(3, 5, generator=g), "y": i % 7, "name": f"item{i}"}


class TorchRandom(Counted):
    def __getitem__(self, i: int):
        return torch.rand(2), i


class DrawsButDiscards(Counted):
    """Same output whatever the seed, but it moves the global generator: skipping it would change later draws."""

    def __getitem__(self, i: int):
        random.random()
        return super().__getitem__(i)


class Batched(Counted):
    def __getitems__(self, indices):
        return [self[i] for i in indices]


def _equal(a, b) -> bool:
    return all(torch.equal(a["x"][k], b["x"][k]) for k in range(len(a["x"]))) and a["y"] == b["y"] and \
        a["name"] == b["name"]


def test_codec_round_trips_tensors_bit_for_bit():
    items = [torch.randn(4, 3), torch.randn(5, dtype=torch.float64).to(torch.bfloat16), torch.arange(6).view(2, 3).t(),
             torch.zeros(0, 4), torch.tensor(3), {"a": [torch.ones(2, dtype=torch.uint8), 1.5, "s"]}, np.arange(4)]
    for item in items:
        back = decode(encode(item))
        if isinstance(item, torch.Tensor):
            assert back.dtype == item.dtype and back.shape == item.shape and torch.equal(back, item)
    nested = decode(encode(items[5]))
    assert torch.equal(nested["a"][0], items[5]["a"][0]) and nested["a"][1:] == [1.5, "s"]


def test_items_read_from_the_store_are_writable_and_each_read_is_its_own(tmp_path):
    """The tensors a read makes share the memory of the bytes read (no second copy), so a user's in-place transform
    after the cache must change only that item: not the store, not another read of it."""
    store = SampleStore(tmp_path / "s", 2, 1 << 20)
    item = {"image": torch.randn(3, 8, 8), "pixels": np.arange(12, dtype=np.uint8), "label": 4}
    assert store.put(0, encode(item), 0)
    first, second = decode(store.get(0)), decode(store.get(0))
    first["image"].mul_(0)  # e.g. Normalize(inplace=True), run per sample after the cache
    first["pixels"] += 1
    assert torch.equal(second["image"], item["image"]) and np.array_equal(second["pixels"], item["pixels"])
    assert torch.equal(decode(store.get(0))["image"], item["image"]) and second["label"] == 4
    assert decode(encode(item))["pixels"].flags.writeable  # from read-only bytes too
    store.close()


def test_items_filled_by_worker_processes_are_read_by_the_main_process(tmp_path):
    split = plan(Counted())
    cache = SampleCache(split, SampleStore(tmp_path / "s", len(split), 1 << 20))
    filled = list(DataLoader(cache.dataset(read=False), batch_size=8, num_workers=2))
    stats = cache.store.stats()
    assert stats.stored == 64 and stats.unstored == 0 and stats.fill_s > 0
    reader = cache.dataset(read=True)
    read = list(DataLoader(reader, batch_size=8, num_workers=0))
    assert reader.split.dataset.made == 0  # every item came from the store
    for a, b in zip(filled, read):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"]) and a["name"] == b["name"]
    cache.close()
    assert not (tmp_path / "s").exists()


def test_the_budget_bounds_the_store_and_the_rest_is_made_as_before(tmp_path):
    dataset = Counted()
    one = len(encode(dataset[0]))
    store = SampleStore(tmp_path / "s", 64, 10 * one + one // 2)
    cached = CachedDataset(plan(dataset), store, read=True)
    first = [cached[i] for i in range(64)]
    assert store.stats().stored == 10 and store.stats().bytes_used <= store.budget_bytes
    made = dataset.made
    second = [cached[i] for i in range(64)]
    assert dataset.made - made == 54  # the ten stored items were read, the rest made again
    assert all(_equal(a, b) for a, b in zip(first, second))
    assert store.stats().unstored > 0


@pytest.mark.parametrize("how", ["short-write", "ENOSPC"])
def test_a_file_system_that_fills_before_the_budget_leaves_what_was_stored_read_and_the_rest_made(tmp_path, monkeypatch,
                                                                                                  how):
    dataset = Counted()
    store = SampleStore(tmp_path / "s", 64, 1 << 20)
    writes, pwrite = [], os.pwrite

    def filling(fd, data, offset):  # the file system has room for ten records and part of the eleventh
        writes.append(offset)
        if len(writes) <= 10:
            return pwrite(fd, data, offset)
        if len(writes) == 11 and how == "short-write":
            return pwrite(fd, bytes(data)[:len(data) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", filling)
    cached = CachedDataset(plan(dataset), store, read=True)
    first = [cached[i] for i in range(64)]
    assert store.stats().stored == 10 and store.stats().full and cached.full
    assert not cached.broken  # the store is still read: only storing stopped
    assert len(writes) == 11  # this process stopped offering once it saw the store full
    made = dataset.made
    second = [cached[i] for i in range(64)]
    assert dataset.made - made == 54 and not store.has(10)  # the record written in part was never published
    assert all(_equal(a, b) for a, b in zip(first, second))


def test_a_sample_two_processes_make_at_once_is_stored_once_and_neither_stops_storing(tmp_path, monkeypatch):
    """A worker making ahead what the store misses and a loader drawing the same sample both store it: the bytes are
    written once and counted once (the report never says more stored than the dataset has), and the process that
    found it being stored goes on storing the samples after it."""
    dataset = Counted()
    writer = SampleStore(tmp_path / "s", 64, 1 << 20)
    other = CachedDataset(plan(dataset), SampleStore(tmp_path / "s", 64, 1 << 20), read=True)  # its own view
    pwrite, met = os.pwrite, []

    def meanwhile(fd, data, offset):  # while the writer's bytes go down, the other process makes the same sample
        if not met:
            met.append(None)
            met[0] = other[3]
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", meanwhile)
    record = encode(dataset[3])
    assert writer.put(3, record, time.thread_time_ns())
    assert _equal(met[0], dataset[3]) and not other.full
    stats = writer.stats()
    assert stats.stored == 1 and stats.bytes_used == len(record) and writer.has(3)
    _ = other[4]
    assert writer.stats().stored == 2 and writer.has(4)


def _claim_and_die(store, record) -> None:  # a worker killed while it writes a sample's bytes
    def killed(fd, data, offset):
        os._exit(1)

    os.pwrite = killed
    store.put(5, record, time.thread_time_ns())


def test_a_sample_whose_writer_died_mid_write_is_stored_by_the_next_process_to_make_it(tmp_path):
    """A claim outlives a process killed while writing: without voiding it, the sample would never be stored and be
    made again every epoch."""
    dataset = Counted()
    cached = CachedDataset(plan(dataset), SampleStore(tmp_path / "s", 64, 1 << 20), read=True)
    child = multiprocessing.get_context("fork").Process(target=_claim_and_die,
                                                          args=(cached.store, encode(dataset[5])))
    child.start()
    child.join()
    assert child.exitcode == 1 and not cached.store.has(5) and not cached.store.taken(5)
    assert _equal(cached[5], dataset[5]) and cached.store.has(5) and cached.store.stats().stored == 1
    expected = dataset[5]
    made = dataset.made
    assert _equal(cached[5], expected) and dataset.made == made  # read from the store from now on


def _mapped_bytes(path) -> int:
    """Bytes of this process's mappings of ``path`` that its page tables map (``Rss`` in ``/proc/self/smaps``)."""
    total, inside, path = 0, False, os.path.realpath(path)  # the kernel names a mapping by its resolved path
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and not fields[0].endswith(":"):  # a mapping's first line: range, perms, offset, dev, inode, path
                inside = " ".join(fields[5:]) == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def _maps_in_ahead() -> bool:
    """Linux with /proc/self/smaps and a kernel that populates a mapping on request (``MADV_POPULATE_READ``)."""
    try:
        with mmap.mmap(-1, mmap.PAGESIZE) as m:
            m.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))
        return sys.platform == "linux" and os.path.exists("/proc/self/smaps")
    except (OSError, ValueError, TypeError):
        return False


def _store_in_a_worker(store, record, mapped) -> None:
    store.put(1, record, time.thread_time_ns())
    mapped.value = _mapped_bytes(store.directory / "data")


@pytest.mark.skipif(not _maps_in_ahead(), reason="needs Linux 5.14+ (madvise MADV_POPULATE_READ) and /proc/self/smaps")
def test_the_process_that_made_the_store_maps_in_what_it_stores_and_what_others_stored_when_asked(tmp_path):
    """A first read of pages this process has not mapped yet faults on each (reading a 4.8 MB batch so took twice as
    long, measured): the training process - which made the store, and reads from the next epoch what it stored at
    ``num_workers=0`` - maps each record in as it stores it. A worker does not: its mapping goes with it. What
    workers stored, the training process maps in when asked while the store fills (``map_in_stored``)."""
    store = SampleStore(tmp_path / "s", 8, 16 << 20)
    record = encode(torch.zeros(300_000, dtype=torch.uint8))
    assert _mapped_bytes(store.directory / "data") == 0
    assert store.put(0, record, time.thread_time_ns())
    assert _mapped_bytes(store.directory / "data") >= len(record)
    context = multiprocessing.get_context("fork")
    mapped = context.Value("q", -1)
    worker = context.Process(target=_store_in_a_worker, args=(store, record, mapped))
    worker.start()
    worker.join(60)
    assert worker.exitcode == 0 and store.has(1)
    assert 0 <= mapped.value < len(record)
    assert _mapped_bytes(store.directory / "data") < 2 * len(record)  # the worker's record: not mapped here yet
    store.map_in_stored()
    assert _mapped_bytes(store.directory / "data") >= 2 * len(record)
    assert bytes(store.get(1)) == record  # the same bytes, read through the pages mapped in


def _reopen_and_map_in(directory, mapped) -> None:
    store = SampleStore(directory, 8, 16 << 20)  # a rerun's training process, on a kept store
    store.map_in_stored()
    mapped.value = _mapped_bytes(store.directory / "data")


@pytest.mark.skipif(not _maps_in_ahead(), reason="needs Linux 5.14+ (madvise MADV_POPULATE_READ) and /proc/self/smaps")
def test_a_reopened_store_maps_in_only_what_is_stored_after_it_was_opened(tmp_path):
    """A store kept by an earlier run may be larger than the memory, on a disk: mapping in what it held already would
    read it all back in the training process."""
    store = SampleStore(tmp_path / "s", 8, 16 << 20)
    assert store.put(0, encode(torch.zeros(300_000, dtype=torch.uint8)), time.thread_time_ns())
    context = multiprocessing.get_context("fork")
    mapped = context.Value("q", -1)
    reader = context.Process(target=_reopen_and_map_in, args=(store.directory, mapped))
    reader.start()
    reader.join(60)
    assert reader.exitcode == 0 and mapped.value == 0


def test_a_reopened_store_keeps_its_items_and_a_kept_cache_survives_close(tmp_path):
    split = plan(Counted())
    cache = SampleCache(split, SampleStore(tmp_path / "s", 64, 1 << 20), keep=True)
    _ = [cache.dataset(read=True)[i] for i in range(5)]
    cache.close()
    again = SampleStore(tmp_path / "s", 64, 1 << 20)
    assert again.stats().stored == 5 and again.has(4) and not again.has(5)


def _make_store_and_die(directory) -> None:  # a fit killed before it removed its store
    SampleStore(directory, 8, 1 << 20)


def test_a_store_whose_process_died_is_swept_and_one_in_use_or_just_made_stays(tmp_path):
    root = tmp_path / "stores"
    held = SampleStore(root / "held", 8, 1 << 20)
    child = multiprocessing.get_context("fork").Process(target=_make_store_and_die, args=(root / "orphan",))
    child.start()
    child.join()
    assert child.exitcode == 0 and (root / "orphan" / "index").exists()
    assert sweep(root) == []  # both just made: one being made has no holder yet
    assert sweep(root, older_than_s=0) == [root / "orphan"]
    assert not (root / "orphan").exists() and held.stats().length == 8
    held.close()  # closed (the fit ended, kept or not): no process holds it any more
    assert sweep(root, older_than_s=0) == [root / "held"]


def _read_before_and_after(store, made, reopened) -> None:  # a reader mapping the store's files
    first = decode(store.get(3))
    made.set()
    reopened.wait(30)
    assert torch.equal(decode(store.get(3))["x"], first["x"]) and store.get_rows([3, 4]) is not None


def test_a_store_made_anew_where_one_is_read_leaves_its_readers_reading_the_old_one(tmp_path):
    store = SampleStore(tmp_path / "s", 64, 1 << 20)
    for i in range(8):
        store.put(i, encode(Counted()[i]), 0)
    made, reopened = multiprocessing.get_context("fork").Event(), multiprocessing.get_context("fork").Event()
    reader = multiprocessing.get_context("fork").Process(target=_read_before_and_after,
                                                         args=(store, made, reopened))
    reader.start()
    assert made.wait(30)
    anew = SampleStore(tmp_path / "s", 32, 1 << 20)  # another length: a new store in its place, files and all
    reopened.set()
    reader.join(30)
    assert reader.exitcode == 0  # not killed by a SIGBUS (a mapped page cut off its file), nor failed
    assert anew.stats().stored == 0 and anew.get(3) is None
    store.remove()


def test_deterministic_datasets_are_cached_whole_and_the_global_generators_are_left_as_they_were():
    state = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    split = plan(Counted())
    assert isinstance(split, WholeSplit)
    reason, digest = refusal(split)
    assert reason is None and digest
    assert torch.equal(state[0], torch.get_rng_state()) and state[1] == random.getstate()
    assert np.array_equal(state[2], np.random.get_state()[1])


@pytest.mark.parametrize("dataset, why", [
    (TorchRandom(), "draws from a global random generator"),
    (DrawsButDiscards(), "draws from a global random generator"),
])
def test_random_datasets_are_refused_with_the_reason(dataset, why):
    state = torch.get_rng_state()
    reason, _ = refusal(plan(dataset))
    assert reason is not None and why in reason
    assert torch.equal(state, torch.get_rng_state())


def test_a_dataset_whose_items_differ_between_fetches_is_refused():
    class Drifting(Counted):
        def __getitem__(self, i):
            self.made += 1
            return torch.full((2,), float(self.made))

    reason, _ = refusal(plan(Drifting()))
    assert reason is not None and "differed between two fetches" in reason


def test_batch_making_and_iterable_datasets_are_not_cached():
    assert "__getitems__" in plan(Batched())
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert "map-style" in plan(Stream())


def test_a_dataset_that_raises_is_left_alone():
    class Broken(Counted):
        def __getitem__(self, i):
            raise OSError("disk gone")

    reason, _ = refusal(plan(Broken()))
    assert reason is not None and "OSError: disk gone" in reason


def test_a_store_that_goes_away_or_an_item_it_cannot_hold_never_fails_a_fetch(tmp_path):
    dataset = Counted()
    cache = SampleCache(plan(dataset), SampleStore(tmp_path / "s", 64, 1 << 20))
    reader = cache.dataset(read=True)
    first = reader[3]
    cache.store.remove()  # removed under a running loader (say, another rank's fit ended first)
    again = CachedDataset(reader.split, SampleStore.__new__(SampleStore), read=True)
    again.store.__setstate__({"directory": tmp_path / "s", "length": 64, "budget_bytes": 1 << 20, "slot": 0})
    assert _equal(again[3], first) and again.broken

    class Unpicklable(Counted):
        def __getitem__(self, i):
            return {"x": torch.zeros(3, 5), "y": 0, "name": "n", "f": lambda: i}

    odd = CachedDataset(WholeSplit(Unpicklable()), SampleStore(tmp_path / "t", 64, 1 << 20), read=True)
    assert odd[1]["f"]() == 1 and odd.broken


def _filled(tmp_path, dataset) -> SampleCache:
    cache = SampleCache(plan(dataset), SampleStore(tmp_path / "s", len(dataset), 1 << 20))
    for _ in DataLoader(cache.dataset(read=False), batch_size=8):
        pass
    return cache


@pytest.mark.parametrize("workers", [0, 2])
def test_whole_items_read_a_batch_at_a_time_collate_to_the_same_batches_bit_for_bit(tmp_path, workers):
    """Each tensor field of a batch of whole items is read from the store straight into its row of one batch tensor,
    which the collate hands on instead of stacking: the batches equal default_collate's (values, dtypes, strides;
    the other fields collated as torch does), in a loader worker too (where the batch is made in shared memory)."""
    dataset = Counted()
    cache = _filled(tmp_path, dataset)
    reader = cache.dataset(read=True, rows=True)
    assert reader.rows
    plain = list(DataLoader(dataset, batch_size=8, shuffle=False))
    made = cache.store.stats().made  # the items made on a miss, in any process
    rows = list(DataLoader(reader, batch_size=8, collate_fn=_dataloader.collate_rows, num_workers=workers,
                           persistent_workers=workers > 0))
    assert len(rows) == len(plain) == 8
    for a, b in zip(plain, rows):
        assert a.keys() == b.keys() and a["name"] == b["name"]
        for key in ("x", "y"):
            assert torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype and a[key].stride() == b[key].stride()
    assert cache.store.stats().made == made  # all of it from the store
    items = reader.__getitems__([5, 0, 63])
    batch = _dataloader.collate_rows(items)
    assert batch["x"].data_ptr() == items[0]["x"].data_ptr()  # the rows' tensor itself: no stack, no second copy
    assert torch.equal(batch["x"], torch.stack([dataset[i]["x"] for i in (5, 0, 63)]))
    batch["x"].mul_(0)  # a batch is its own: writing to it changes neither the store nor a later read
    assert torch.equal(_dataloader.collate_rows(reader.__getitems__([5]))["x"][0], dataset[5]["x"])
    cache.close()


def test_a_store_whose_every_record_is_known_reads_each_batch_from_where_its_records_lie(tmp_path):
    """Once every position's record has been read as a tensor alone, a batch is read by where each one's bytes
    start (no check left): the batches still equal the items stacked, whatever their order, repeats included -
    also where the records were stored in another order than their positions."""
    order = [5, 2, 7, 0, 3, 6, 1, 4]  # stored in this order: a position's bytes are not at 8 x position
    kept = {i: torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in order}
    store = SampleStore(tmp_path / "s", len(order), 1 << 20)
    for i in order:
        assert store.put(i, encode(kept[i]), 0)
    batches = [[0, 1, 2], [3, 4], [5, 6, 7], [7, 0, 7, 3], list(range(8))[::-1], [4]]  # every one known by the third
    for positions in batches:
        rows = store.get_rows(positions)
        assert isinstance(rows, _dataloader.Collated)
        assert torch.equal(rows.batch, torch.stack([kept[i] for i in positions]))
    store.remove()


def test_a_batch_with_a_position_outside_the_store_is_not_read_as_rows(tmp_path):
    """A position below 0 or past the store's length names no record: ``get_rows`` reads no batch for it (its caller
    then reads item by item, where the dataset says what is wrong with the index) - before every record is known, and
    after, where a batch is where each one's bytes start - instead of a record at the end, or the index's header."""
    kept = [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    store = SampleStore(tmp_path / "s", len(kept), 1 << 20)
    for i, tensor in enumerate(kept):
        assert store.put(i, encode(tensor), 0)
    outside = ([-1, 0], [0, -4], [4], [1, 2**40], [-(2**63)], [0, 2**63], [2**64])
    for positions in outside:  # no record read yet
        assert store.get_rows(positions) is None
    assert torch.equal(store.get_rows([0, 1, 2, 3]).batch, torch.stack(kept))  # every record known from here
    for positions in outside:
        assert store.get_rows(positions) is None
    assert torch.equal(store.get_rows([3, 3, 0]).batch, torch.stack([kept[3], kept[3], kept[0]]))
    reader = CachedDataset(WholeSplit(kept), store, read=True, rows=True)  # a list: its items, its IndexError
    first, last = reader.__getitems__([0, -1])  # a negative index counts from the end, as the dataset's own does
    assert torch.equal(first, kept[0]) and torch.equal(last, kept[-1])
    for indices in ([0, 4], [0, 2**63]):
        with pytest.raises(IndexError):  # the dataset's own error, as without the store
            reader.__getitems__(indices)
    assert not reader.broken
    store.remove()


def test_a_record_laid_out_otherwise_is_never_read_as_the_tensors_read_before(tmp_path):
    """Once a batch of records that are a tensor alone has been read, later batches of records pickled alike are read
    without unpickling them; a record of another shape or dtype with the same number of bytes is not one of them:
    it is read as what it is."""
    store = SampleStore(tmp_path / "s", 8, 1 << 20)
    kept = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    others = [torch.randn(4, 3), torch.randn(12).view(3, 4).to(torch.int32), torch.randn(3, 2).double()]
    for i, tensor in enumerate([*kept, *others]):
        assert store.put(i, encode(tensor), 0)
    for positions in ([0, 1, 2], [3, 0], [2, 2, 1]):  # the first read finds the layout, the others keep to it
        rows = store.get_rows(positions)
        assert isinstance(rows, _dataloader.Collated) and torch.equal(rows.batch, torch.stack([kept[i]
                                                                                                 for i in positions]))
        assert all(row.data_ptr() == rows.batch[k].data_ptr() for k, row in enumerate(rows))  # the items: its rows
        assert _dataloader.collate_rows(rows) is rows.batch
    reader = CachedDataset(WholeSplit(Image(8)), store, read=True, rows=True)
    for other in (4, 5, 6):  # another shape; another dtype; both (48 bytes each, as the tensors before)
        assert not isinstance(store.get_rows([0, other]), _dataloader.Collated)  # not as the rows of one tensor
        first, read = reader.__getitems__([0, other])
        assert torch.equal(first, kept[0]) and torch.equal(read, others[other - 4])
        assert (read.dtype, read.shape, read.stride()) == (others[other - 4].dtype, others[other - 4].shape,
                                                          others[other - 4].stride())
    store.remove()


class Labelled(Counted):
    """Whole items of tensors and numbers - an input, its label, a weight - as a tuple, a list or a dict."""

    def __init__(self, n: int = 64, container: type = tuple) -> None:
        super().__init__(n)
        self.container = container

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x, w = torch.randn(3, 5, generator=g), torch.randint(0, 9, (2,), generator=g, dtype=torch.int16)
        if self.container is dict:
            return {"x": x, "label": i % 7 - 3, "weight": i / 3, "w": w}
        return self.container([x, i % 7 + 2**40 * (i % 2), w, i / 3])


def _alike(got, want) -> bool:
    """``got`` is ``want``: the same container of the same values, each tensor of the same dtype and shape."""
    if type(got) is not type(want):
        return False
    if isinstance(want, torch.Tensor):
        return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    if isinstance(want, dict):
        return list(got) == list(want) and all(_alike(got[k], want[k]) for k in want)
    if isinstance(want, (tuple, list)):
        return len(got) == len(want) and all(_alike(a, b) for a, b in zip(got, want))
    return got == want


@pytest.mark.parametrize("container", [tuple, list, dict])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_of_tensors_and_numbers_is_read_collated_once_its_records_are_known(tmp_path, container, workers):
    """Items of tensors and numbers (an image and its label): once a batch has read a record, later batches read it
    without unpickling it, and come collated - equal to torch's default collate of the user's items (the same
    container, values, dtypes), and so are the items, where something else reads them. Through a DataLoader over
    two epochs, in workers too: the same batches as the user's loader, drawn in the same order."""
    dataset = Labelled(container=container)
    cache = _filled(tmp_path, dataset)
    reader = cache.dataset(read=True, rows=True)
    known: set[int] = set()
    for positions in ([0, 1, 2], [2, 1, 0], [5, 63, 5, 2], list(range(64)), [7, 3], [63]):
        rows = cache.store.get_rows(positions)
        assert isinstance(rows, _dataloader.Collated) == known.issuperset(positions)
        known.update(positions)
        wanted = [dataset[i] for i in positions]
        assert _alike(_dataloader.collate_rows(reader.__getitems__(positions)), default_collate(wanted))
        assert _alike(list(reader.__getitems__(positions)), wanted)
    made = cache.store.stats().made
    for seed in (0, 1):
        plain = DataLoader(dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(seed))
        read = DataLoader(reader, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(seed),
                          collate_fn=_dataloader.collate_rows, num_workers=workers)
        assert all(_alike(a, b) for a, b in zip(read, plain, strict=True))
    assert cache.store.stats().made == made  # all of it from the store
    cache.close()


def test_a_record_of_items_not_alike_is_never_read_as_the_records_known_before(tmp_path):
    """Once records of a tensor and a label are known, a record alike in its bytes' sizes but not in what it holds -
    a label of another type, another container, the fields in another order, a tensor of another shape - is read as
    what it is, in a batch with known ones or alone, however often it is read."""
    store = SampleStore(tmp_path / "s", 16, 1 << 20)
    x = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    kept = [(x[0], 1), (x[1], 2), (x[2], 3), (x[3], 4), (x[4], "5"), (x[5], True), (x[6], 1.5), [x[7], 8],
            (x[8].view(4, 3), 9), (10, x[9]), {"x": x[10], "y": 11}, (x[11], 2**63)]
    for i, item in enumerate(kept):
        assert store.put(i, encode(item), 0)
    for positions in ([0, 1, 2, 3], [3, 0]):
        store.get_rows(positions)
    assert isinstance(store.get_rows([3, 0]), _dataloader.Collated)  # known
    reader = CachedDataset(WholeSplit(kept), store, read=True, rows=True)
    for other in range(4, len(kept)):
        for positions in ([0, other], [other, other], [other, 1]):
            for _ in range(3):
                assert not isinstance(store.get_rows(positions), _dataloader.Collated)
                assert _alike(list(reader.__getitems__(positions)), [kept[i] for i in positions])
    assert _alike(list(reader.__getitems__([1, 0])), [kept[1], kept[0]])
    store.remove()


class Fields(Counted):
    """Whole items of several tensor fields (dtypes of 1, 2 and 8 bytes, odd lengths, a 0-d and an empty tensor) and
    a name of 0 to 199 characters: records whose tensors' bytes start at different offsets within them."""

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return (torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randint(0, 255, (5,), generator=g,
                dtype=torch.uint8), torch.tensor(i * 7), torch.empty(0, 4), torch.randn(3, generator=g).half(), i,
                "n" * (i * 37 % 200))


class Image(Counted):
    """Whole items that are a tensor alone (an image cached as the model sees it)."""

    def __getitem__(self, i: int):
        return torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("dataset", [Fields(300), Image(300), Labelled(300)],
                         ids=["fields", "tensor alone", "tensor and label"])
def test_every_field_of_a_batch_read_at_a_time_is_read_from_its_own_items_bytes(tmp_path, dataset):
    """Each field of a batch is gathered from the store at once, its rows from wherever each item's record has them
    (records of any length, so at any offset, and at different offsets within records): every field, of any dtype
    and size, equals torch's stack of the user's items, whichever positions a batch draws, in any order - an item
    that is a tensor alone too."""
    cache = _filled(tmp_path, dataset)
    reader = cache.dataset(read=True, rows=True)
    for positions in ([0, 1, 2], [47, 3, 30, 11, 3], [5], [255, 256, 0, 299, 256, 1]):
        items = reader.__getitems__(positions)
        assert cache.store.get_rows(positions) is not None  # read a batch at a time, not item by item
        wanted = default_collate([dataset[i] for i in positions])
        for got, want in zip(*(b if isinstance(b, list) else [b] for b in (_dataloader.collate_rows(items), wanted))):
            if isinstance(want, torch.Tensor):
                assert torch.equal(got, want) and got.dtype == want.dtype and got.shape == want.shape
            else:  # the names
                assert got == want
    cache.close()


def test_a_batch_read_from_the_store_is_never_written_over_while_it_is_held(tmp_path):
    """The memory of the batches read straight from the store is used again for later ones, once dropped: one held
    (past more reads than that memory has batches) keeps what it was read with."""
    dataset = Counted()
    cache = _filled(tmp_path, dataset)
    reader = cache.dataset(read=True, rows=True)

    def read(positions):
        return _dataloader.collate_rows(reader.__getitems__(positions))["x"]

    first = read([1, 2, 3])
    memory = first.data_ptr()
    later = [read([4, 5, 6]) for _ in range(6)]
    assert torch.equal(first, torch.stack([dataset[i]["x"] for i in (1, 2, 3)]))
    assert all(torch.equal(t, torch.stack([dataset[i]["x"] for i in (4, 5, 6)])) for t in later)
    del first, later
    assert read([7, 8, 9]).data_ptr() == memory  # dropped: its memory is read into again
    cache.close()


def test_a_batch_the_store_cannot_read_whole_is_read_item_by_item(tmp_path):
    """A position not stored (made and stored on the way), items whose fields differ, a field that is not a plain
    tensor: the batch is read as before, item by item, and the collate stacks it as torch does."""
    dataset = Counted()
    cache = SampleCache(plan(dataset), SampleStore(tmp_path / "s", 64, 1 << 20))
    reader = cache.dataset(read=True, rows=True)
    _ = [reader[i] for i in range(4)]
    assert cache.store.get_rows([0, 1, 2, 3]) is not None and cache.store.get_rows([0, 9]) is None
    assert reader.__getitems__([]) == [] and not reader.broken
    made = dataset.made
    batch = _dataloader.collate_rows(reader.__getitems__([0, 9]))
    assert dataset.made == made + 1 and cache.store.has(9)
    assert torch.equal(batch["x"], torch.stack([dataset[0]["x"], dataset[9]["x"]]))
    store = cache.store
    assert store.put(10, encode({"x": torch.zeros(4, 5)}), 0) and store.put(11, encode({"x": torch.zeros(3, 5)}), 0)
    assert store.put(12, encode({"x": np.zeros(3)}), 0) and store.put(13, encode({"x": np.zeros(3)}), 0)
    assert store.get_rows([10, 11]) is None and store.get_rows([12, 13]) is None
    assert store.get_rows([11, 10]) is None  # the first item's fields decide; the second's differ
    assert store.put(14, encode({"x": np.zeros(15, dtype=np.float32)}), 0)  # the bytes of a 3 x 5 float tensor
    assert store.get_rows([11, 14]) is None  # ... or are not a tensor at all
    cache.close()


def test_only_whole_items_are_read_a_batch_at_a_time():
    split = plan(Counted())
    store = SampleStore.__new__(SampleStore)
    assert CachedDataset(split, store, read=True, rows=True).rows
    assert not CachedDataset(split, store, read=False, rows=True).rows  # a filling loader makes each item
    split.whole = False  # e.g. a random crop left per sample after the store
    assert not CachedDataset(split, store, read=True, rows=True).rows
