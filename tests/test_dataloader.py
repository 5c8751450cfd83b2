"""The torch DataLoader seams (pipeopt._dataloader): ready batches counted, failed workers ended at once."""

import time

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
