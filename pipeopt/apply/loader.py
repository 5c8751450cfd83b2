"""Putting DataLoader settings into effect on a running fit, mid-epoch, without changing what the model sees.

``LoaderSwitcher.switch(settings)``:
1. detaches the running epoch's index stream from the live loader iterator (it delivers what it already
   dispatched, then stops),
2. builds a ``torch.utils.data.DataLoader`` with the user's dataset, collate function, worker init, ... and the
   new settings, whose sampler first continues that stream and, from the next epoch on, is the user's own
   (batch) sampler object - a ``DistributedSampler`` included,
3. installs it: the live epoch continues through a ``Handover`` iterator; later epochs use the new loader.

The user's torch RNG stream is left as it would be without pipeopt: iterators pipeopt starts draw from a
private generator (seeded from a peek at the user's), and at each later epoch the sampler makes the one draw
the user's own loader would have made creating its iterator.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import torch
from torch.utils.data import DataLoader, IterableDataset

from pipeopt import _dataloader, _lightning
from pipeopt.apply.handover import Handover
from pipeopt.apply.index_stream import IndexStream, ResumingSampler, draw_seed, draws_each_epoch, peek_seed
from pipeopt.apply.sample_cache import CachedDataset, SampleCache
from pipeopt.tuning.loader_search import LoaderSettings

_INIT_PARAMS = frozenset(inspect.signature(DataLoader.__init__).parameters)
#: How far below the training process's CPU priority the workers of a loader that gives way run (``os.nice``).
WORKER_NICENESS = 10


class GiveWay:
    """The ``worker_init_fn`` of a loader whose workers give way to the training process (settings with
    ``give_way``, a candidate pipeopt measures): each worker lowers its own CPU priority
    (``os.nice(WORKER_NICENESS)``), then runs ``worker_init_fn`` (the user's) when given.

    Where the CPUs are oversubscribed, the training step's intra-op threads then run as soon as they can instead of
    waiting out the workers' time slices - a parallel region is only as fast as its last preempted thread - and the
    workers take the CPU time the step leaves idle. What the workers make, and the random numbers they draw, are
    unchanged."""

    def __init__(self, worker_init_fn: Callable[[int], None] | None = None) -> None:
        self.worker_init_fn = worker_init_fn

    def __call__(self, worker_id: int) -> None:
        try:
            os.nice(WORKER_NICENESS)
        except (AttributeError, OSError):  # no os.nice on this platform: the worker runs at the usual priority
            pass
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)


class SwitchedLoader(DataLoader):
    """The DataLoader ``build_loader`` makes: torch's, except that an iterator the training loop starts from it (each
    new epoch) is made through ``on_epoch`` when set - the switcher's, which guards a trial's from its first batch."""

    on_epoch: Callable[[Callable[[], Any], DataLoader], Iterator[Any]] | None = None

    def __iter__(self) -> Any:
        return super().__iter__() if self.on_epoch is None else self.on_epoch(super().__iter__, self)


def is_plain(loader: Any) -> bool:
    """A ``torch.utils.data.DataLoader`` itself, the user's or one pipeopt built (not a subclass of the user's)."""
    return type(loader) in (DataLoader, SwitchedLoader)


def unsupported(loader: Any) -> str | None:
    """Why pipeopt cannot switch this loader mid-epoch (None when it can)."""
    if not is_plain(loader):
        return (f"the train loader is a {type(loader).__name__}, not a torch.utils.data.DataLoader; pipeopt "
                "rebuilds only plain DataLoaders")
    if isinstance(loader.dataset, IterableDataset):
        return "the dataset is an IterableDataset: it has no sampler position to hand over mid-epoch"
    if not getattr(loader, "in_order", True):
        return "the loader uses in_order=False: batches arrive out of order, so no handover can keep the order"
    return None


def loader_like(user: DataLoader, *, cls: type[DataLoader] = DataLoader, **changes: Any) -> DataLoader:
    """A ``cls`` (a ``torch.utils.data.DataLoader``) with ``user``'s dataset, collate function, worker init,
    generator, timeout, worker and pinning settings, except ``changes`` - which must say how batches are drawn
    (``batch_sampler=``, or ``sampler=`` with ``batch_size=None``)."""
    kwargs: dict[str, Any] = {
        "dataset": user.dataset,
        "num_workers": user.num_workers,
        "collate_fn": user.collate_fn,
        "pin_memory": user.pin_memory,
        "timeout": user.timeout,
        "worker_init_fn": user.worker_init_fn,
        "generator": user.generator,
        "prefetch_factor": user.prefetch_factor,
        "persistent_workers": user.persistent_workers,
        "pin_memory_device": getattr(user, "pin_memory_device", ""),
        "in_order": getattr(user, "in_order", True),
        "multiprocessing_context": user.multiprocessing_context,
        **changes,
    }
    if kwargs["num_workers"] == 0:  # torch refuses these without workers
        kwargs.update(prefetch_factor=None, persistent_workers=False, multiprocessing_context=None)
    return cls(**{k: v for k, v in kwargs.items() if k in _INIT_PARAMS})


def build_loader(
    user: DataLoader,
    settings: LoaderSettings,
    *,
    first: Iterator[Any] | None,
    before_epoch: Callable[[], None] | None,
    generator: torch.Generator,
    timeout: float | None = None,
    dataset: Any = None,
) -> SwitchedLoader:
    """A DataLoader like ``user`` with ``settings``, continuing ``first`` before its own epochs; reading ``dataset``
    (the user's, wrapped by the sample cache) instead of the user's when given - with ``collate_rows`` for torch's
    default collate where that dataset reads batches straight into their rows."""
    remember = settings.in_flight  # what the loader may hold undelivered: a switch may take it back
    if user.batch_sampler is not None:
        drawn: dict[str, Any] = {"batch_sampler": ResumingSampler(user.batch_sampler, first, before_epoch,
                                                                  remember=remember)}
    else:  # no automatic batching: the sampler yields single indices
        drawn = {"sampler": ResumingSampler(user.sampler, first, before_epoch, remember=remember), "batch_size": None}
    return cast(SwitchedLoader, loader_like(
        user,
        cls=SwitchedLoader,
        num_workers=settings.num_workers,
        pin_memory=settings.pin_memory,
        timeout=user.timeout if timeout is None or not settings.num_workers else timeout,  # workers' only
        generator=generator,
        prefetch_factor=settings.prefetch_factor,
        persistent_workers=settings.persistent_workers,
        **({"worker_init_fn": GiveWay(user.worker_init_fn)} if settings.give_way and settings.num_workers else {}),
        **({"dataset": dataset} if dataset is not None else {}),
        **({"collate_fn": _dataloader.collate_rows} if getattr(dataset, "rows", False) else {}),
        **drawn,
    ))


def user_epoch_draw(user: DataLoader, private: torch.Generator) -> Callable[[], None] | None:
    """The draw the user's loader makes from its generator (the global one when None) each time it creates an
    iterator - i.e. every epoch, unless its workers persist. pipeopt's loaders make it at the same point, and
    seed their own (private) generator with it, so the user's RNG stream is as it would be without pipeopt."""
    if not draws_each_epoch(user):
        return None

    def draw() -> None:
        private.manual_seed(draw_seed(user.generator))

    return draw


@contextlib.contextmanager
def trial_workers() -> Iterator[None]:
    """Start a trial's workers: outside torch's SIGCHLD watch (``_dataloader.quiet_worker_deaths``), and without
    torch's warning when workers outnumber CPUs - trials do that on purpose (storage-bound workers mostly wait), and
    the measurement decides."""
    with warnings.catch_warnings(), _dataloader.quiet_worker_deaths():
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        yield


def start_loader(
    user: DataLoader,
    settings: LoaderSettings,
    *,
    first: Iterator[Any],
    generator: torch.Generator,
    timeout: float | None,
    dataset: Any = None,
) -> tuple[Iterator[Any], SwitchedLoader]:
    """Build a loader like ``user`` with ``settings`` that continues ``first``, and start its iterator - leaving the
    user's RNG untouched and its workers outside torch's SIGCHLD watch (a death surfaces in ``next()``)."""
    with torch.random.fork_rng(devices=[]), trial_workers():
        loader = build_loader(user, settings, first=first, before_epoch=user_epoch_draw(user, generator),
                              generator=generator, timeout=timeout, dataset=dataset)
        iterator = iter(loader)
        _dataloader.detach_worker_watch(iterator)
    return iterator, loader


class LoaderSource(Protocol):
    """Another maker of the user's batches than a DataLoader (``pipeopt.dali.DaliSource``): the switcher starts it
    for settings with ``dali`` set. It gives the same batches in the same order - the user's batch sampler,
    continuing ``first`` (the running epoch's remaining index batches) - and makes the draw from ``generator`` the
    user's loader makes at each later epoch. Its loader starts each later epoch's iterator through ``on_epoch``
    once the switcher sets it (``SwitchedLoader``'s protocol). Settings with ``cache`` too give it the sample
    cache's dataset (``cache``): it is fed what the store holds instead of the files."""

    def start(self, user: DataLoader, device: str, *, first: Iterator[Any], generator: torch.Generator,
              cache: CachedDataset | None = None) -> tuple[Iterator[Any], Any]: ...


def live_ready_batches(trainer: Any) -> tuple[object, int] | None:
    """The running epoch (a token: its number - not its iterators, which a reading kept for a window would keep
    alive, and with them the workers torch shuts down as the iterator is freed) and the finished batches waiting in
    its train loader; None outside an epoch, with several train loaders, or where torch's queues cannot be
    counted."""
    live = _lightning.live_train_iterators(trainer)
    if not live or len(live) != 1:
        return None
    iterator = live[0]
    count = iterator.ready_batches() if isinstance(iterator, Handover) else _dataloader.ready_batches(iterator)
    return None if count is None else (int(trainer.current_epoch), count)


class LoaderSwitcher:
    """Switches the running fit's train loader between settings, and back to the user's."""

    def __init__(self, trainer: Any, *, dali: LoaderSource | None = None, cache: SampleCache | None = None) -> None:
        combined = _lightning.train_combined_loader(trainer)
        if combined is None or len(combined.flattened) != 1:
            raise ValueError("loader switching needs exactly one train loader")
        self._trainer = trainer
        self._combined = combined
        self.user: DataLoader = combined.flattened[0]
        self.user_settings = LoaderSettings.of(self.user)
        self._generator = torch.Generator().manual_seed(peek_seed(self.user.generator))
        self.fallback = self.user_settings
        self.handover: Handover | None = None
        self._fixed_epoch: Any = None  # the user's iterator the handover began with, where its order is torch's
        self.current = self.user_settings
        self.failed: BaseException | None = None  # the last trial failure, until the tuner takes it
        self._dali = dali
        self.cache = cache  # every DataLoader pipeopt builds fills it; settings with ``cache`` read from it
        self.before_first_switch: Callable[[], object] | None = None  # called once, before the first switch
        self._trial = False  # the settings in place were switched to and not settled: a trial's

    # -- switching -----------------------------------------------------------------------------------------
    def _start(self, settings: LoaderSettings, stream: IndexStream, timeout: float | None) -> tuple[Iterator[Any], Any]:
        loader: Any
        if settings.dali:
            if self._dali is None:
                raise ValueError(f"{settings.describe()} needs a DALI source; none was given to the switcher")
            cache = self.cache.dataset(read=True) if settings.cache and self.cache is not None else None
            iterator, loader = self._dali.start(self.user, settings.dali, first=stream, generator=self._generator,
                                                cache=cache)
        else:
            dataset = None
            if self.cache is not None:  # whole items are read a batch at a time where torch's collate makes the batch
                rows = self.user.batch_sampler is not None and _dataloader.is_default_collate(self.user.collate_fn)
                dataset = self.cache.dataset(read=settings.cache, rows=rows)
            iterator, loader = start_loader(self.user, settings, first=stream, generator=self._generator,
                                            timeout=timeout, dataset=dataset)
        loader.on_epoch = self._epoch_iterator  # from here on: the iterators the training loop starts
        return iterator, loader

    def _live_handover(self) -> Handover:
        """The running epoch's handover, the epoch's own iterator taken into one where there is none yet."""
        live = _lightning.live_train_iterators(self._trainer)
        if live is None or len(live) != 1:
            raise RuntimeError("no running train epoch to switch")
        if not (isinstance(live[0], Handover) and live[0] is self.handover):
            live[0] = self._take_over(live[0])
        return live[0]

    def _take_over(self, iterator: Iterator[Any], *, guard: bool = False) -> Handover:
        """A handover beginning with ``iterator``, the running epoch's own. ``guard``: that iterator's failures fall
        back too (one of pipeopt's loaders, a DataLoader or DALI's: its undelivered batches known)."""
        undelivered = _dataloader.undelivered(iterator)  # known for a loader of pipeopt's
        if self.handover is not None:  # a new epoch began: the previous epoch's sources are done
            self.handover.close(keep=iterator)
        fixed = _dataloader.order_fixed(iterator)
        self._fixed_epoch = iterator if fixed else None
        stream = IndexStream(_dataloader.take_index_stream(iterator), read_ahead=fixed,  # read ahead when asked
                             in_flight=undelivered or ())
        if guard:
            _dataloader.give_index_stream(iterator, stream)
        self.handover = Handover(stream, iterator, self._installed(), self._on_failure,
                                 first_counted=undelivered is not None, first_tracked=guard)
        return self.handover

    def _epoch_iterator(self, start: Callable[[], Iterator[Any]], loader: Any) -> Iterator[Any]:
        """An iterator the training loop starts from a loader of pipeopt's (``start``: the loader's own). Where its
        settings are a trial's (switched to, not settled: at the last epoch's last step, or persistent workers going
        on), a failure of its machinery - its workers, DALI's pipeline - falls back to the settings before the trial
        from the epoch's first batch on, as a trial's does mid-epoch. Settled settings are left alone: their
        failures are the user's, as without pipeopt."""
        if not self._trial or (isinstance(loader, DataLoader) and not loader.num_workers):
            return start()
        with trial_workers():
            iterator = start()
            _dataloader.detach_worker_watch(iterator)  # a death is reported by next(), where the handover sees it
        if _dataloader.undelivered(iterator) is None:
            return iterator
        return self._take_over(iterator, guard=True)

    def drawn_for_good(self) -> list[int] | None:
        """The sample positions this rank's running epoch drew and will not draw again: every one its sampler gives
        the epoch but those still ahead of the handover's stream (in flight included); None outside a handover or
        where the epoch's order is not known ahead (``_dataloader.order_fixed``)."""
        if self.handover is None or self.handover.stream.epoch_over or self._fixed_epoch is None:
            return None
        ahead, positions = self.handover.stream.ahead(), _dataloader.epoch_positions(self._fixed_epoch)
        if ahead is None or positions is None:
            return None
        still = set(ahead)
        return [p for p in positions if p not in still]

    def _installed(self) -> Any:
        return self._combined.flattened[0]

    def _on_failure(self, err: BaseException) -> tuple[Iterator[Any], Any]:
        """A trial's workers failed mid-epoch: continue the same stream with the last good settings."""
        if self.handover is None:
            raise RuntimeError("pipeopt: a loader failure was reported outside a handover") from err
        self.failed, self._trial = err, False  # the settings before the trial: not a trial's
        iterator, loader = self._start(self.fallback, self.handover.stream, timeout=None)
        _dataloader.attach_worker_watch(iterator)
        self._combined.flattened = [loader]
        self.current = self.fallback
        return iterator, loader

    def take_failure(self) -> BaseException | None:
        """The last trial failure since it was last taken (the tuner judges it when its window closes)."""
        failure, self.failed = self.failed, None
        return failure

    def switch(self, settings: LoaderSettings, *, timeout_s: float | None = None, take_back: bool = False) -> None:
        """Continue the running epoch with ``settings`` (and use them for later epochs). ``take_back``: the new
        loader makes the batches the loaders in place dispatched and did not deliver, where it can
        (``Handover.take_back``) - for a switch to a much faster loader, such as one reading a warm sample store."""
        hook, self.before_first_switch = self.before_first_switch, None
        if hook is not None:
            hook()
        handover = self._live_handover()
        self.fallback = self.current  # known to work: the run is using it
        if take_back:
            handover.take_back()  # before the new loader starts: it dispatches them first
        iterator, loader = self._start(settings, handover.stream, timeout_s)
        handover.add(iterator, loader)
        self._combined.flattened = [loader]
        self.current, self._trial = settings, True

    @property
    def fills(self) -> bool:
        """The installed loader fills the sample store (pipeopt built it over the store's dataset)."""
        return isinstance(getattr(self._installed(), "dataset", None), CachedDataset)

    def settle(self) -> None:
        """The current settings are kept: the user's fetch timeout and torch's worker watch apply again, to the
        running iterator and to the iterators of later epochs."""
        self._trial = False
        self._installed().timeout = self.user.timeout
        if self.handover is not None:
            iterator, _ = self.handover.current
            _dataloader.set_fetch_timeout(iterator, self.user.timeout)
            _dataloader.attach_worker_watch(iterator)

    def restore_user(self) -> None:
        """Back to the user's settings now, and the user's own loader object from the next epoch on."""
        self.switch(self.user_settings)
        self.settle()
        self._combined.flattened = [self.user]

    def end_of_epoch(self) -> None:
        """The epoch is over: stop the workers of its handover, except those the installed loader reuses."""
        if self.handover is not None:
            self.handover.stream.epoch_over = True
            self.handover.close(keep=_dataloader.cached_iterator(self._installed()))
            self.handover, self._fixed_epoch = None, None  # no iterator of a past epoch kept alive

    def close(self) -> None:
        """End of fit: stop every worker pipeopt started."""
        if self.handover is not None:
            self.handover.close()
            self.handover, self._fixed_epoch = None, None
