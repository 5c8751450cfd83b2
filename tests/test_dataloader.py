"""The torch DataLoader seams (pipeopt._dataloader): ready batches counted, failed workers ended at once, which
samplers' epochs may be read ahead, batch memory used again."""

import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

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


def test_a_batch_on_kept_memory_is_a_tensor_of_its_own_whatever_the_one_before_it_was_made_into():
    """A later batch on the same memory is a new tensor, without anything the user's code did to the one before
    (autograd flags, attributes) and without a base; memory first kept under inference mode (a validation batch)
    makes batches that train."""
    buffers = _dataloader.BatchBuffers()
    with torch.inference_mode():
        memory = buffers.tensor(4, torch.float32, (8,)).data_ptr()  # read, used and dropped in validation
    first = buffers.tensor(4, torch.float32, (8,))
    assert first.data_ptr() == memory
    first.requires_grad_(True)
    first.note = "the user's"
    del first
    batch = buffers.tensor(4, torch.float32, (8,)).fill_(1.0)
    assert batch.data_ptr() == memory  # the same memory ...
    assert not batch.requires_grad and not hasattr(batch, "note") and batch._base is None and batch.is_leaf
    assert not batch.is_inference()
    weight = torch.ones(8, requires_grad=True)
    (batch * weight).sum().backward()  # saved for backward: an inference tensor could not be
    assert torch.equal(weight.grad, torch.full((8,), 4.0))


def test_the_row_collate_stacks_items_it_did_not_read_as_torch_does_views_of_0_d_tensors_too():
    """Items a reading loader made itself (a miss) reach ``collate_rows`` as the user's dataset made them: a view of
    a 0-d tensor (``(x @ w).unsqueeze(0)``) has a base with no rows, and is stacked as torch's collate does."""
    items = [(torch.full((3,), float(i)), (torch.arange(3.0) @ torch.full((3,), float(i))).unsqueeze(0))
             for i in range(4)]
    assert items[0][1]._base is not None and items[0][1]._base.dim() == 0
    for got, want in zip(_dataloader.collate_rows(items), torch.utils.data.default_collate(items)):
        assert torch.equal(got, want) and got.shape == want.shape
