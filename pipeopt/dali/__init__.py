"""NVIDIA DALI for torchvision image datasets: the same batches, decoded and augmented by DALI.

``loader_from(train_loader)`` turns a DataLoader over a torchvision ``ImageFolder`` / ``DatasetFolder`` (or a
``Subset`` of one) into a ``DaliLoader`` - or raises ``Untranslatable`` naming the transform or property that has no
DALI equivalent. PipeOpt tries the same loader as a candidate of its loader search (``tune=("dali", ...)``); this is
the builder for users who want DALI directly. DALI is an optional extra: ``pip install 'pipeopt[dali]'``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
)

from pipeopt.apply.index_stream import draw_seed, draws_each_epoch
from pipeopt.dali.loader import DaliLoader
from pipeopt.dali.pipeline import missing
from pipeopt.dali.recipe import Recipe, Untranslatable, translate
from pipeopt.dali.source import DaliSource, blocker
from pipeopt.measure.cpu import cpus_available

__all__ = ["DaliLoader", "DaliSource", "Recipe", "Untranslatable", "blocker", "loader_from", "missing", "translate"]


def loader_from(
    source: Any,
    *,
    batch_size: int | None = None,
    shuffle: bool | None = None,
    drop_last: bool | None = None,
    device: str = "auto",
    num_threads: int | None = None,
    seed: int | None = None,
    num_shards: int | None = None,
    shard_id: int | None = None,
) -> DaliLoader:
    """A ``DaliLoader`` giving the batches ``source`` gives, decoded and augmented by DALI.

    Args:
        source: a ``torch.utils.data.DataLoader`` (its dataset, batch size, shuffle and drop_last are used; its
            own batch sampler when there is a single shard) or an image dataset (then ``batch_size`` is needed).
        batch_size, shuffle, drop_last: for a dataset; with a DataLoader they come from it and must be left out.
        device: ``"cpu"``, ``"mixed"`` (decode on the GPU) or ``"auto"`` (``"mixed"`` when torch sees a GPU).
        num_threads: DALI threads (default: the CPUs this process may use, divided among the shards on this node).
        seed: seed of the random augmentations and of a sharded shuffle (default: ``torch.initial_seed()``).
        num_shards, shard_id: split each epoch into ``num_shards`` disjoint parts and load part ``shard_id``
            (default: the world size and rank of ``torch.distributed`` when it is initialised - so every DDP rank
            gets its own shard - else a single shard). A DataLoader whose sampler is already a
            ``DistributedSampler`` is used as it is.

    Every sample is seen once per epoch per shard, in the order of the (per-epoch reshuffled) sampler; Lightning
    calls ``set_epoch`` on it as on a DataLoader's. From a DataLoader (one shard), the order is the one that loader
    would give from the same RNG state: its sampler, and the seed draw its iterator makes first.
    """
    reason = missing()
    if reason is not None:
        raise ImportError(reason)
    if isinstance(source, DataLoader):
        _no_batching_arguments(batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
        if source.batch_sampler is None:
            raise Untranslatable("the DataLoader has batch_size=None (no automatic batching); DALI returns batches")
        dataset: Any = source.dataset
        batch_sampler = source.batch_sampler
        generator = source.generator
        before_epoch = (lambda: draw_seed(generator)) if draws_each_epoch(source) else None
        recipe = translate(dataset, source.collate_fn)
        size, shuffle, drop_last = source.batch_size, isinstance(source.sampler, RandomSampler), source.drop_last
        if isinstance(source.sampler, DistributedSampler):
            num_shards, shard_id = 1, 0  # already sharded
    else:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"loader_from(dataset, batch_size={batch_size!r}): a dataset needs batch_size, an int "
                             ">= 1")
        dataset, batch_sampler, recipe, before_epoch = source, None, translate(source), None
        size, shuffle, drop_last = batch_size, bool(shuffle), bool(drop_last)
    shards, shard = _shards(num_shards, shard_id)
    seed = torch.initial_seed() if seed is None else int(seed)
    if shards > 1 or batch_sampler is None:
        batch_sampler = _batch_sampler(dataset, size, shuffle, drop_last, shards, shard, seed)
    if device == "auto":
        device = "mixed" if torch.cuda.is_available() else "cpu"
    num_threads = _threads(device, shards) if num_threads is None else num_threads
    return DaliLoader(recipe, batch_sampler, device=device, num_threads=num_threads, seed=seed,
                      before_epoch=before_epoch)


def _threads(device: str, shards: int) -> int:
    """The CPUs this process may use, shared by the shards on this node: at most one per GPU with "mixed"; CPU
    shards are taken to share this node."""
    local = min(shards, torch.cuda.device_count()) if device == "mixed" else shards
    return max(1, cpus_available() // max(1, local))


def _no_batching_arguments(**given: Any) -> None:
    named = [k for k, v in given.items() if v is not None]
    if named:
        raise ValueError(f"loader_from(DataLoader, {', '.join(f'{k}=...' for k in named)}): these come from the "
                         "DataLoader; pass the dataset instead to choose them")


def _batch_sampler(dataset: Any, size: int | None, shuffle: bool, drop_last: bool, shards: int, shard: int,
                   seed: int) -> BatchSampler:
    """Batches of ``size`` drawn from this shard's part of each epoch (all of it for one shard)."""
    if shards > 1:
        sampler: Any = DistributedSampler(dataset, num_replicas=shards, rank=shard, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last)
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)) if shuffle else (
            SequentialSampler(dataset))
    if size is None:
        raise Untranslatable("the DataLoader's own batch sampler has no batch size, so it cannot be sharded")
    return BatchSampler(sampler, size, drop_last)


def _shards(num_shards: int | None, shard_id: int | None) -> tuple[int, int]:
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    shards = num_shards if num_shards is not None else (torch.distributed.get_world_size() if dist else 1)
    shard = shard_id if shard_id is not None else (torch.distributed.get_rank() if dist else 0)
    if not isinstance(shards, int) or shards < 1 or not isinstance(shard, int) or not 0 <= shard < shards:
        raise ValueError(f"loader_from(num_shards={shards!r}, shard_id={shard!r}): expected 0 <= shard_id < "
                         "num_shards")
    return shards, shard
