"""Every torch DataLoader internal pipeopt relies on that is not a public API, in one module (tested with torch 2.13
and 2.14): how a running iterator hands over its remaining indices (and whether their order is decided already, and
which it dispatched and did not deliver), stops, counts its ready batches, how its workers' deaths reach pipeopt
instead of the main thread, how its default collate makes a batch, and when a batch's memory is free to be used
again. A torch upgrade that renames one breaks this file only.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

#: Messages torch's DataLoader machinery raises when workers die, hang or run out of shared memory - as opposed to
#: an exception raised by the user's dataset, which must surface unchanged.
WORKER_FAILURE_MARKERS = (
    "DataLoader worker (pid",
    "DataLoader timed out after",
    "Pin memory thread exited unexpectedly",
)
SHM_MARKERS = ("/torch_", "shared memory", "No space left on device")


def is_worker_failure(err: BaseException) -> bool:
    msg = str(err)
    if not isinstance(err, RuntimeError):
        return False
    if any(marker in msg for marker in WORKER_FAILURE_MARKERS):
        return True
    return "in DataLoader worker" in msg and any(marker in msg for marker in SHM_MARKERS)


def take_index_stream(iterator: Any) -> Any:
    """Detach the main-process index stream from a running DataLoader iterator.

    Returns the iterator over the epoch's remaining (batches of) indices. The DataLoader iterator keeps what it
    already dispatched to its workers, delivers it, and then stops.
    """
    if hasattr(iterator, "take_index_stream"):  # pipeopt's own iterators (apply/batch.py's Recut, DALI's)
        return iterator.take_index_stream()
    stream = iterator._sampler_iter
    iterator._sampler_iter = iter(())
    return stream


def give_index_stream(iterator: Any, stream: Iterator[Any]) -> None:
    """Have a running torch DataLoader iterator dispatch from ``stream`` (the one ``take_index_stream`` took from it,
    wrapped): what it dispatches from then on, the stream knows."""
    if hasattr(iterator, "give_index_stream"):  # pipeopt's own (DALI's)
        iterator.give_index_stream(stream)
    else:
        iterator._sampler_iter = stream


def order_fixed(iterator: Any) -> bool:
    """Whether a running DataLoader iterator's epoch is decided once its first index is drawn (``index_stream_begun``),
    so that reading its index stream ahead from then on changes nothing: torch's own (batch) samplers, exactly -
    ``RandomSampler`` on a generator of its own (seeded when the epoch's first index is drawn; a generator of the
    user's would be drawn from earlier than without pipeopt), ``SequentialSampler``, ``DistributedSampler`` - under
    torch's ``BatchSampler`` or none. A sampler of the user's may decide as it goes: it is never read ahead."""
    from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

    index_sampler = getattr(iterator, "_index_sampler", None)
    sampler = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    if type(sampler) is RandomSampler:
        return sampler.generator is None
    return type(sampler) in (SequentialSampler, DistributedSampler)


def index_stream_begun(stream: Any) -> bool:
    """Whether the epoch's first index was drawn from an index stream ``take_index_stream`` gave (torch's samplers
    yield from generators, which draw nothing before their first index)."""
    return not inspect.isgenerator(stream) or inspect.getgeneratorstate(stream) != inspect.GEN_CREATED


def epoch_positions(iterator: Any) -> list[int] | None:
    """Every position a running DataLoader iterator's epoch draws (in no particular order), for the samplers of
    ``order_fixed`` that draw each position once; None for the others (``RandomSampler`` with replacement or
    another ``num_samples``)."""
    from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

    index_sampler = getattr(iterator, "_index_sampler", None)
    sampler: Any = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    if type(sampler) is DistributedSampler:  # its order is a function of its seed and epoch: read again, unchanged
        return list(iter(sampler))
    length = len(sampler)  # SequentialSampler: the dataset's; RandomSampler: its num_samples
    if type(sampler) is RandomSampler and (sampler.replacement or length != len(iterator._dataset)):
        return None
    return list(range(length))


def shutdown_iterator(iterator: Any) -> None:
    """Stop a DataLoader iterator's workers now (also for persistent workers, which otherwise wait for reuse). Their
    exits are expected: torch's SIGCHLD watch leaves them first, so that one found dead (a failure already raised)
    does not raise again, wherever the main thread is then."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        detach_worker_watch(iterator)
        shutdown()


def undelivered(iterator: Any) -> list[Any] | None:
    """The (batches of) indices a running DataLoader iterator dispatched in its epoch and has not delivered yet, in
    order, where its (batch) sampler remembers them (pipeopt's ``ResumingSampler.undelivered``); None otherwise."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    if callable(getattr(iterator, "undelivered", None)):  # pipeopt's own (DALI's)
        return iterator.undelivered()
    remembered = getattr(getattr(iterator, "_index_sampler", None), "undelivered", None)
    if not isinstance(iterator, _BaseDataLoaderIter) or not callable(remembered):
        return None
    return remembered(iterator._num_yielded)


def stoppable(iterator: Any) -> bool:
    """A torch DataLoader iterator, in the main process or with workers (``stop_workers`` applies)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    return isinstance(iterator, _BaseDataLoaderIter)


def stop_workers(iterator: Any) -> None:
    """Tell a DataLoader iterator's workers to end, without waiting for them, as torch's shutdown does: each skips
    the tasks still queued for it, finishes the one in hand (no user code is cut short) and exits. What it
    dispatched and did not deliver is never delivered. ``shutdown_iterator``, later, finds them gone."""
    workers = getattr(iterator, "_workers", None)
    if not workers or getattr(iterator, "_shutdown", True):
        return
    detach_worker_watch(iterator)  # their exit is not a death to report
    pin_done = getattr(iterator, "_pin_memory_thread_done_event", None)
    if pin_done is not None:
        pin_done.set()
    iterator._workers_done_event.set()
    for worker_id, active in enumerate(iterator._workers_status):
        if active or iterator._persistent_workers:
            iterator._mark_worker_as_unavailable(worker_id, shutdown=True)  # the end-of-work signal, None


def kill_workers(iterator: Any) -> None:
    """Terminate a failed DataLoader iterator's live workers at once, and shut the iterator down around them.

    torch's own shutdown joins each worker with a 5 s timeout before terminating it, so a trial whose workers hang
    would cost 5 s per worker; its batches are re-fed from the index stream, so nothing a worker held is needed.
    The workers leave torch's SIGCHLD watch first (otherwise their termination raises "worker killed" in the main
    thread, wherever it then is), and torch's shutdown is not run after them: it sets an event shared with the
    workers, whose lock a worker killed inside it still holds - the main process then waits forever.
    """
    detach_worker_watch(iterator)
    workers = getattr(iterator, "_workers", ())
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(timeout=1.0)
    if getattr(iterator, "_shutdown", True):  # single-process, or already shut down
        return
    iterator._shutdown = True
    pin_done = getattr(iterator, "_pin_memory_thread_done_event", None)
    if pin_done is not None:
        pin_done.set()  # the pin-memory thread (a daemon) sees it within its poll interval and ends
    for queue in getattr(iterator, "_index_queues", ()):  # as torch's shutdown does: its feeder thread ends
        queue.cancel_join_thread()
        queue.close()


def cached_iterator(loader: Any) -> Any:
    """The iterator a loader with persistent workers keeps for its next epoch (None otherwise)."""
    return getattr(loader, "_iterator", None)


def forget_cached_iterator(loader: Any, iterator: Any) -> None:
    """A loader with persistent workers caches its iterator for reuse; drop it once its workers are gone."""
    if getattr(loader, "_iterator", None) is iterator:
        loader._iterator = None


def set_fetch_timeout(iterator: Any, seconds: float) -> None:
    """Change how long a running iterator waits for a batch before raising (0: forever)."""
    if hasattr(iterator, "_timeout"):
        iterator._timeout = seconds


@contextlib.contextmanager
def quiet_worker_deaths() -> Iterator[None]:
    """Start a trial loader without torch's SIGCHLD handler raising for it.

    torch registers a new iterator's workers with its SIGCHLD handler before they start, and the handler raises
    in the main thread - anywhere - when one dies. A trial's worker that dies at once would then escape
    pipeopt. Inside this block the handler is paused; ``detach_worker_watch`` then removes the workers from its
    watch, and a death is reported by ``next()`` instead.
    """
    import signal
    import threading

    from torch.utils.data._utils import signal_handling

    if not hasattr(signal, "SIGCHLD") or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal_handling._set_SIGCHLD_handler()  # install torch's handler now, so it is the one restored below
    handler = signal.getsignal(signal.SIGCHLD)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, handler)


def detach_worker_watch(iterator: Any) -> None:
    """Stop torch's SIGCHLD handler from raising for this iterator's workers anywhere in the main thread.

    A dead worker of a trial is then reported where pipeopt can survive it: in ``next()`` on the iterator.
    """
    if getattr(iterator, "_worker_pids_set", False):
        import torch

        torch._C._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False


def attach_worker_watch(iterator: Any) -> None:
    """Undo ``detach_worker_watch`` (for the iterator that the run keeps)."""
    workers = getattr(iterator, "_workers", None)
    if workers and not getattr(iterator, "_worker_pids_set", True):
        import torch

        torch._C._set_worker_pids(id(iterator), tuple(w.pid for w in workers))
        iterator._worker_pids_set = True


def ready_batches(iterator: Any) -> int | None:
    """Batches a DataLoader iterator's workers have finished that the training loop has not taken yet: results in
    its queues (a worker's result counts from the moment it is put) plus results that arrived out of order and wait
    in ``_task_info``. 0 for a single-process iterator; None where torch's queues cannot be counted. pipeopt's own
    iterators (DALI's) count their own."""
    if callable(getattr(iterator, "ready_batches", None)):
        return iterator.ready_batches()
    if not hasattr(iterator, "_worker_result_queue"):
        return 0 if hasattr(iterator, "_sampler_iter") else None
    try:
        ready = iterator._worker_result_queue.qsize()
        data_queue = getattr(iterator, "_data_queue", None)
        if data_queue is not None and data_queue is not iterator._worker_result_queue:
            ready += data_queue.qsize()  # pin-memory thread: pinned results wait in a second queue
    except (NotImplementedError, OSError, AttributeError):  # qsize() is not implemented on macOS
        return None
    return ready + sum(1 for info in getattr(iterator, "_task_info", {}).values() if len(info) == 2)


# -- batches made as torch's default collate makes them ----------------------------------------------------------
def is_default_collate(collate_fn: Any) -> bool:
    """``collate_fn`` is torch's ``default_collate`` (what a DataLoader given none uses)."""
    from torch.utils.data._utils.collate import default_collate

    return collate_fn is default_collate


class _Kept:
    """A batch tensor's memory kept by ``BatchBuffers``: its storage object, a tensor over all of it whose aliases are
    the batches handed out, and what Python counts of that storage object while only the pool refers to it (read when
    it is made: torch's own references to it are counted too)."""

    __slots__ = ("storage", "whole", "alone")

    def __init__(self, whole: Any) -> None:
        self.storage, self.whole = whole.untyped_storage(), whole
        self.alone = sys.getrefcount(self.storage)


class BatchBuffers:
    """Batch tensors made in the training process whose memory is kept, and used again for a later batch of the
    same shape once nothing but this pool holds it.

    A fresh batch tensor of a few MB is memory the process has not touched yet: each of its 4 KB pages faults on
    its first write. In a training loop, reading a batch of 32 whole 150 KB items from the store into fresh memory
    took ~4 ms and ~1,000 page faults; into memory used before, ~1.3 ms and none. Each batch is a new tensor object
    on a kept buffer - an alias of a tensor the pool keeps over all of it (``detach()``: no autograd history, no
    ``_base``; one call, where making a tensor on a storage took ~0.03 ms of a fit's training thread) - so that the
    rows ``collate_rows`` finds are rows of that tensor. A buffer is taken again only when nothing but the pool
    refers to it any more - no tensor, view, array or storage object made from a batch (torch's count of its
    storage's owners, and Python's of the storage object): a batch the user's code keeps is never written over.
    ``kept`` buffers of each shape, of the ``sizes`` shapes used last, at most; one more in use gets memory of its
    own, as before."""

    def __init__(self, kept: int = 4, sizes: int = 2) -> None:
        self.kept, self.sizes = kept, sizes
        self._buffers: dict[tuple[Any, ...], list[_Kept]] = {}  # (rows, dtype, shape) -> kept, the last used at the end

    def tensor(self, rows: int, dtype: Any, shape: tuple[int, ...]) -> Any:
        """An empty tensor of ``rows`` x ``shape`` for a batch: in shared memory inside a loader worker (as torch's
        default collate makes it there, so that handing it to the main process copies nothing); else on a kept
        buffer that is free, where torch can tell."""
        import torch
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            return _shared_tensor(rows, dtype, shape)
        kept = self._free((rows, dtype, tuple(shape)))
        return torch.empty((rows, *shape), dtype=dtype) if kept is None else kept.whole.detach()

    def _free(self, key: tuple[Any, ...]) -> _Kept | None:
        import torch

        owners = getattr(torch._C, "_storage_Use_Count", None)
        if owners is None or not key[0] or 0 in key[2]:  # a torch without the count, or no memory: a batch of its own
            return None
        kept = self._buffers.pop(key, [])
        self._buffers[key] = kept  # now the shape used last
        while len(self._buffers) > self.sizes:
            del self._buffers[next(iter(self._buffers))]
        for buffer in kept:
            # free: the pool's storage object and its tensor are torch's only owners of it, and nothing but the pool
            # refers to that object
            if owners(buffer.storage._cdata) == 2 and sys.getrefcount(buffer.storage) == buffer.alone:
                return buffer
        if len(kept) < self.kept:
            rows, dtype, shape = key
            with torch.inference_mode(False):  # a batch read under inference mode (validation) trains later too
                whole = torch.empty((rows, *shape), dtype=dtype)
            kept.append(_Kept(whole))
            return kept[-1]
        return None

    def clear(self) -> None:
        self._buffers.clear()


def _shared_tensor(rows: int, dtype: Any, shape: tuple[int, ...]) -> Any:
    """An empty tensor of ``rows`` x ``shape`` in shared memory, as torch's default collate makes a batch inside a
    loader worker (so that handing it to the main process copies nothing)."""
    import torch

    template = torch.empty(0, dtype=dtype)
    numel = rows * int(torch.Size(shape).numel())
    storage = template._typed_storage()._new_shared(numel, device=template.device)  # as collate_tensor_fn does
    return template.new(storage).resize_(rows, *shape)


def _rows_or_stacked(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """A batch's tensors: when they are rows 0..n-1 of one contiguous tensor, that tensor (what stacking them makes,
    bit for bit, without copying them); otherwise stacked, as torch does."""
    from torch.utils.data._utils.collate import collate_tensor_fn

    base = batch[0]._base
    if base is not None and base.is_contiguous() and base.shape[:1] == (len(batch),):  # (a 0-d base: a view's)
        shape, at, step = base.shape[1:], base.storage_offset(), base.stride(0)
        if all(t._base is base and t.shape == shape and t.storage_offset() == at + row * step
               for row, t in enumerate(batch)):
            return base
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


class Collated(Sequence[Any]):
    """A batch's items, as a dataset's ``__getitems__`` gives them, carrying ``batch``: what ``collate_rows`` makes of
    them, known already to whoever read them (the sample store, which read them into the rows of one tensor).
    ``collate_rows`` hands ``batch`` on without walking the items; anything else that reads them gets them, made on
    first use by ``items`` (the rows as views and their label tuples: ~0.05 ms of the training thread a batch, spent
    for nothing where only ``collate_rows`` sees the batch)."""

    def __init__(self, items: Callable[[], Iterable[Any]], batch: Any, length: int) -> None:
        self._items, self.batch, self._length = items, batch, length
        self._made: list[Any] | None = None

    def _list(self) -> list[Any]:
        if self._made is None:
            self._made = list(self._items())
        return self._made

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i: Any) -> Any:
        return self._list()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._list())


def collate_rows(batch: Any) -> Any:
    """torch's ``default_collate``, except that tensors read straight into the rows of one batch tensor (the sample
    cache's ``SampleStore.get_rows``) are handed on as that tensor: the same batch, bit for bit, without the
    stack's copy - and items that come ``Collated``, as their batch."""
    import torch
    from torch.utils.data._utils.collate import collate, default_collate_fn_map

    if isinstance(batch, Collated):
        return batch.batch
    return collate(batch, collate_fn_map={**default_collate_fn_map, torch.Tensor: _rows_or_stacked})
