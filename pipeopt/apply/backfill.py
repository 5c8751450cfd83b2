"""The store's missing items, made ahead of the epoch that reads them.

Every loader pipeopt builds fills the sample store as it loads. What the user's own loader drew before the store
existed - the fit's first batches, the loader search's window before - is missing from it until the sampler draws
those samples again: in the epoch the cache is tried in, where a loader reading from the store makes each of them in
line with the training step (in the main process: one after another, between steps). A ``Backfill`` makes exactly
the missing ones, once, before that: a DataLoader of its own over their positions, whose worker processes make and
store each item's cached part and send back only the position, consumed by a thread of the main process.

The user's dataset runs there as in pipeopt's other loaders - in worker processes, with the user's
``worker_init_fn`` and multiprocessing context - never beside the training loop in one process. Its workers are
seeded from a private generator, and making an item's cached part draws no random number (the store holds only
what was shown deterministic), so the run's random numbers are untouched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from pipeopt.apply.loader import loader_like
from pipeopt.apply.sample_cache import CachedDataset

#: A worker that delivers nothing for this long is taken as hung: the backfill stops (the items are made when drawn).
TIMEOUT_S = 120.0


class _Fill(Dataset):
    """Item ``k``: make and store the cached part of ``positions[k]``; returns the position only."""

    def __init__(self, cached: CachedDataset, positions: Sequence[int]) -> None:
        self.cached, self.positions = cached, list(positions)

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, k: int) -> int:
        position = self.positions[k]
        self.cached.fill(position)
        return position


def _as_is(position: int) -> int:  # a module-level function: workers started by spawn pickle it
    return position


class Backfill:
    """Makes and stores the cached part of ``positions`` in ``workers`` processes like the user's loader ``like``;
    ``start()`` forks them (call it from the training loop's thread), a thread takes their results. ``what`` the
    positions are and ``when`` they are made, for the report (``describe``)."""

    def __init__(self, cached: CachedDataset, positions: Sequence[int], *, like: DataLoader, workers: int,
                 what: str = "samples the store missed", when: str = "") -> None:
        if workers < 1:
            raise ValueError(f"a backfill makes items in worker processes: workers must be >= 1 (got {workers})")
        self._loader = loader_like(like, dataset=_Fill(cached, positions), sampler=range(len(positions)),
                                   batch_size=None, collate_fn=_as_is, num_workers=workers, pin_memory=False,
                                   prefetch_factor=2, persistent_workers=False, timeout=TIMEOUT_S,
                                   generator=torch.Generator().manual_seed(0))
        self.total, self.workers, self.what, self.when = len(positions), workers, what, when
        self.made = 0  # positions the workers finished
        self.error: BaseException | None = None  # what stopped it early (a worker failed or hung)
        self.started_at: float | None = None  # time.perf_counter() when the workers were started
        self.ended_at: float | None = None  # ... and when the last of them was told to end
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.started_at = time.perf_counter()
        iterator = iter(self._loader)  # forks the workers here, in the caller's thread
        self._thread = threading.Thread(target=self._run, args=(iterator,), name="pipeopt-backfill", daemon=True)
        self._thread.start()

    def _run(self, iterator: Any) -> None:
        try:
            for _ in iterator:
                self.made += 1
                if self._stop.is_set():
                    break
        except Exception as err:  # a worker failed or hung: the rest are made when the sampler draws them
            self.error = err
        finally:
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
            self.ended_at = time.perf_counter()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def describe(self) -> str:
        seconds = (self.ended_at or 0.0) - (self.started_at or 0.0)
        end = "" if self.error is None else \
            f"; it stopped early ({type(self.error).__name__}): the rest are made when the sampler draws them"
        return (f"{self.made} of the {self.total} {self.what} were made ahead of the cache's trials, "
                f"{self.when + ', ' if self.when else ''}"
                f"in {self.workers} worker process(es), in {seconds:.1f} s{end}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the item under way and wait for the workers to end (at most ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
