"""One epoch's batches from a chain of loaders: what the old one dispatched, then the new one, surviving failures."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pipeopt import _dataloader
from pipeopt.apply.index_stream import IndexStream


class LoaderFailure(RuntimeError):
    """A loader pipeopt started failed in its own machinery (not in the user's code): the handover falls back."""


@dataclass
class _Source:
    iterator: Iterator[Any]
    loader: Any  # the DataLoader it came from
    tracked: bool  # its batches were dispatched from the shared IndexStream (so it is pipeopt's)
    counted: bool  # its undelivered batches are in the stream's in-flight ones (``delivered`` as it delivers)
    guarded: bool  # a failure of its loader machinery falls back (a trial's; not the fallback's own)


class Handover(Iterator[Any]):
    """Replaces the running epoch's loader iterator.

    Sources are read in order; each one's index supply is cut before the next is added, so a source delivers
    exactly what it was given and stops. When one of pipeopt's sources fails in the loader machinery (a worker
    died, hung past the timeout, ran out of shared memory; a ``LoaderFailure``, such as a DALI pipeline's), its
    undelivered batches go back into the stream and ``fallback(error)`` supplies a loader iterator that continues
    with them: no batch is lost or repeated. Anything else - an exception from the user's dataset included, and a
    failure of the fallback's own loader (the settings known to work: as the user's would without pipeopt) -
    propagates unchanged. ``first_counted``: the stream's in-flight batches begin with those ``first`` dispatched
    and did not deliver yet (``take_back`` may hand them on). ``first_tracked``: ``first`` dispatches from the
    stream from now on (``_dataloader.give_index_stream``), and its failures fall back as an added source's do.
    """

    def __init__(self, stream: IndexStream, first: Iterator[Any], first_loader: Any,
                 fallback: Callable[[BaseException], tuple[Iterator[Any], Any]], *,
                 first_counted: bool = False, first_tracked: bool = False) -> None:
        self.stream = stream
        self._fallback = fallback
        self._sources = collections.deque([_Source(first, first_loader, first_tracked, first_counted, first_tracked)])
        self._stopping: list[_Source] = []  # taken back from: their workers end on their own, joined at close

    def add(self, iterator: Iterator[Any], loader: Any) -> None:
        """Continue with ``iterator`` (fed from ``self.stream``) once the current sources are drained."""
        self._cut_tail()
        self._sources.append(_Source(iterator, loader, tracked=True, counted=True, guarded=True))

    def take_back(self) -> bool:
        """Before ``add``: the batches the sources dispatched and did not deliver go back in front of the stream, to
        be made by the loader added next - where every source is a DataLoader iterator whose undelivered batches
        the stream knows (otherwise nothing changes: False). Their workers are told to end, without waiting for
        the one batch each has in hand; what they finish is dropped. The training loop then waits for the new
        loader, not for the old one's batches at its pace (a switch to a warm sample store: hundreds of batches
        of slow storage in flight)."""
        if not all(s.counted and _dataloader.stoppable(s.iterator) for s in self._sources):
            return False
        self._cut_tail()
        while self._sources:
            source = self._sources.popleft()
            _dataloader.stop_workers(source.iterator)
            self._stopping.append(source)
        self.stream.recover()
        return True

    def _cut_tail(self) -> None:
        if self._sources and self._sources[-1].tracked:
            _dataloader.take_index_stream(self._sources[-1].iterator)

    @property
    def current(self) -> tuple[Iterator[Any], Any]:
        tail = self._sources[-1]
        return tail.iterator, tail.loader

    def ready_batches(self) -> int | None:
        """Finished batches waiting in all sources (None if any source's cannot be counted)."""
        counts = [_dataloader.ready_batches(s.iterator) for s in self._sources]
        known = [c for c in counts if c is not None]
        return sum(known) if len(known) == len(counts) else None

    def __iter__(self) -> Handover:
        return self

    def __next__(self) -> Any:
        while self._sources:
            source = self._sources[0]
            try:
                batch = next(source.iterator)
            except StopIteration:
                if len(self._sources) == 1:
                    raise
                self._sources.popleft()
                self._release(source)
                continue
            except RuntimeError as err:
                if not (source.guarded and (isinstance(err, LoaderFailure) or _dataloader.is_worker_failure(err))):
                    raise
                self._recover(err)
                continue
            if source.counted:
                self.stream.delivered()
            return batch
        raise StopIteration

    def _recover(self, err: BaseException) -> None:
        for source in [s for s in self._sources if s.tracked]:
            self._sources.remove(source)
            # failed: no graceful join (a hung worker would cost seconds each)
            _dataloader.kill_workers(source.iterator)
            self._release(source)
        self.stream.recover()
        iterator, loader = self._fallback(err)  # known to work: a failure of its own is the user's, as without pipeopt
        self._sources.append(_Source(iterator, loader, tracked=True, counted=True, guarded=False))

    @staticmethod
    def _release(source: _Source) -> None:
        _dataloader.shutdown_iterator(source.iterator)
        _dataloader.forget_cached_iterator(source.loader, source.iterator)

    def close(self, keep: Any = None) -> None:
        """Shut down every source's workers, except the iterator ``keep`` (still in use by the next epoch)."""
        self._sources.extend(self._stopping)
        self._stopping.clear()
        while self._sources:
            source = self._sources.popleft()
            if source.iterator is not keep:
                self._release(source)
