"""The epoch's stream of sample indices, kept in the main process and handed from one loader to the next.

A DataLoader's order is decided in the main process: its (batch) sampler yields index batches, workers only
turn indices into samples. Handing the *same* index iterator to a new loader therefore continues the epoch
exactly where it was - same samples, same order, each once - whatever the new loader's worker settings.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from pipeopt import _dataloader


class IndexStream(Iterator[Any]):
    """Index batches handed out once each. Those handed to a loader whose workers then failed (dispatched, never
    delivered) are handed out again, first and in order, by ``recover()``. ``read_ahead``: the source's order is
    decided once its first index is drawn (``_dataloader.order_fixed``) - from then on ``ahead()`` reads the rest,
    and knows what is still to come."""

    def __init__(self, source: Iterable[Any], *, read_ahead: bool = False, in_flight: Iterable[Any] = ()) -> None:
        self._source: Iterator[Any] = iter(source)
        self._read_ahead = read_ahead
        self._rest: collections.deque[Any] | None = None  # the source, read ahead
        self._returned: collections.deque[Any] = collections.deque()
        # dispatched, not yet delivered: ``in_flight``, those the loader it was taken from dispatched before
        self._in_flight: collections.deque[Any] = collections.deque(in_flight)
        self.epoch_over = False  # its epoch ended: a loader that never started on it begins with its own epoch

    def __iter__(self) -> IndexStream:
        return self

    def __next__(self) -> Any:
        if self._returned:
            item = self._returned.popleft()
        elif self._rest is not None:
            if not self._rest:
                raise StopIteration
            item = self._rest.popleft()
        else:
            item = next(self._source)
        self._in_flight.append(item)
        return item

    def ahead(self) -> list[int] | None:
        """The sample positions not yet delivered - dispatched, handed back or still to come - or None where the
        source may not be read ahead (or not yet: its epoch's first index is still to be drawn)."""
        if self._rest is None:
            if not self._read_ahead or not _dataloader.index_stream_begun(self._source):
                return None
            self._rest, self._source = collections.deque(self._source), iter(())
        positions: list[int] = []
        for batch in (*self._in_flight, *self._returned, *self._rest):
            positions.extend(batch if isinstance(batch, (list, tuple)) else [batch])
        return positions

    def delivered(self) -> None:
        """The oldest dispatched batch reached the training loop (loaders deliver in dispatch order)."""
        self._in_flight.popleft()

    def recover(self) -> int:
        """Put every dispatched-but-undelivered batch back in front of the stream; returns how many."""
        n = len(self._in_flight)
        self._returned.extendleft(reversed(self._in_flight))
        self._in_flight.clear()
        return n

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)


class ResumingSampler:
    """A loader's (batch) sampler that first finishes an epoch already under way, then is the user's sampler.

    ``before_epoch`` runs at the start of every later epoch: it makes the random draw the user's own loader
    would have made when creating its iterator, so the user's RNG stream is the same as without pipeopt.
    It remembers the last ``remember`` (batches of) indices it gave in the running epoch (the most its loader may
    hold undelivered), so that what its loader dispatched and did not deliver can be handed to another
    (``undelivered``).
    """

    def __init__(self, inner: Any, first: Iterator[Any] | None, before_epoch: Callable[[], None] | None,
                 *, remember: int = 0) -> None:
        self.inner = inner
        self._first = first
        self._before_epoch = before_epoch
        self._given: collections.deque[Any] = collections.deque(maxlen=remember)
        self._count = 0  # given in the running epoch

    def undelivered(self, delivered: int) -> list[Any] | None:
        """What it gave in the running epoch after the first ``delivered``, in order; None when it does not remember
        them all."""
        left = self._count - delivered
        if left < 0 or left > len(self._given) or (left and not self._given.maxlen):
            return None
        return list(self._given)[len(self._given) - left:]

    @property
    def sampler(self) -> Any:
        """The user's sampler, where Lightning looks for ``set_epoch`` (a ``DistributedSampler`` included)."""
        return getattr(self.inner, "sampler", self.inner)

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.inner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        # Lazy: DataLoader iterators call iter() on their sampler more than once while starting and discard
        # all but the last result, so nothing may happen until the first index is asked for.
        return self._epoch()

    def _epoch(self) -> Iterator[Any]:
        self._given.clear()
        self._count = 0
        for item in self._indices():
            self._given.append(item)
            self._count += 1
            yield item

    def _indices(self) -> Iterator[Any]:
        first, self._first = self._first, None
        # A loader switched in at an epoch's last step is first asked for indices in the next epoch: that epoch
        # is its own, not the (empty) rest of the one that ended
        if first is not None and not getattr(first, "epoch_over", False):
            yield from first
            return
        if self._before_epoch is not None:
            self._before_epoch()
        yield from self.inner


def peek_seed(generator: torch.Generator | None) -> int:
    """The next int64 the generator (the global one when None) would give, without advancing it."""
    if generator is None:
        state = torch.get_rng_state()
        try:
            return int(torch.empty((), dtype=torch.int64).random_().item())
        finally:
            torch.set_rng_state(state)
    state = generator.get_state()
    try:
        return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    finally:
        generator.set_state(state)


def draws_each_epoch(loader: Any) -> bool:
    """Whether ``loader`` draws from its generator (the global one when None) each time it makes an iterator -
    every epoch, as torch's DataLoader does unless its workers persist."""
    return not (loader.persistent_workers and loader.num_workers > 0)


def draw_seed(generator: torch.Generator | None) -> int:
    """Draw an int64 exactly as a DataLoader iterator draws its workers' base seed."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
