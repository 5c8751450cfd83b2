"""Reading the next batch from the sample store while the step trains, in a loader with no workers.

A loader that reads whole items from the store in the main process (``num_workers=0``: the cache removed the work
its workers were there for) copies each batch's bytes in the training thread, between two steps: the step waits
for that copy. Here the loader's batch sampler draws one batch of indices ahead (``ReadAhead``), and the dataset
reads that batch in a thread of its own (``IdleReader``) while the step trains; the next fetch takes it when its
indices are the ones asked for, and reads them itself otherwise.

The thread runs below every other thread in the CPUs' order (Linux's ``SCHED_IDLE``): on CPUs the step's intra-op
threads keep busy, it takes only the time they leave, instead of preempting them (measured in scratch on 2 CPUs:
``benchmarks/results/README.md``). Its copies run outside Python's lock (NumPy's), so the training thread is not
held up waiting for it.

Drawing ahead changes nothing the model sees only where the epoch's order is decided at its first index
(``_dataloader.order_fixed``): the build reads ahead for those samplers only. A loader cut mid-epoch
(``_dataloader.take_index_stream``) keeps the batch it drew ahead as dispatched - it delivers it, then stops - as a
loader with workers delivers what it dispatched to them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_END = object()


class _Epoch(Iterator[Any]):
    """One epoch's index batches, one drawn ahead of those handed out (``upcoming``) until ``release()``."""

    def __init__(self, inner: Iterator[Any]) -> None:
        self._inner, self._next, self._ahead = inner, _END, True

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        current = self._next if self._next is not _END else next(self._inner)
        self._next = next(self._inner, _END) if self._ahead else _END
        return current

    def upcoming(self) -> Any:
        """The batch drawn ahead, or None (none left, or released)."""
        return None if self._next is _END else self._next

    def release(self) -> list[Any]:
        """The loader is cut: the batch drawn ahead stays with it (it delivers it next), and this stream reads no
        further ahead - whoever reads it on gets the batches after that one."""
        held, self._next, self._ahead = self._next, _END, False
        return [] if held is _END else [held]


class ReadAhead:
    """A loader's batch sampler that draws each epoch's index batches one ahead of the loader (``inner``: the batch
    sampler it wraps, which Lightning and the handover see through ``sampler`` and ``set_epoch``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._epoch: _Epoch | None = None

    @property
    def sampler(self) -> Any:
        return getattr(self.inner, "sampler", self.inner)

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.inner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        self._epoch = _Epoch(iter(self.inner))
        return self._epoch

    def upcoming(self) -> Any:
        """The next batch the loader will ask its dataset for, when drawn already; else None."""
        return None if self._epoch is None else self._epoch.upcoming()


def _below_everything() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # Linux: 0 is the calling thread
    except (AttributeError, OSError):  # no SCHED_IDLE here: the thread runs at the usual priority
        pass


class IdleReader:
    """One thread of the training process that runs reads submitted to it, at ``SCHED_IDLE`` where there is one;
    started on first use (in the process that uses it: a forked worker never reads ahead), ended by ``stop()``."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def submit(self, read: Callable[..., Any], *args: Any) -> Future[Any]:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pipeopt-read-ahead",
                                                initializer=_below_everything)
                self._pid = os.getpid()
            return self._pool.submit(read, *args)

    def stop(self) -> None:
        """Wait for a read under way, drop those not begun, and end the thread."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True, cancel_futures=True)
