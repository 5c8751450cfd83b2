"""Making the store's missing items ahead: exactly those, in worker processes like the user's loader's, equal to the
dataset's bit for bit, the run's random numbers untouched; a failing item or a stop ends it cleanly."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from pipeopt.apply.backfill import Backfill
from pipeopt.apply.sample_cache import SampleCache, plan
from pipeopt.apply.sample_store import SampleStore, decode, encode


class Items(Dataset):
    """Deterministic items that say which process made them (by a marker file: workers have their own copies)."""

    def __init__(self, n: int = 40, marks=None, delay_s: float = 0.0, bad: int | None = None) -> None:
        self.n, self.marks, self.delay_s, self.bad = n, marks, delay_s, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.bad:
            raise OSError(f"cannot read item {i}")
        if self.marks is not None:
            (self.marks / f"{i}-{os.getpid()}").touch()
        time.sleep(self.delay_s)
        return torch.full((3,), float(i)), i % 5


def _mark_worker(worker_id: int) -> None:  # the user's worker_init_fn: runs in each backfill worker
    (torch.utils.data.get_worker_info().dataset.cached.split.dataset.marks / f"init-{worker_id}").touch()


def _cache(tmp_path, dataset) -> SampleCache:
    split = plan(dataset)
    return SampleCache(split, SampleStore(tmp_path / "store", len(split), 1 << 20))


def _finish(job: Backfill, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while job.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not job.running


def test_the_missing_positions_are_made_in_worker_processes_and_stored_bit_for_bit(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    dataset = Items(marks=marks)
    cache = _cache(tmp_path, dataset)
    reader = cache.dataset(read=True)
    for i in range(0, 40, 2):  # the even positions are stored; the odd ones miss
        reader[i]
    assert cache.store.missing() == list(range(1, 40, 2))
    for f in marks.iterdir():
        f.unlink()
    rng = torch.get_rng_state()
    like = DataLoader(dataset, batch_size=4, worker_init_fn=_mark_worker)
    job = Backfill(cache.dataset(read=False), cache.store.missing(), like=like, workers=2)
    job.start()
    _finish(job)
    assert job.error is None and job.made == 20 and cache.store.missing() == []
    made = sorted(f.name for f in marks.iterdir())
    assert [m for m in made if m.startswith("init-")] == ["init-0", "init-1"]  # the user's worker_init_fn ran
    makers = {m.split("-")[1] for m in made if not m.startswith("init-")}
    assert sorted(int(m.split("-")[0]) for m in made if not m.startswith("init-")) == list(range(1, 40, 2))
    assert str(os.getpid()) not in makers  # made in worker processes, not beside the training loop
    for i in range(40):
        assert cache.store.get(i) == encode(dataset[i])
        assert torch.equal(decode(cache.store.get(i))[0], dataset[i][0])
    assert torch.equal(torch.get_rng_state(), rng)  # the run's random numbers are untouched
    assert "20 of the 20 samples" in job.describe() and "2 worker process(es)" in job.describe()
    assert psutil.Process().children() == []
    cache.close()


def test_an_item_that_fails_stops_the_backfill_and_is_recorded(tmp_path):
    dataset = Items(bad=7)
    cache = _cache(tmp_path, dataset)
    job = Backfill(cache.dataset(read=False), list(range(10)), like=DataLoader(dataset), workers=1)
    job.start()
    _finish(job)
    assert isinstance(job.error, Exception) and "cannot read item 7" in str(job.error)
    assert "stopped early" in job.describe()
    assert 7 in cache.store.missing() and all(cache.store.has(i) for i in range(7))  # made up to the failure
    assert psutil.Process().children() == []
    cache.close()


def test_closing_the_cache_stops_a_backfill_under_way_and_its_workers(tmp_path):
    dataset = Items(n=400, delay_s=0.02)
    cache = _cache(tmp_path, dataset)
    job = Backfill(cache.dataset(read=False), list(range(400)), like=DataLoader(dataset), workers=2)
    job.start()
    cache.on_close.append(job.stop)
    time.sleep(0.3)
    cache.close()  # what a fit's end does: the backfill stops first, then the store goes
    assert not job.running and job.made < 400
    assert psutil.Process().children() == [] and not (tmp_path / "store").exists()


def test_a_backfill_needs_a_worker_process(tmp_path):
    cache = _cache(tmp_path, Items())
    with pytest.raises(ValueError, match="workers must be >= 1"):
        Backfill(cache.dataset(read=False), [1, 2], like=DataLoader(Items()), workers=0)
    cache.close()
