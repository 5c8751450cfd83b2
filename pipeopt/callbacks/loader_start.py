"""Starting the loader search on a fit: whether it may run (and DALI with it), its budget, and where it begins - a
checkpoint's settings, a cached configuration to verify, or a before-window of the user's own loader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from pipeopt import _lightning
from pipeopt.apply.loader import LoaderSwitcher, unsupported
from pipeopt.cache import TunedCache, default_path, fingerprint
from pipeopt.callbacks.fingerprint import fit_parts
from pipeopt.config import PipeOptConfig
from pipeopt.dali import DaliSource
from pipeopt.dali import blocker as dali_blocker
from pipeopt.measure.cpu import cpus_available, private_memory, worker_private_memory
from pipeopt.measure.window import WindowMeter
from pipeopt.tuning.agreement import MAX, MIN, ReduceMax, agreed
from pipeopt.tuning.agreement import agree as agree_on
from pipeopt.tuning.loader_search import Budget, LoaderSettings
from pipeopt.tuning.session import LoaderSession, TrialWindows

#: Records a group left alone and why (``warn=False``: the caller warns once for several groups).
Skip = Callable[..., None]


@dataclass(frozen=True)
class WorkerMemory:
    """What loader workers may take (half the memory available) and what the training process holds privately (a
    worker's stand-in until one is measured), as every rank agrees: the least any rank may take, the most any
    holds - so every rank fits the loader model to the same budget."""

    available: int = agreed(MIN)
    training: int | None = agreed(MAX)

    @classmethod
    def measure(cls, agree: ReduceMax) -> WorkerMemory:
        return agree_on(cls(int(0.5 * psutil.virtual_memory().available), private_memory()), agree)


@dataclass
class LoaderStart:
    session: LoaderSession
    switcher: LoaderSwitcher
    cache: TunedCache | None = None
    cache_key: str | None = None


def start_loader_session(trainer: Any, config: PipeOptConfig, meter: WindowMeter, *, clock: Callable[[], float],
                         say: Callable[[str], None], agree: ReduceMax, restored: dict[str, Any] | None, skip: Skip,
                         short: str | None) -> LoaderStart | None:
    """The loader session of this fit, started; None (each group skipped with its reason) when it may not run."""
    groups = [g for g in ("loader", "dali") if g in config.tune]
    combined = _lightning.train_combined_loader(trainer)
    flattened = list(combined.flattened) if combined is not None else []
    reason = (f"the fit has {len(flattened)} train loaders; pipeopt tunes a single one" if len(flattened) != 1
              else unsupported(flattened[0]))
    if reason is not None:
        for group in groups:
            skip(group, reason)
        return None
    cuda = trainer.strategy.root_device.type == "cuda"
    dali = None
    if "dali" in groups:
        reason = dali_blocker(flattened[0])
        if reason is None:
            dali = "mixed" if cuda else "cpu"
        else:
            skip("dali", reason)
    if short is not None:
        for group in [g for g in groups if g == "loader" or dali is not None]:
            skip(group, short, warn=False)
        return None
    cpus = rank_cpus(trainer, agree)
    switcher = LoaderSwitcher(trainer, dali=DaliSource(cpus) if dali is not None else None)
    memory = WorkerMemory.measure(agree)
    budget = Budget(cpus=cpus, memory_bytes=memory.available, cuda=cuda, more_epochs=more_epochs_ahead(trainer),
                    may_change_workers="loader" in groups, dali=dali, training_mem_bytes=memory.training)
    windows = TrialWindows(meter.reset, config.window, config.window_s, epoch_steps(trainer),
                           steps_left=steps_left(trainer))
    session = LoaderSession(switcher, budget=budget, budget_s=config.budget_s, windows=windows, clock=clock,
                            say=say if trainer.is_global_zero else (lambda line: None),
                            worker_memory=worker_private_memory, agree=agree)
    start = LoaderStart(session, switcher)

    def usable(settings: LoaderSettings | None) -> bool:  # DALI settings only where DALI may be tried now
        return settings is None or settings.dali in (None, dali)

    if restored is not None and "loader" in restored:
        loader = LoaderSettings(**restored["loader"]) if restored["loader"] else None
        if usable(loader):
            session.restore(loader)
            return start
        session.notes.append("the checkpoint's tuning kept DALI, which cannot be used here; tuned afresh")
    meter.label = "before"
    if config.cache is not False:
        start.cache = cache = TunedCache(default_path() if config.cache is True else Path(config.cache))
        start.cache_key = key = fingerprint(fit_parts(trainer, trainer.lightning_module, flattened[0]))
        # Rank zero's entry for every rank: the same decision everywhere, whatever each node's cache holds.
        entry = trainer.strategy.broadcast(cache.get(key) if trainer.is_global_zero else None)
        if entry is not None and "loader" in entry and "samples_per_s" in entry:
            cached = LoaderSettings(**entry["loader"]) if entry["loader"] else None
            if usable(cached):
                session.verify_cached(cached, float(entry["samples_per_s"]))
    return start


@dataclass(frozen=True)
class _Cpus:
    count: int = agreed(MIN)


def rank_cpus(trainer: Any, agree: ReduceMax) -> int:
    """The CPUs a rank may use: those of this process, shared by the node's ranks - the fewest any rank has, so that
    every rank's search and cached trials propose the same worker counts (nodes, or the CPUs each rank is bound to,
    may differ; a rank that started more workers than another would end its windows at other steps, and call the
    collectives there while the other trains)."""
    return agree_on(_Cpus(max(1, cpus_available() // max(1, trainer.num_devices))), agree).count


def steps_left(trainer: Any) -> Callable[[], int | None]:
    """Optimizer steps the fit has left, read when asked (None: unbounded)."""
    planned = _lightning.planned_steps(trainer)
    return lambda: None if planned is None else planned - trainer.global_step


def more_epochs_ahead(trainer: Any) -> bool:
    """Whether the fit will cross at least one more epoch boundary (so worker start-up would recur)."""
    max_epochs = trainer.max_epochs
    if max_epochs not in (None, -1) and trainer.current_epoch + 1 >= max_epochs:
        return False
    max_steps = trainer.max_steps
    per_epoch = trainer.num_training_batches
    if max_steps in (None, -1) or per_epoch in (None, float("inf")):
        return True
    accumulate = max(1, trainer.accumulate_grad_batches)
    return max_steps - trainer.global_step > per_epoch / accumulate


def epoch_steps(trainer: Any) -> int | None:
    """Optimizer steps per epoch, when the epoch has a length."""
    batches = trainer.num_training_batches
    if batches in (None, float("inf")) or batches <= 0:
        return None
    return -(-int(batches) // max(1, trainer.accumulate_grad_batches))
