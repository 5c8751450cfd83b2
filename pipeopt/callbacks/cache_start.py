"""Starting the sample cache on a fit: whether it may run, what it caches, where its store lives and how large it may
grow - or why it is left alone (``report.skipped``)."""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from pipeopt import _lightning
from pipeopt.apply.backfill import Backfill
from pipeopt.apply.loader import LoaderSwitcher, unsupported
from pipeopt.apply.sample_cache import SampleCache, Split, dali_reads, fingerprint, plan, refusal
from pipeopt.apply.sample_store import SLOTS, SampleStore, StoreStats, sweep
from pipeopt.callbacks.loader_start import epoch_steps, rank_cpus, steps_left
from pipeopt.config import PipeOptConfig
from pipeopt.measure.window import WindowMeter
from pipeopt.report.model import SampleCacheFigures
from pipeopt.tuning.agreement import ReduceMax
from pipeopt.tuning.cache_session import CacheSession, best_speedup
from pipeopt.tuning.loader_search import LoaderSettings
from pipeopt.tuning.session import TrialWindows

#: The store is warm once it holds this share of the samples an epoch of the node's ranks draws - less those the
#: first epoch drew before the store was made, which no loader of pipeopt's made - (or its budget is spent), from
#: the epoch after the one that made it: the rest are made, and stored, as before.
WARM_SHARE = 0.8
CACHE_WINDOW_S_FACTOR = 3
#: Where a store sized by free memory lives when it is removed at fit end: a RAM-backed file system. A store in a
#: disk directory lives in the page cache too, but its dirty pages are written back to the disk - competing with the
#: dataset's own reads - and its writers are throttled behind that writeback.
SHARED_MEMORY = Path("/dev/shm")
#: Room the store leaves there: loader workers hand their batches over through it.
SHARED_MEMORY_SPARE = 1 << 30


def start_cache_session(trainer: Any, config: PipeOptConfig, meter: WindowMeter, switcher: LoaderSwitcher | None, *,
                        say: Callable[[str], None], agree: ReduceMax, restored: dict[str, Any] | None,
                        more_epochs: bool, short: str | None) -> CacheStart | str:
    """The cache session of this fit (and what goes with it: ``CacheStart``), or why there is none. Nothing of the
    user's is called here: the dataset is checked, and the store made, only when pipeopt first switches loaders -
    on every rank at the same step - because the run is input-bound (``prepare``)."""
    resuming = restored is not None and "cache" in restored
    split = _cacheable(trainer, switcher, short=None if resuming else short, more_epochs=more_epochs or resuming)
    if isinstance(split, str):
        return split
    switcher = switcher or LoaderSwitcher(trainer)
    user = switcher.user  # the user's own loader: the one in place may be pipeopt's already
    per_epoch = min(len(split), _samples_per_epoch(trainer, user, len(split)) * max(1, trainer.num_devices))
    made = {"epoch": 0, "before": 0}  # the epoch that made the store; what it drew before it (stored when next drawn)

    def held_enough() -> bool:
        return holds_epoch(switcher.cache.store.stats() if switcher.cache is not None else None, per_epoch,
                           made["before"])

    def prepare() -> str | None:
        fit_id = trainer.strategy.broadcast(os.getpid())  # rank zero's process: names this fit's store
        why, digest = refusal(split)
        refused, on_disk = agree([1.0 if why is not None else 0.0, 0.0 if _in_memory(config) else 1.0])
        if refused > 0 and why is None:
            why = "another rank's dataset cannot be cached"  # all ranks run the cache, or none
        if why is None:
            name = fingerprint(split, digest) + ("" if config.keep_sample_cache else f"-{fit_id}")
            store = _store(trainer, config, split, name, in_memory=on_disk == 0)  # the node's ranks share one place
            switcher.cache = SampleCache(split, store, keep=config.keep_sample_cache)
            if not held_enough():  # a kept store may be warm already
                drawn = _lightning.batches_this_epoch(trainer) * _batch_samples(trainer, user, len(split))
                made.update(epoch=trainer.current_epoch, before=min(int(drawn), per_epoch // 2))
            else:
                made["epoch"] = -1
        return why

    said = say if trainer.is_global_zero else (lambda line: None)
    ahead = StoreCompletion(trainer, switcher, say=said, note=lambda line: session.outcome.notes.append(line),
                            draws_all=per_epoch >= len(split))

    def warm() -> bool:  # not before the epoch that made the store ends (what it drew before the store is made in it)
        if switcher.cache is not None and config.sample_cache_dir is None:  # (in memory: what others stored, mapped)
            switcher.cache.store.map_in_stored()
        return held_enough() and ahead.done() if making_epoch_over(trainer, made["epoch"]) else ahead.early()

    # Windows of CACHE_WINDOW_S_FACTOR x window_s: storage-bound workers deliver in bursts, a few of which hide a gain
    windows = TrialWindows(meter.reset, config.window, CACHE_WINDOW_S_FACTOR * config.window_s, None,
                           steps_left=steps_left(trainer))
    session = CacheSession(switcher, windows=windows, warm=warm, fills=lambda: switcher.fills, agree=agree,
                           say=said, prepare=prepare, alone_first=split.whole, quiet=ahead.quiet,
                           max_workers=_most_workers(trainer, config, agree), making_ahead=ahead.running,
                           to_warm=lambda: steps_to_warm(trainer, made["epoch"]),
                           dali_reads=dali_reads(split) is not None)
    switcher.before_first_switch = session.prepare  # the loader search's first trial, or the cache's own switch
    if resuming and restored is not None:
        _restore(session, switcher, restored["cache"])
    if not split.whole:  # a random transform leaves work per sample: the loader search goes on (workers share it)
        return CacheStart(session, switcher, lambda: False, lambda: None)
    return CacheStart(session, switcher, held_enough, lambda: steps_to_read(
        trainer, switcher.cache, made["epoch"], per_epoch, _batch_samples(trainer, user, len(split))))


def _restore(session: CacheSession, switcher: LoaderSwitcher, kept: dict[str, Any] | None) -> None:
    """Resume with the cache setting a checkpoint's tuning kept (None: not the cache) - DALI fed from the store only
    where the loader search restored DALI here (it is not where DALI is not installed, or not tuned, now)."""
    settings = LoaderSettings(**kept) if kept else None
    if settings is not None and settings.dali and switcher.current.dali != settings.dali:
        session.outcome.notes.append("the checkpoint's tuning kept DALI fed from the sample cache; DALI is not in "
                                     "place here: the cache is tuned afresh")
    else:
        session.restore(settings)


@dataclass(frozen=True)
class CacheStart:
    """A fit's cache session, the switcher its loaders go through, and what the loader search asks of the store
    while it runs - only where the store holds whole items, whose reads may take every sample's work away: whether
    it holds an epoch already (the search stops: more workers would only share work the cache may remove), and the
    steps until it is read (``steps_to_read``)."""

    session: CacheSession
    switcher: LoaderSwitcher
    holds_epoch: Callable[[], bool]
    read_in: Callable[[], int | None]


def steps_to_read(trainer: Any, cache: SampleCache | None, made_in: int, per_epoch: int, batch: float) -> int | None:
    """The optimizer steps until the store is read - the rest of the epoch that makes it (none past it) - less those
    the loader in place would take to draw what the store misses of what this epoch drew (``batch``: samples a batch
    of the node's ranks holds): the samples the user's own loader made are made ahead once the cache's session
    begins (``StoreCompletion``), beside the loader and on the same CPUs, and in this epoch they cost the next one
    nothing. Only where the budget may hold an epoch at the bytes an item took so far; the loader search starts no
    window it could not finish before (``session._no_room``). None - nothing to wait for: no store yet, one an
    earlier run kept warm (``made_in`` -1), or one whose budget holds a part of an epoch (the rest is made as
    before: the search does the most for it)."""
    if cache is None or made_in < 0:
        return None
    stats = cache.store.stats()
    if stats.full or stats.bytes_used * per_epoch > stats.budget_bytes * max(1, stats.stored):
        return None
    misses = max(0.0, _lightning.batches_this_epoch(trainer) * batch - stats.stored)
    return max(0, steps_to_warm(trainer, made_in) - math.ceil(misses / batch / max(1, trainer.accumulate_grad_batches)))


def _batch_samples(trainer: Any, user: Any, length: int) -> float:
    """The samples a batch of the node's ranks holds (every rank's loader draws its own)."""
    return _samples_per_epoch(trainer, user, length) / max(1, trainer.num_training_batches or 1) * max(
        1, trainer.num_devices)


def _most_workers(trainer: Any, config: PipeOptConfig, agree: ReduceMax) -> int | None:
    """The most workers a cached trial starts: one per CPU the rank may use where the store is in memory (what is
    left per sample is CPU work then); None - as many as in place - under ``sample_cache_dir``, a disk store that
    may hold more than the memory and be read at the disk's latency."""
    return None if config.sample_cache_dir is not None else rank_cpus(trainer, agree)


def making_epoch_over(trainer: Any, made_in: int) -> bool:
    """Past the epoch that made the store (``made_in``), or at its end: asked for the next epoch's first batch."""
    if trainer.current_epoch > made_in:
        return True
    return epoch_steps(trainer) is not None and steps_to_warm(trainer, made_in) == 0


def steps_to_warm(trainer: Any, made_in: int) -> int:
    """The optimizer steps left in the epoch that made the store (``made_in``): it is read from the next one."""
    per_epoch = epoch_steps(trainer)
    if trainer.current_epoch > made_in or per_epoch is None:
        return 0
    return max(0, per_epoch - _lightning.batches_this_epoch(trainer) // max(1, trainer.accumulate_grad_batches))


def _cacheable(trainer: Any, switcher: LoaderSwitcher | None, *, short: str | None, more_epochs: bool) -> Split | str:
    """How the train loader's dataset's items would split - or why the cache cannot run (nothing is fetched): the
    user's own loader's, where the loader search has a switcher (which may have put DALI in place, on resume)."""
    combined = _lightning.train_combined_loader(trainer)
    flattened = list(combined.flattened) if combined is not None else []
    if len(flattened) != 1:
        return f"the fit has {len(flattened)} train loaders; pipeopt caches the samples of a single one"
    loader = switcher.user if switcher is not None else flattened[0]
    reason = unsupported(loader)
    if reason is not None:
        return reason
    if short is not None:
        return short
    if not more_epochs:
        return "a sample cache pays from the second epoch on, and this fit ends in its first"
    return plan(loader.dataset)


def _in_memory(config: PipeOptConfig) -> bool:
    """The store goes to ``SHARED_MEMORY``: sized by free memory (no ``sample_cache_dir``), removed at fit end (a
    store kept for a rerun would hold memory until the machine restarts) and a RAM-backed file system there with
    room for its budget and ``SHARED_MEMORY_SPARE`` besides."""
    if config.sample_cache_dir is not None or config.keep_sample_cache or not _ram_backed(SHARED_MEMORY):
        return False
    try:
        free = shutil.disk_usage(SHARED_MEMORY).free
    except OSError:
        return False
    return os.access(SHARED_MEMORY, os.W_OK) and free >= _memory_budget(config) + SHARED_MEMORY_SPARE


def _ram_backed(path: Path) -> bool:
    mounts = {p.mountpoint: p.fstype for p in psutil.disk_partitions(all=True)}
    return mounts.get(str(path)) == "tmpfs"


def _memory_budget(config: PipeOptConfig) -> int:
    return max(1, int(config.sample_cache_share * psutil.virtual_memory().available))


def _store(trainer: Any, config: PipeOptConfig, split: Any, name: str, *, in_memory: bool) -> SampleStore:
    """The node's store, shared by its ranks (each fills it with what its sampler gives it and reads what any of
    them stored: a DistributedSampler reshuffles the shards every epoch): under ``sample_cache_dir`` (sized by its
    free space); else sized by free memory - in ``SHARED_MEMORY`` (``in_memory``: stores there that no process
    holds any more are removed first) or under the report directory (a temporary directory when no files are
    written; and at most that directory's free space) - ``sample_cache_share`` of it."""
    if config.sample_cache_dir is not None:
        root = config.sample_cache_dir
        root.mkdir(parents=True, exist_ok=True)
        budget = max(1, int(config.sample_cache_share * shutil.disk_usage(root).free))
    elif in_memory:
        root = SHARED_MEMORY / "pipeopt-sample-cache"
        sweep(root)
        root.mkdir(parents=True, exist_ok=True)
        budget = _memory_budget(config)
    else:
        root = (config.report_dir / "sample-cache") if config.report_dir is not None else \
            Path(tempfile.gettempdir()) / "pipeopt-sample-cache"
        root.mkdir(parents=True, exist_ok=True)
        budget = min(_memory_budget(config), max(1, int(config.sample_cache_share * shutil.disk_usage(root).free)))
    slot = trainer.local_rank % SLOTS
    return SampleStore(root / f"{name}-{socket.gethostname()}", len(split), budget, slot=slot)


class StoreCompletion:
    """Before the cache is tried: the items the store misses, made in the background (``Backfill``) - the samples
    the epoch that made it drew before it existed - and whether a window overlapped that work (its rate is then
    not the settings in place alone, and it is not pooled into the cache's window before). Where that epoch's order
    is known ahead (``LoaderSwitcher.drawn_for_good``), they are made in it, while it draws the rest (``early``);
    what is still missing at the next epoch's start, then (``done``)."""

    def __init__(self, trainer: Any, switcher: LoaderSwitcher, *, draws_all: bool, say: Callable[[str], None],
                 note: Callable[[str], None]) -> None:
        """``draws_all``: an epoch of the node's ranks draws every sample of the data set, so every missing one is
        drawn in the next (a sampler that draws a part leaves the rest to be made when drawn: nothing is made
        ahead); ``say``: a console line; ``note``: a line in the report."""
        self._trainer, self._switcher, self._draws_all, self._say, self.note = trainer, switcher, draws_all, say, note
        self.jobs: list[Backfill] = []
        self._early_asked, self._begun, self._reported = False, False, 0
        self._since: float | None = None  # when ``quiet`` was last asked: the end of the window before

    def early(self) -> bool:
        """In the epoch that made the store (once): make the samples it drew and will not draw again. False: the
        store is not warm in that epoch."""
        if self._early_asked:
            return False
        self._early_asked = True
        cache, drawn = self._switcher.cache, self._switcher.drawn_for_good()
        if cache is not None and drawn is not None and self._fillable():
            missing = set(cache.store.missing())
            self._start([p for p in drawn if p in missing], "samples drawn before the store existed",
                        when="beside the rest of the epoch that made the store")
        return False

    def done(self) -> bool:
        """Nothing is left to make before the cache is tried; the first call (once ``early``'s work ended) starts
        the work on what the store still misses."""
        cache = self._switcher.cache
        if not self._begun and not self.running():
            self._begun = True
            if cache is not None and self._fillable():
                missing = cache.store.missing()
                mine = missing[self._trainer.local_rank::max(1, self._trainer.num_devices)]  # the ranks share them
                self._start(mine, "samples the store missed")
        if self.running():
            return False
        for job in self.jobs[self._reported:]:
            self.note(job.describe())
        self._reported = len(self.jobs)
        return True

    def _fillable(self) -> bool:  # a spent budget holds no more; a sampler that draws a part leaves the rest
        cache = self._switcher.cache
        return cache is not None and self._draws_all and not cache.store.stats().full

    def _start(self, positions: list[int], what: str, when: str = "") -> None:
        cache = self._switcher.cache
        if cache is None or not positions:
            return
        workers = max(1, min(self._switcher.current.num_workers, len(positions)))
        job = Backfill(cache.dataset(read=False), positions, like=self._switcher.user, workers=workers, what=what,
                       when=when)
        job.start()
        self.jobs.append(job)
        cache.on_close.append(job.stop)
        self._say(f"making {len(positions)} {what} ahead, {when + ', ' if when else ''}in {workers} worker "
                  "process(es)")

    def running(self) -> bool:
        """Whether what the store misses is being made now, on this rank."""
        return any(job.running for job in self.jobs)

    def quiet(self) -> bool:
        """Whether the window that ended now - since the last call - ran with no backfill beside it."""
        since, self._since = self._since, time.perf_counter()
        return all(job.ended_at is not None and since is not None and job.ended_at <= since for job in self.jobs)


def holds_epoch(stats: StoreStats | None, per_epoch: int, unfillable: int) -> bool:
    """The store holds ``WARM_SHARE`` of what an epoch draws, less the ``unfillable`` samples the first epoch drew
    before it was made (or its budget is spent)."""
    return stats is not None and (stats.full or stats.stored >= WARM_SHARE * (per_epoch - unfillable))


def _samples_per_epoch(trainer: Any, user: Any, length: int) -> int:
    """The distinct samples an epoch of this rank draws: its batches times their size, at most its sampler's."""
    batches = trainer.num_training_batches
    size = user.batch_size or getattr(user.batch_sampler, "batch_size", None) or 1
    sampled = len(user.sampler) if hasattr(user.sampler, "__len__") else length
    if batches in (None, float("inf")):
        return sampled
    return max(1, min(sampled, int(batches) * int(size)))


class CacheLedger:
    """The sample cache over the fit, an epoch at a time: samples this rank trained (in all, and with settings that
    read the store in place), those its loaders made because the store did not have them (stored or not), and - for
    an epoch read from the store from start to end - the hit rate (a loader that only fills makes every item, stored
    or not: no hit rate)."""

    def __init__(self) -> None:
        self.samples = 0  # trained in the running epoch
        self.read = 0  # of them, trained with settings that read the store in place (a trial's, a filler's, kept ones)
        self.reading_at_start = False
        self.epochs: list[dict[str, Any]] = []

    def epoch_started(self, reading: bool) -> None:
        self.samples, self.read, self.reading_at_start = 0, 0, reading

    def trained(self, samples: int, reading: bool) -> None:
        """A trained batch of ``samples``; ``reading``: the settings in place read the store."""
        self.samples += samples
        self.read += samples if reading else 0

    def epoch_ended(self, epoch: int, cache: SampleCache | None, reading: bool) -> None:
        if cache is None:
            return
        misses = cache.store.stats().made - sum(row["misses"] for row in self.epochs)
        whole = reading and self.reading_at_start
        hit_rate = max(0.0, 1.0 - misses / self.samples) if whole and self.samples else None
        self.epochs.append(dict(epoch=epoch, reading=whole, samples=self.samples, read=self.read, misses=misses,
                                hit_rate=hit_rate))
        self.samples = self.read = 0

    def figures(self, cache: SampleCache | None, session: CacheSession | None) -> SampleCacheFigures | None:
        if cache is None or session is None:
            return None
        stats = cache.store.stats()
        return SampleCacheFigures(
            cached=cache.split.describe(), directory=str(cache.store.directory), kept=session.kept is not None,
            stored=stats.stored, length=stats.length, bytes_used=stats.bytes_used, budget_bytes=stats.budget_bytes,
            fill_s=stats.fill_s, trial_speedup=best_speedup(session.trials, session.before), epochs=list(self.epochs))
