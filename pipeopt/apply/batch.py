"""Probing micro-batch x accumulation plans on real samples of the run (sandboxed), and training on the chosen one
from the first epoch: the user's batches split into (or merged from) micro-batches, same samples, same order.

Memory is measured, not guessed: on CUDA, the allocator's peak over one sandboxed optimizer step of the plan
(forward + backward of every micro-batch, then the optimizer step, so optimizer state is counted); an
out-of-memory error in a probe is caught (only that), the cache emptied, and the plan marked as not fitting. On
CPU there is no device memory to fill: no peak is measured and the memory budget does not apply - plans are
compared by speed only (``DeviceMemory`` is the seam where a probe can be injected).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, default_collate

from pipeopt import _compat
from pipeopt.apply.loader import loader_like
from pipeopt.measure.batch import batch_size, concat_batches, slice_batch
from pipeopt.measure.sandbox import Sandbox, time_probe, training_loss
from pipeopt.tuning.batch import BatchPlan, BatchProbe, plans

#: Plans whose micro-batch is smaller than the user's divided by this are not probed (accumulating that many
#: micro-batches is never faster; it is only a way to fit, and a smaller split that fits is found before).
MAX_SPLIT = 8


class DeviceMemory:
    """The device's memory budget and a probe's peak (None on CPU, where there is no device memory)."""

    def budget(self, device: torch.device, fraction: float) -> int | None:
        if device.type != "cuda":
            return None
        return int(fraction * torch.cuda.get_device_properties(device).total_memory)

    def peak(self, plan: BatchPlan, run: Callable[[], Any], device: torch.device) -> int | None:
        if device.type != "cuda":
            run()
            return None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))


MEMORY = DeviceMemory()


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def unsupported(trainer: Any, module: Any, loader: Any) -> str | None:
    """Why pipeopt leaves this run's batch plan alone (None when it may tune it)."""
    if not getattr(module, "automatic_optimization", True):
        return "the module uses manual optimization: pipeopt cannot set its gradient accumulation"
    if type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset):
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
    if not isinstance(getattr(trainer, "val_check_interval", None), float):
        return "val_check_interval counts batches or time: a different micro-batch would move validation"
    if "dataloader_iter" in _parameters(module.training_step):
        return "training_step takes the dataloader iterator and fetches its own batches"
    # The probes' sample batch is collated and moved outside training: only where that runs no code of the user's
    # (until micro-batch plans are tried on the live run).
    if loader.collate_fn is not default_collate:
        return ("the loader has its own collate_fn, and pipeopt's probes call no code of yours outside training (it "
                "may keep state)")
    hooks = _compat.batch_transfer_hooks_overridden(trainer, module)
    if hooks:
        return f"the module moves batches with its own hooks ({', '.join(hooks)}), which pipeopt's probes do not call"
    needs_closure = [type(o).__name__ for o in trainer.optimizers if _required(o.step, "closure")]
    if needs_closure:
        return f"the optimizer ({', '.join(needs_closure)}) steps only with a closure"
    return None


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


class Rebatch:
    """The user's batch sampler, each index batch split into micro-batches of ``micro`` (``micro`` < the user's
    batch size) or ``micro // batch_size`` consecutive batches merged into one: the same indices in the same order."""

    def __init__(self, inner: BatchSampler, micro: int) -> None:
        self.inner = inner
        self.micro = micro

    @property
    def sampler(self) -> Any:
        """Where Lightning looks for ``set_epoch`` (a ``DistributedSampler`` included)."""
        return self.inner.sampler

    def __iter__(self) -> Iterator[list[int]]:
        return _recut(iter(self.inner), self.inner.batch_size, self.micro)  # type: ignore[arg-type]

    def __len__(self) -> int:
        size, micro = self.inner.batch_size, self.micro
        if micro > size:
            return math.ceil(len(self.inner) / (micro // size))
        samples = len(self.inner.sampler)
        full, rest = divmod(samples, size)
        return full * math.ceil(size / micro) + (0 if self.inner.drop_last else math.ceil(rest / micro))


def _recut(indices: Iterator[list[int]], size: int, micro: int) -> Iterator[list[int]]:
    """An index-batch stream of ``size`` re-cut like ``Rebatch`` (split into ``micro``, or merged)."""
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
    """The running epoch's batches, already collated at the user's size, re-cut into the plan's micro-batches:
    each split in order, or ``micro // size`` consecutive ones concatenated. Used for the epoch in progress when a
    plan is applied (its iterator, and the order it drew, already exist); later epochs use ``Rebatch``. A loader
    switch mid-epoch takes its remaining indices re-cut the same way."""

    def __init__(self, iterator: Iterator[Any], loader: DataLoader, size: int, micro: int) -> None:
        self._it, self._loader, self._size, self._micro = iterator, loader, size, micro
        self._pending: list[Any] = []

    def take_index_stream(self) -> Iterator[list[int]]:
        return _recut(_compat.take_index_stream(self._it), self._size, self._micro)

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
        """Stop the user's loader's workers (it is not used after this epoch)."""
        _compat.shutdown_iterator(self._it)
        _compat.forget_cached_iterator(self._loader, self._it)


def rebatched(user: DataLoader, micro: int) -> DataLoader:
    """A loader like ``user`` whose batches are ``micro`` samples (see ``Rebatch``)."""
    return loader_like(user, batch_sampler=Rebatch(user.batch_sampler, micro))  # type: ignore[arg-type]


def sample_batch(trainer: Any, loader: DataLoader, size: int) -> Any:
    """``size`` samples of the dataset (its first ones, cycled if it is smaller), collated and on the device -
    read directly, so the run's sampler and RNG are not touched."""
    n = len(loader.dataset)  # type: ignore[arg-type]
    batch = loader.collate_fn([loader.dataset[i % n] for i in range(size)])
    return trainer.strategy.batch_to_device(batch)


def plan_step(module: Any, optimizers: list[Any], batch: Any, plan: BatchPlan) -> Callable[[], torch.Tensor]:
    """One optimizer step of ``plan`` on ``batch`` (``plan.effective`` samples): forward + backward of each
    micro-batch, losses scaled by the accumulation as Lightning does, then the optimizer step."""

    def step() -> torch.Tensor:
        module.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i in range(plan.accumulate):
            micro = slice_batch(batch, i * plan.micro, (i + 1) * plan.micro)
            loss = training_loss(module, micro, i)
            (loss / plan.accumulate).backward()
            total = total + loss.detach().float().cpu()
        for optimizer in optimizers:
            optimizer.step()
        return total / plan.accumulate

    return step


def probe_plans(trainer: Any, module: Any, batch: Any, user: BatchPlan, *, memory: DeviceMemory | None = None,
                repeats: int = 3) -> list[BatchProbe]:
    """Peak memory and samples/s of each plan (largest micro-batch first) on ``batch``; everything restored."""
    memory = memory or MEMORY
    device = trainer.strategy.root_device
    optimizers = list(trainer.optimizers)
    probes = []
    with Sandbox(module, optimizers), _compat.no_logging(module):
        for plan in plans(user):
            if plan.micro * MAX_SPLIT < user.micro:
                continue
            step = plan_step(module, optimizers, batch, plan)
            try:
                peak = memory.peak(plan, step, device)
                rate, _ = time_probe(step, device=device, repeats=repeats, warmup=0)
            except Exception as err:  # noqa: BLE001 - only an out-of-memory error is a probe result
                if not is_oom(err):
                    raise
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                probes.append(BatchProbe(plan, oom=True))
                continue
            probes.append(BatchProbe(plan, peak_bytes=peak, rate=type(rate)(rate.value * plan.effective, rate.rel_se)))
        module.zero_grad(set_to_none=True)
    return probes


def apply_plan(trainer: Any, user: DataLoader, plan: BatchPlan) -> Recut | None:
    """Train on ``plan`` from now on: the running epoch's batches re-cut (``Recut``, returned so its workers can be
    stopped at the end of the fit), later epochs from the rebatched loader, with the plan's accumulation."""
    loader = rebatched(user, plan.micro)
    live = _compat.live_train_iterators(trainer)
    recut = Recut(live[0], user, user.batch_size, plan.micro) if live else None  # type: ignore[arg-type]
    _compat.install_train_loader(trainer, loader, plan.accumulate, recut)
    return recut
