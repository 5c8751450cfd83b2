"""Training the running fit on another micro-batch x accumulation plan, from one optimizer step to the next.

The user's batches are re-cut where they are made: each split into micro-batches in order, or ``k`` consecutive
ones joined into one (``Recut``) - the same samples in the same order, every one trained once. ``PlanSwitch`` moves
the running epoch and the later ones between plans at an optimizer-step boundary where the new accumulation lines
up with Lightning's count of the epoch's batches, so every optimizer step still sees exactly the effective batch.

Memory is measured on the live run: on CUDA, the allocator's peak over each window of real training steps and what
the run keeps allocated between steps; on CPU there is no device memory to budget (``DeviceMemory`` is the seam
where tests inject one).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, default_collate

from pipeopt import _dataloader, _lightning
from pipeopt.apply.loader import is_plain
from pipeopt.measure.batch import batch_size, concat_batches, slice_batch
from pipeopt.measure.window import WindowStats
from pipeopt.tuning.batch import BatchPlan


class DeviceMemory:
    """The device's memory budget, a window's peak and what stays allocated between steps (None on CPU)."""

    def budget(self, device: torch.device, fraction: float) -> int | None:
        if device.type != "cuda":
            return None
        return int(fraction * torch.cuda.get_device_properties(device).total_memory)

    def window_peak(self, stats: WindowStats, plan: BatchPlan) -> int | None:
        return stats.resources.peak_mem_bytes

    def between_steps(self, device: torch.device) -> int | None:
        return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None


MEMORY = DeviceMemory()


def unsupported(trainer: Any, module: Any, loader: Any) -> str | None:
    """Why pipeopt leaves this run's batch plan alone (None when it may tune it)."""
    if not getattr(module, "automatic_optimization", True):
        return "the module uses manual optimization: pipeopt cannot set its gradient accumulation"
    if not is_plain(loader) or isinstance(loader.dataset, IterableDataset):
        return "the train loader is not a map-style torch DataLoader"
    if loader.batch_size is None or not isinstance(loader.batch_sampler, BatchSampler):
        return "the train loader has a custom batch sampler: its batch size is not known"
    if getattr(trainer, "fast_dev_run", False):
        return "fast_dev_run promises exactly its number of training steps"
    if getattr(trainer, "overfit_batches", 0):
        return "overfit_batches replays fixed batches: a different micro-batch would change them"
    limit = trainer.limit_train_batches
    if not (isinstance(limit, float) and limit == 1.0):  # an int 1 means one batch, not all of them
        return "limit_train_batches is set: a different micro-batch would change how many samples an epoch has"
    interval = getattr(trainer, "val_check_interval", None)
    if not (isinstance(interval, float) and interval == 1.0) or trainer.check_val_every_n_epoch is None:
        return "validation runs inside the epoch (val_check_interval): a different micro-batch would move it"
    if "dataloader_iter" in _parameters(module.training_step):
        return "training_step takes the dataloader iterator and fetches its own batches"
    needs_closure = [type(o).__name__ for o in trainer.optimizers if _required(o.step, "closure")]
    if needs_closure:
        return f"the optimizer ({', '.join(needs_closure)}) steps only with a closure"
    if trainer.strategy.handles_gradient_accumulation:
        return f"the strategy ({type(trainer.strategy).__name__}) accumulates gradients itself"
    return _partial_last_step(loader, int(trainer.accumulate_grad_batches))


def _partial_last_step(loader: DataLoader, accumulate: int) -> str | None:
    """Why another plan would train an epoch's last optimizer step differently (None when every step of an epoch is
    a whole effective batch). Lightning divides each micro-batch's loss by the accumulation, also in a last step
    that holds fewer batches: another micro-batch would weigh that step's samples differently."""
    batches: BatchSampler = loader.batch_sampler  # type: ignore[assignment]  # checked by the caller
    try:
        samples = len(batches.sampler)  # type: ignore[arg-type]  # Sized or not: a TypeError says which
    except TypeError:
        return "the train sampler has no length: the epoch's last optimizer step cannot be known"
    if batches.drop_last:
        samples -= samples % batches.batch_size
    effective = batches.batch_size * accumulate
    if samples % effective:
        return (f"an epoch's {samples} samples are not whole optimizer steps of {effective} (its last step holds "
                f"{samples % effective}, which Lightning scales by the accumulation): another micro-batch would weigh "
                "that step's samples differently")
    return None


def recuttable(loader: Any, size: int) -> bool:
    """Whether ``loader`` (the one installed when plans are tried) makes the user's batches of ``size`` from a
    ``BatchSampler``."""
    batches = _batch_sampler(loader) if is_plain(loader) else None
    return batches is not None and batches.batch_size == size


def _batch_sampler(loader: DataLoader) -> BatchSampler | None:
    """The user's ``BatchSampler`` behind the loader's (the loader tuning's rebuilds wrap it: ``.inner``)."""
    batches = loader.batch_sampler
    while batches is not None and not isinstance(batches, BatchSampler):
        batches = getattr(batches, "inner", None)
    return batches


def may_join(loader: DataLoader) -> bool:
    """Whether the loader's batches may be joined into larger micro-batches: torch's own collation makes batches
    of equal shape (a collate_fn of the user's may pad each batch to its own length)."""
    return loader.collate_fn is default_collate


def _parameters(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or C function without a signature
        return {}


def _required(fn: Any, name: str) -> bool:
    parameter = _parameters(fn).get(name)
    return parameter is not None and parameter.default is inspect.Parameter.empty


def has_batchnorm(module: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())


def _recut(indices: Iterator[list[int]], size: int, micro: int) -> Iterator[list[int]]:
    """An index-batch stream of ``size`` re-cut like ``Recut`` (split into ``micro``, or merged)."""
    if micro <= size:
        for batch in indices:
            for start in range(0, len(batch), micro):
                yield list(batch[start:start + micro])
        return
    merged: list[int] = []
    count = 0
    for batch in indices:
        merged.extend(batch)
        count += 1
        if count == micro // size:
            yield merged
            merged, count = [], 0
    if merged:
        yield merged


class Recut(Iterator[Any]):
    """A loader iterator's batches, collated at the user's size, re-cut into micro-batches of ``micro``: each
    split in order, or ``micro // size`` consecutive ones concatenated. A loader switch mid-epoch takes its
    remaining indices re-cut the same way."""

    def __init__(self, iterator: Iterator[Any], size: int, micro: int) -> None:
        self._it, self._size, self._micro = iterator, size, micro
        self._pending: list[Any] = []

    def take_index_stream(self) -> Iterator[list[int]]:
        return _recut(_dataloader.take_index_stream(self._it), self._size, self._micro)

    def unwrap(self) -> Iterator[Any]:
        """The iterator this one re-cuts, at a point where no part of a batch is held back."""
        if self._pending:
            raise RuntimeError("pipeopt: a re-cut batch was left half trained (a plan switch off a step boundary)")
        return self._it

    def __iter__(self) -> Recut:
        return self

    def __next__(self) -> Any:
        if self._pending:
            return self._pending.pop(0)
        if self._micro <= self._size:
            batch = next(self._it)
            n = batch_size(batch) or 0
            self._pending = [slice_batch(batch, i, i + self._micro) for i in range(0, n, self._micro)]
            return self._pending.pop(0)
        parts = []
        for _ in range(self._micro // self._size):
            try:
                parts.append(next(self._it))
            except StopIteration:
                break
        if not parts:
            raise StopIteration
        return concat_batches(parts)

    def _shutdown_workers(self) -> None:
        _dataloader.shutdown_iterator(self._it)


class RecutLoader:
    """A train loader whose batches are the user's loader's, re-cut into micro-batches of ``micro`` (``Recut``).
    Lightning sizes the epoch from its length and sets the sampler's epoch through ``sampler`` / ``batch_sampler``;
    everything else reads through to the loader it wraps (its workers, its persistent iterator)."""

    def __init__(self, loader: DataLoader, micro: int) -> None:
        self.__dict__["loader"] = loader
        self.__dict__["batch_size"] = micro

    def __iter__(self) -> Recut:
        size = _batch_sampler(self.loader).batch_size  # type: ignore[union-attr]  # a recuttable() loader has one
        return Recut(iter(self.loader), size, self.batch_size)

    def __len__(self) -> int:
        return recut_length(self.loader, self.batch_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)

    def __setattr__(self, name: str, value: Any) -> None:  # ``_iterator`` (persistent workers) lives in the loader
        setattr(self.loader, name, value)


def recut_length(loader: DataLoader, micro: int) -> int:
    """Batches of micro-batch ``micro`` in one epoch of ``loader`` (whose batch sampler is a ``BatchSampler``:
    ``recuttable``)."""
    batches: BatchSampler = _batch_sampler(loader)  # type: ignore[assignment]  # recuttable() found one
    size = batches.batch_size
    if micro > size:
        return math.ceil(len(loader) / (micro // size))
    samples = len(batches.sampler)  # type: ignore[arg-type]  # sized: unsupported() measured it
    full, rest = divmod(samples, size)
    drop_last = batches.drop_last
    return full * math.ceil(size / micro) + (0 if drop_last or not rest else math.ceil(rest / micro))


class PlanSwitch:
    """Moves the running fit between the user's plan and others, at optimizer-step boundaries.

    ``aligned(plan)`` says whether the batches Lightning counted this epoch are a multiple of the plan's
    accumulation (Lightning steps when that count is), so the next optimizer step gets a whole effective batch;
    ``switch(plan)`` re-cuts the rest of the running epoch and the later ones, sets the accumulation, and sizes the
    running epoch - its batches so far plus what is left in the new micro-batches - so that it ends, validates and
    steps where it would have. Between steps nothing of a user batch is held back, so switching back needs no
    joins."""

    def __init__(self, trainer: Any, loader: DataLoader, user: BatchPlan) -> None:
        self._trainer, self._base, self.user = trainer, loader, user
        self.current = user
        self._consumed = 0  # samples the running epoch trained before its last switch
        self._since = 0  # the epoch's batch count at its last switch

    def aligned(self, plan: BatchPlan) -> bool:
        return (_lightning.batches_this_epoch(self._trainer) % plan.accumulate == 0
                or _lightning.epoch_ends_here(self._trainer))

    def switch(self, plan: BatchPlan) -> None:
        trainer = self._trainer
        count = _lightning.batches_this_epoch(trainer)
        self._consumed += (count - self._since) * self.current.micro
        self._since = count
        live = _lightning.live_train_iterators(trainer)
        running = live[0] if live and len(live) == 1 else None
        if isinstance(running, Recut):
            running = running.unwrap()
        if plan == self.user:
            loader: Any = self._base
        else:
            loader = RecutLoader(self._base, plan.micro)
            running = Recut(running, self.user.micro, plan.micro) if running is not None else None
        left = max(0, len(loader) - self._consumed // plan.micro)
        _lightning.install_train_loader(trainer, loader, plan.accumulate, running, epoch_batches=count + left)
        self.current = plan

    def epoch_started(self) -> None:
        """A new epoch: its length is the installed loader's (the last one was sized for its switches)."""
        self._consumed = self._since = 0
        micro = self.current.micro
        _lightning.size_train_epoch(self._trainer, len(self._base) if micro == self.user.micro
                                 else recut_length(self._base, micro))
