"""The torch DataLoader seams (pipeopt._dataloader): ready batches counted, failed workers ended at once, which
samplers' epochs may be read ahead, batches read ahead of the training step, batch memory used again."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

from pipeopt import _dataloader


def _wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the loader's workers did not fill their queue in time"
        time.sleep(0.05)


@pytest.mark.parametrize("pin_memory", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                reason="the pin-memory thread's second queue exists only with CUDA")),
])
def test_ready_batches_counts_what_the_workers_finished(pin_memory):
    data = TensorDataset(torch.arange(64.0))
    iterator = iter(DataLoader(data, batch_size=4, num_workers=2, prefetch_factor=3, pin_memory=pin_memory))
    try:
        _wait_for(lambda: _dataloader.ready_batches(iterator) == 6)  # 2 workers x prefetch 3, all finished
        next(iterator)
        next(iterator)
        assert _dataloader.ready_batches(iterator) <= 6
        _wait_for(lambda: _dataloader.ready_batches(iterator) == 6)  # refilled for the batches taken
        for _ in range(16 - 2 - 6):
            next(iterator)
        _wait_for(lambda: _dataloader.ready_batches(iterator) == 6)  # the last 6 batches of the epoch: no refill
        for _ in range(6):
            next(iterator)
        assert _dataloader.ready_batches(iterator) == 0
    finally:
        _dataloader.shutdown_iterator(iterator)


def test_a_single_process_loader_holds_no_ready_batches():
    iterator = iter(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4))
    assert _dataloader.ready_batches(iterator) == 0
    assert _dataloader.ready_batches(iter([1, 2])) is None  # not a DataLoader iterator: unknown


class _Hangs(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(3600)


def test_kill_workers_ends_a_failed_iterators_workers_without_waiting_for_them():
    iterator = iter(DataLoader(_Hangs(), batch_size=4, num_workers=2))
    workers = list(iterator._workers)
    assert all(w.is_alive() for w in workers)
    _dataloader.kill_workers(iterator)
    assert not any(w.is_alive() for w in workers)
    _dataloader.shutdown_iterator(iterator)  # the usual shutdown then has nothing left to wait for


def _started(loader):
    iterator = iter(loader)
    next(iterator)  # the epoch's first batch: a RandomSampler draws its seed here
    return iterator


def test_only_torchs_own_samplers_are_read_ahead_and_only_once_their_epoch_has_begun():
    from torch.utils.data import DistributedSampler, Sampler

    class UsersSampler(Sampler[int]):  # may decide its order as it goes: never read ahead
        def __iter__(self):
            return iter(range(16))

        def __len__(self):
            return 16

    data = list(range(16))
    assert _dataloader.order_fixed(_started(DataLoader(data, batch_size=4, shuffle=True)))
    assert _dataloader.order_fixed(_started(DataLoader(data, batch_size=4)))
    fresh = iter(DataLoader(data, batch_size=4, shuffle=True))  # its epoch's first index not drawn yet: the
    assert not _dataloader.index_stream_begun(_dataloader.take_index_stream(fresh))  # seed is still to be drawn
    assert _dataloader.index_stream_begun(_dataloader.take_index_stream(_started(DataLoader(data, shuffle=True))))
    assert not _dataloader.order_fixed(_started(DataLoader(data, batch_size=4, shuffle=True,
                                                           generator=torch.Generator().manual_seed(1))))
    assert not _dataloader.order_fixed(_started(DataLoader(data, batch_size=4, sampler=UsersSampler())))
    shard = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    iterator = _started(DataLoader(data, batch_size=2, sampler=shard))
    assert _dataloader.order_fixed(iterator) and _dataloader.epoch_positions(iterator) == list(shard)
    assert _dataloader.epoch_positions(_started(DataLoader(data, batch_size=4, shuffle=True))) == data
    with_replacement = DataLoader(data, batch_size=4, sampler=torch.utils.data.RandomSampler(data, replacement=True))
    assert _dataloader.epoch_positions(_started(with_replacement)) is None


def test_reading_a_shuffled_epoch_ahead_changes_neither_its_order_nor_the_random_numbers_after_it():
    from pipeopt.apply.index_stream import IndexStream

    def epoch(read_ahead):
        torch.manual_seed(7)
        iterator = iter(DataLoader(list(range(64)), batch_size=8, shuffle=True))
        first = next(iterator).tolist()
        stream = IndexStream(_dataloader.take_index_stream(iterator), read_ahead=read_ahead)
        if read_ahead:
            assert len(stream.ahead()) == 56  # the rest of the epoch, read now
        torch.rand(3)  # the training step's draws, between the loader's batches
        return [first, *list(stream)], torch.get_rng_state()

    (order, rng), (order_ahead, rng_ahead) = epoch(False), epoch(True)
    assert order_ahead == order and torch.equal(rng_ahead, rng)


class _Threads(torch.utils.data.Dataset):
    """Item i is i; notes the thread each item is made in."""

    def __init__(self, n: int) -> None:
        self.n, self.threads = n, set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.threads.add(threading.get_ident())
        return torch.tensor([i, i * i])


class _NotingSampler(torch.utils.data.BatchSampler):
    """torch's batch sampler, noting the thread each index batch is drawn in."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threads = set()

    def __iter__(self):
        for batch in super().__iter__():
            self.threads.add(threading.get_ident())
            yield batch


def test_a_loader_reading_ahead_delivers_torchs_batches_and_runs_the_samplers_and_the_datasets_code_in_its_thread():
    """Each batch is read while the one before is in use, by ``read_ahead`` (on another thread), or fetched as torch
    fetches it where the read gives nothing: the same batches as torch's iterator, in order, each read once, the
    first fetched; the sampler and the dataset run in the loop's thread only, and the random numbers after the
    epoch are as without reading ahead."""
    pool = ThreadPoolExecutor(1)
    reads = []

    def epoch(reading_ahead):
        torch.manual_seed(5)
        data = _Threads(40)
        sampler = _NotingSampler(torch.utils.data.RandomSampler(data), batch_size=4, drop_last=False)
        loader = DataLoader(data, batch_sampler=sampler)

        def read(indices):  # not a batch beginning with an odd index: fetched when due
            reads.append(list(indices))
            if indices[0] % 2:
                return None
            return pool.submit(lambda: default_collate([torch.tensor([i, i * i]) for i in indices]))

        iterator = _dataloader.ReadAheadIterator(loader, read) if reading_ahead else iter(loader)
        batches = []
        for batch in iterator:
            batches.append(batch)
            torch.rand(2)  # the training step's draws, between the loader's batches
        return batches, torch.get_rng_state(), sampler.threads | data.threads

    batches, rng, threads = epoch(False)
    ahead, rng_ahead, threads_ahead = epoch(True)
    pool.shutdown()
    assert len(ahead) == len(batches) == 10 and all(torch.equal(a, b) for a, b in zip(ahead, batches))
    assert reads == [b[:, 0].tolist() for b in batches[1:]]  # every batch but the first, once, in order
    assert 0 < sum(r[0] % 2 for r in reads) < len(reads)  # some read ahead, some fetched when due
    assert torch.equal(rng_ahead, rng) and threads_ahead == {threading.get_ident()}


def test_a_loader_reading_ahead_counts_its_batch_read_and_delivers_it_once_its_stream_is_taken():
    from pipeopt.apply.index_stream import ResumingSampler

    pool = ThreadPoolExecutor(1)
    data = _Threads(32)
    sampler = ResumingSampler(torch.utils.data.BatchSampler(range(32), 4, False), None, None, remember=1)
    loader = DataLoader(data, batch_sampler=sampler)
    iterator = _dataloader.ReadAheadIterator(
        loader, lambda indices: pool.submit(lambda: default_collate([data[i] for i in indices])))
    assert next(iterator)[:, 0].tolist() == [0, 1, 2, 3]
    _wait_for(lambda: _dataloader.ready_batches(iterator) == 1)  # the next batch, read
    assert _dataloader.undelivered(iterator) == [[4, 5, 6, 7]]  # drawn, not delivered
    rest = _dataloader.take_index_stream(iterator)
    assert next(iterator)[:, 0].tolist() == [4, 5, 6, 7]  # what it drew, then nothing more
    with pytest.raises(StopIteration):
        next(iterator)
    assert next(rest) == [8, 9, 10, 11]
    pool.shutdown()


@pytest.mark.parametrize("hold, read", [
    (lambda batch: batch, lambda held: held),
    (lambda batch: batch[1:], lambda held: held),
    (lambda batch: batch.numpy(), torch.from_numpy),
    (lambda batch: memoryview(batch.numpy()), lambda held: torch.from_numpy(np.asarray(held))),
    (lambda batch: batch.untyped_storage(), lambda held: torch.empty(0).set_(held)),
], ids=["tensor", "view", "array", "memoryview", "storage"])
def test_a_batchs_memory_is_used_again_only_once_nothing_refers_to_it(hold, read):
    """The training process keeps the memory of the batches the sample store reads for later ones (fresh memory
    faults on each page): never while anything made from a batch is still held."""
    buffers = _dataloader.BatchBuffers()
    batch = buffers.tensor(4, torch.float32, (8,))
    memory = batch.data_ptr()
    held = hold(batch.fill_(7.0))
    del batch
    other = buffers.tensor(4, torch.float32, (8,))
    assert other.data_ptr() != memory
    other.fill_(0.0)
    assert bool((read(held) == 7.0).all())
    del held, other
    elsewhere = [torch.empty(4, 8) for _ in range(4)]  # memory freed meanwhile goes to these
    assert buffers.tensor(4, torch.float32, (8,)).data_ptr() == memory  # kept, and nothing refers to it any more
    assert all(t.data_ptr() != memory for t in elsewhere)


def test_the_row_collate_stacks_items_it_did_not_read_as_torch_does_views_of_0_d_tensors_too():
    """Items a reading loader made itself (a miss) reach ``collate_rows`` as the user's dataset made them: a view of
    a 0-d tensor (``(x @ w).unsqueeze(0)``) has a base with no rows, and is stacked as torch's collate does."""
    items = [(torch.full((3,), float(i)), (torch.arange(3.0) @ torch.full((3,), float(i))).unsqueeze(0))
             for i in range(4)]
    assert items[0][1]._base is not None and items[0][1]._base.dim() == 0
    for got, want in zip(_dataloader.collate_rows(items), torch.utils.data.default_collate(items)):
        assert torch.equal(got, want) and got.shape == want.shape
