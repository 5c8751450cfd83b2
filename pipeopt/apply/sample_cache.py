"""The deterministic part of each sample, made once and then read from a store every process shares.

``plan(dataset)`` splits ``dataset[i]`` into a part to cache and a part to run every time, or says why it cannot:

- torchvision ``ImageFolder`` / ``DatasetFolder`` (and ``Subset`` of one): the file read and decode, then the
  transforms up to the first random (or unknown) one - ``Resize``, ``CenterCrop``, ``Grayscale``, ``PILToTensor`` /
  ``ToImage`` - stopping before the pixels become floats (``ToTensor``, ``ToDtype``, ``Normalize``), so the store holds
  uint8 images. Everything after the cut (``RandomResizedCrop``, flips, ``ToTensor``, ``Normalize``...) and the
  ``target_transform`` run after the store, in the workers, as before. A chain with nothing random in it (a
  validation chain: ``Resize``, ``CenterCrop``, ``ToTensor``, ``Normalize``) is cached whole - the images as the
  model sees them, floats included: 4x the bytes, but nothing left to do per sample but the ``target_transform``.
- any other map-style dataset: the whole item, when it is shown deterministic.

Either way the cached part is *shown* deterministic before anything is stored (``deterministic``): a few items made
twice under different seeds of torch's, NumPy's and ``random``'s global generators must be equal bit for bit, and
making one must not draw from any of them (a draw that skipping it on a hit would leave out would move the random
numbers everything after it sees). The generators are put back as they were afterwards.

``CachedDataset`` is what a pipeopt loader reads: it makes the cached part of an item on a miss and stores it (every
loader pipeopt builds fills the store), and - when ``read`` - takes it from the store on a hit.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from pipeopt import _dataloader
from pipeopt._torchvision import flatten, folder_class, is_transform, unwrap_subsets
from pipeopt.apply.sample_store import SampleStore, decode, encode, image_array

#: torchvision transforms that draw no random numbers and give the same output for the same input.
DETERMINISTIC = frozenset({"Resize", "CenterCrop", "Grayscale", "PILToTensor", "ToImage", "ToPILImage", "ToTensor",
                           "ToDtype", "ConvertImageDtype", "Normalize"})
#: Where the cached part stops at the latest: these make float pixels (4x the bytes of the uint8 ones before them).
TO_FLOAT = frozenset({"ToTensor", "ToDtype", "ConvertImageDtype", "Normalize"})
#: Cached steps DALI can go on from: fed the stored images, its pipeline runs the rest of the chain (``dali_reads``).
DALI_GOES_ON = frozenset({"Resize", "CenterCrop"})
#: Items made twice in the determinism check (spread over the dataset).
CHECKED_ITEMS = 3
_MISSING = object()  # not in the store


class FolderSplit:
    """An ``ImageFolder``'s items as (decoded, cut-transformed image) then the rest of the chain and the label."""

    def __init__(self, folder: Any, positions: list[int] | None, cached: list[Any], rest: list[Any]) -> None:
        self.folder, self.positions, self.cached, self.rest = folder, positions, cached, rest

    def __len__(self) -> int:
        return len(self.positions) if self.positions is not None else len(self.folder)

    def _sample(self, i: int) -> tuple[str, int]:
        return self.folder.samples[self.positions[i] if self.positions is not None else i]

    def make(self, i: int) -> Any:
        image = self.folder.loader(self._sample(i)[0])
        for t in self.cached:
            image = t(image)
        return image

    @property
    def whole(self) -> bool:
        """Nothing but the ``target_transform`` is left to do per sample after the store."""
        return not self.rest

    def finish(self, image: Any, i: int) -> Any:
        for t in self.rest:
            image = t(image)
        return image, self._target(i)

    def finish_rows(self, images: Sequence[Any], positions: np.ndarray) -> Sequence[Any]:
        """``finish`` of a batch's images read from the store (``SampleStore.get_rows``). Images that come
        ``Collated`` with nothing left to run on them keep coming so: with the labels, as torch's default collate
        makes the batch of the items (the images' tensor, the labels collated) - not walked item by item."""
        if self.rest or not isinstance(images, _dataloader.Collated):
            return [self.finish(image, i) for image, i in zip(images, positions.tolist())]
        labels = self._labels if self.folder.target_transform is None else None
        if labels is not None:  # the labels' batch as torch's collate makes it of the ints, in one step
            picked = labels[positions]  # (a new array: the batch's tensor of labels is made over it)
            return _dataloader.Collated(lambda: list(zip(images, picked.tolist())),
                                        [images.batch, torch.from_numpy(picked)], len(picked))
        targets = [self._target(i) for i in positions.tolist()]  # the user's target_transform: once an item, now
        collated = _dataloader.collate_rows(targets)
        return _dataloader.Collated(lambda: list(zip(images, targets)), [images.batch, collated], len(targets))

    @functools.cached_property
    def _labels(self) -> np.ndarray | None:
        """Each position's label where every one is an int (a DatasetFolder's class index), else None: made once."""
        samples = self.folder.samples
        labels = [samples[p][1] for p in self.positions] if self.positions is not None else [t for _, t in samples]
        if not all(type(t) is int for t in labels):
            return None
        try:
            return np.array(labels, dtype=np.int64)
        except OverflowError:
            return None

    def _target(self, i: int) -> Any:
        target = self._sample(i)[1]
        return target if self.folder.target_transform is None else self.folder.target_transform(target)

    def describe(self) -> str:
        steps = ", ".join(type(t).__name__ for t in self.cached)
        form = "as the model sees it" if not self.rest and self.cached else "uint8"
        return f"each image read and decoded{f', then {steps}' if steps else ''} ({form})"


class WholeSplit:
    """Any map-style dataset shown deterministic: the whole item is cached."""

    whole = True  # nothing is left to do per sample after the store

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def make(self, i: int) -> Any:
        return self.dataset[i]

    def finish(self, item: Any, i: int) -> Any:
        return item

    def finish_rows(self, items: Sequence[Any], positions: np.ndarray) -> Sequence[Any]:
        return items

    def describe(self) -> str:
        return f"each whole item of the {type(self.dataset).__name__}"


Split = FolderSplit | WholeSplit


def plan(dataset: Any) -> Split | str:
    """How ``dataset``'s items split into a cached part and the rest - or why none can be cached."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return f"the dataset ({type(dataset).__name__}) is not a map-style dataset with a length"
    inner, positions = unwrap_subsets(dataset)  # a Subset's own __getitems__ only gathers its dataset's items
    if hasattr(inner, "__getitems__"):
        return (f"the dataset ({type(inner).__name__}) makes whole batches (__getitems__); pipeopt caches single "
                "items only")
    folder = folder_class(inner)
    if folder is None or type(inner).__getitem__ is not folder.__getitem__:
        return WholeSplit(dataset)
    steps = flatten(inner.transform) if inner.transform is not None else []
    if all(is_transform(t) and type(t).__name__ in DETERMINISTIC for t in steps):
        return FolderSplit(inner, positions, steps, [])  # nothing random: the whole chain, floats and all
    cut = 0
    while cut < len(steps) and is_transform(steps[cut]) and type(steps[cut]).__name__ in DETERMINISTIC - TO_FLOAT:
        cut += 1
    return FolderSplit(inner, positions, steps[:cut], steps[cut:])


# -- shown deterministic ----------------------------------------------------------------------------------------
def _rng_states() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _same_states(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    (ta, ra, na), (tb, rb, nb) = a, b
    return (torch.equal(ta, tb) and ra == rb and na[0] == nb[0] and np.array_equal(na[1], nb[1])
            and tuple(na[2:]) == tuple(nb[2:]))


@contextmanager
def _global_rngs_kept() -> Iterator[None]:
    saved = _rng_states()
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def deterministic(make: Callable[[int], Any], positions: Sequence[int]) -> tuple[str | None, bytes]:
    """Whether ``make(i)`` is deterministic on ``positions``: (None, a digest of the items) when each is equal bit for
    bit under two different seeds of every global generator and draws from none; otherwise (the reason, b"").
    The global generators are as they were when it returns."""
    digest = hashlib.sha256()
    with _global_rngs_kept():
        made: list[list[bytes]] = []
        for seed in (20240601, 7):
            _seed_all(seed)
            round_: list[bytes] = []
            for i in positions:
                before = _rng_states()
                item = make(i)
                if not _same_states(before, _rng_states()):
                    return (f"making item {i} draws from a global random generator (torch, NumPy or random): it is "
                            "random, so it is not cached"), b""
                round_.append(encode(item))
            made.append(round_)
        for i, first, second in zip(positions, *made):
            if first != second:
                return (f"item {i} differed between two fetches under different random seeds: the dataset is not "
                        "deterministic, so it is not cached"), b""
            digest.update(first)
    return None, digest.digest()


def dali_reads(split: Split) -> int | None:
    """How many of the chain's first steps the stored images went through, where DALI can be fed them instead of the
    files and run the rest (a random crop, a flip, the float conversion) - no decode: an ``ImageFolder`` split with a
    random step left whose cached steps are only ``Resize`` and ``CenterCrop`` (the store holds the PIL images, the
    first steps of DALI's recipe too). None where it cannot."""
    if not isinstance(split, FolderSplit) or split.whole:
        return None
    return len(split.cached) if all(type(t).__name__ in DALI_GOES_ON for t in split.cached) else None


def check_positions(length: int) -> list[int]:
    """The items the determinism check makes: the first, the middle and the last."""
    return sorted({0, length // 2, length - 1})[:CHECKED_ITEMS]


def refusal(split: Split) -> tuple[str | None, bytes]:
    """Why the split's cached part may not be cached (None when it may), and a digest of the items checked."""
    try:
        return deterministic(split.make, check_positions(len(split)))
    except Exception as err:  # the user's dataset raised: it is left alone, and the report says so
        return f"making an item to check it raised {type(err).__name__}: {err}", b""


def fingerprint(split: Split, digest: bytes) -> str:
    """Names a store: the dataset's kind, length and cut, and the bytes of the items checked."""
    h = hashlib.sha256(digest)
    inner = split.folder if isinstance(split, FolderSplit) else split.dataset
    h.update(f"{type(inner).__module__}.{type(inner).__qualname__}|{len(split)}|{split.describe()}".encode())
    if isinstance(split, FolderSplit):
        h.update(repr(split.cached).encode())
        h.update(str(getattr(split.folder, "root", "")).encode())
    return h.hexdigest()[:16]


def _positions(indices: Sequence[int]) -> np.ndarray | None:
    """A batch's indices as int64 positions; None where one is past any int64 (no position of any store)."""
    try:
        return np.fromiter(map(operator.index, indices), dtype=np.int64, count=len(indices))
    except OverflowError:
        return None


class CachedDataset(Dataset):
    """The user's dataset, with the cached part of each item made at most once: on a miss it is made and stored;
    when ``read``, a stored one is decoded instead of made. Items equal the user's bit for bit."""

    def __init__(self, split: Split, store: SampleStore, *, read: bool, rows: bool = False) -> None:
        self.split, self.store, self.read = split, store, read
        self.rows = rows and read and split.whole  # read a batch's whole items straight into rows of its tensors
        self.full = False  # this process saw the budget (or the file system) run out: it stops trying to store
        self.broken = False  # this process could not reach the store: it makes every item, as without it

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: Any) -> Any:
        i = self._position(i)
        # an index out of range is the dataset's to refuse (as it would without the store), not a broken store
        part = self._stored(i) if self.read and not self.broken and 0 <= i < len(self) else _MISSING
        if part is _MISSING:
            part = self._make(i)
        return self.split.finish(part, i)

    def __getitems__(self, indices: list[int]) -> Sequence[Any]:
        """A batch's items (the DataLoader collates them). With ``rows``, whole items stored for every index are read
        straight into one tensor per field of the batch (``SampleStore.get_rows``: ``_dataloader.collate_rows`` hands
        it on without stacking); any other batch is read item by item."""
        if self.rows and not self.broken:
            # (a negative index, one past the end or past any int64 is no position of the store: item by item, below)
            positions = _positions(indices)
            try:
                items = None if positions is None else self.store.get_rows(positions)
            except Exception:  # the store cannot be read: made as without it, from now on
                self.broken, items = True, None
            if items is not None and positions is not None:
                return self.split.finish_rows(items, positions)
        return [self[i] for i in indices]

    def image(self, i: int) -> np.ndarray:
        """Item ``i``'s cached part, an image, as a height x width x 3 uint8 RGB array (what DALI's pipeline is fed):
        a view of the store's bytes (no copy: valid while the store is open), else made - and stored - on a miss. A
        cached part that is not a PIL image raises ``TypeError``."""
        try:
            raw = None if self.broken else self.store.view(i)
            array = image_array(raw) if raw is not None else None
        except Exception:  # the store cannot be read: made as without it, from now on
            self.broken, raw, array = True, None, None
        if array is not None:
            return array
        part = decode(raw) if raw is not None else self._make(i)
        if not callable(getattr(part, "convert", None)):
            raise TypeError(f"the dataset's loader gave a {type(part).__name__}, not a PIL image: DALI cannot be fed "
                            "it from the sample cache")
        return np.asarray(part if part.mode == "RGB" else part.convert("RGB"))

    def _position(self, i: Any) -> int:
        i = operator.index(i)
        return i + len(self.split) if i < 0 else i

    def fill(self, i: int) -> None:
        """Make and store item ``i``'s cached part unless the store has it; nothing is returned, nothing after the
        cut runs (the work of ``apply.backfill``)."""
        if not self.broken and not self.store.has(i):
            self._make(i)

    def _make(self, i: int) -> Any:
        """Item ``i``'s cached part, made (the user's code: its exceptions are the user's) and stored."""
        part = self.split.make(i)
        self._keep(i, part)
        return part

    def _keep(self, i: int, part: Any) -> None:
        if not self.broken:
            try:
                self._offer(i, part)
            except Exception:  # pipeopt's store never fails a fetch: this process leaves it alone
                self.broken = True

    def _stored(self, i: int) -> Any:
        """The stored part of item ``i``, or ``_MISSING`` (not stored; or the store cannot be read - removed under a
        running loader, say - and this process makes every item from now on, as without it)."""
        try:
            raw = self.store.get(i)
            return _MISSING if raw is None else decode(raw)
        except Exception:  # any failure to read the store: made as without it
            self.broken = True
            return _MISSING

    def _offer(self, i: int, part: Any) -> None:
        if self.full:
            self.store.note_unstored()
        elif not self.store.has(i):
            started = time.thread_time_ns()
            self.full = not self.store.put(i, encode(part), started) and not self.store.taken(i)


class SampleCache:
    """A fit's sample store and how its items split: the datasets pipeopt's loaders read, the store's figures."""

    def __init__(self, split: Split, store: SampleStore, *, keep: bool = False) -> None:
        self.split, self.store, self.keep = split, store, keep
        self.on_close: list[Callable[[], None]] = []  # work that fills the store, stopped before it goes

    def dataset(self, *, read: bool, rows: bool = False) -> CachedDataset:
        return CachedDataset(self.split, self.store, read=read, rows=rows)

    def close(self) -> None:
        """The fit is over: what still fills the store stops, and the store is deleted, unless it is to be kept for a
        rerun."""
        while self.on_close:
            self.on_close.pop()()
        if self.keep:
            self.store.close()
        else:
            self.store.remove()
