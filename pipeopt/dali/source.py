"""DALI as a candidate of the live loader search: the ``LoaderSource`` the switcher starts for DALI settings."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from pipeopt.apply.index_stream import ResumingSampler, draw_seed
from pipeopt.apply.loader import user_epoch_draw
from pipeopt.apply.sample_cache import CachedDataset, dali_reads
from pipeopt.dali.loader import DaliLoader
from pipeopt.dali.pipeline import missing
from pipeopt.dali.recipe import Recipe, Untranslatable, translate


def blocker(user: DataLoader) -> str | None:
    """Why DALI cannot replace this loader (None when it can)."""
    if user.batch_sampler is None:
        return "the loader has batch_size=None (no automatic batching); DALI returns batches"
    try:
        translate(user.dataset, user.collate_fn)
    except Untranslatable as err:
        return f"DALI cannot rebuild this loader: {err}"
    return missing()


class DaliSource:
    """Starts DALI loaders giving the user's batches, with ``num_threads`` decoding threads; the user's dataset is
    translated once (a trial, its repeat and the after-window share the recipe)."""

    def __init__(self, num_threads: int) -> None:
        self._threads = num_threads
        self._recipe: Recipe | None = None

    def start(self, user: DataLoader, device: str, *, first: Iterator[Any], generator: torch.Generator,
              cache: CachedDataset | None = None) -> tuple[Iterator[Any], Any]:
        """A DALI loader continuing ``first``; with ``cache``, fed the decoded images it holds (``dali_reads``)
        instead of the files."""
        if self._recipe is None:
            self._recipe = translate(user.dataset, user.collate_fn)
        decoded = dali_reads(cache.split) if cache is not None else None
        if cache is not None and decoded is None:
            raise ValueError(f"DALI cannot be fed this sample cache's items: {cache.split.describe()}")
        sampler = ResumingSampler(user.batch_sampler, first, user_epoch_draw(user, generator))
        loader = DaliLoader(self._recipe, sampler, device=device, num_threads=self._threads, seed=draw_seed(generator),
                            images=cache.image if cache is not None else None, decoded=decoded or 0)
        return iter(loader), loader
