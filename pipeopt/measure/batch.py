"""One walker over the batches a DataLoader yields: how many samples a batch holds, a slice of its samples, and
consecutive batches joined into one - for every shape a ``collate_fn`` produces.

Containers are walked and rebuilt as their own type: tuples, lists, namedtuples, dicts and any other ``Mapping``
(``OrderedDict``, a ``UserDict`` like Hugging Face's ``BatchEncoding``), dataclasses, nested mixes. Leaves with a
batch dimension are tensors (sliced and concatenated along it) and *per-sample lists*: a list holding one value
per sample (ids, strings, a padding collate's ragged tensors) - told from a container list ``[inputs, targets]`` by
its items, which do not all carry the batch. Anything else (a scalar, a string, a 0-d tensor) is shared by the whole
batch and kept as it is. (Lightning's ``apply_to_collection`` and torch's pytree walk the same containers, but
neither knows a per-sample list from a container list, nor joins several batches.)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch


def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _children(value: Any) -> list[Any] | None:
    """The items of a container (None for a leaf)."""
    if isinstance(value, Mapping):
        return list(value.values())
    if _is_dataclass(value):
        return [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def _leading(value: Any) -> int | None:
    """The batch dimension a tensor leaf carries, or the first one found inside a container."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() > 0 else None
    for child in _children(value) or ():
        size = _leading(child)
        if size is not None:
            return size
    return None


def batch_size(batch: Any) -> int | None:
    """Samples in ``batch``: the leading dimension of its first tensor (depth first); a batch without tensors, the
    length of its first list; None when it has neither."""
    size = _leading(batch)
    if size is not None:
        return size
    if isinstance(batch, list):
        return len(batch)
    for child in _children(batch) or ():
        size = batch_size(child)
        if size is not None:
            return size
    return None


def _per_sample(value: Any, n: int) -> bool:
    """A list of one value per sample, as opposed to a container list whose every item carries the batch."""
    return isinstance(value, list) and len(value) == n and not all(_leading(v) == n for v in value)


def _rebuild(template: Any, items: list[Any]) -> Any:
    """A container like ``template`` holding ``items`` (in ``_children`` order)."""
    if isinstance(template, Mapping):
        pairs = dict(zip(template.keys(), items))
        if isinstance(template, MutableMapping):
            out = copy.copy(template)  # keeps the class and its attributes (a defaultdict's factory, a UserDict's)
            out.update(pairs)
            return out
        mapping: Any = type(template)  # a Mapping class, rebuilt from its pairs
        return mapping(pairs)
    if _is_dataclass(template):
        out = copy.copy(template)
        for field, item in zip(dataclasses.fields(template), items):
            object.__setattr__(out, field.name, item)  # frozen dataclasses too
        return out
    if hasattr(template, "_fields"):  # a namedtuple
        return type(template)(*items)
    return type(template)(items)


def _walk(parts: list[Any], n: int, leaf: Callable[[list[Any]], Any]) -> Any:
    """Walk batches of the same structure in step; ``leaf`` turns the parts' values at each batched leaf into one."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return leaf(parts) if first.dim() > 0 else first
    if _per_sample(first, n):
        return leaf(parts)
    children = _children(first)
    if children is None:
        return first
    columns: list[Any] = [_children(p) for p in parts]  # the same structure as ``first``: children too
    return _rebuild(first, [_walk([c[i] for c in columns], n, leaf) for i in range(len(children))])


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of ``batch``, in its own structure."""
    n = batch_size(batch)
    if n is None:
        return batch
    return _walk([batch], n, lambda values: values[0][start:stop])


def concat_batches(parts: list[Any]) -> Any:
    """Consecutive batches of one structure joined into one batch of all their samples, in order. Tensors are
    concatenated along the batch dimension, so their other dimensions must agree (a padding ``collate_fn`` pads
    each batch to its own length: such batches are not joined - see ``RaggedBatches``)."""
    n = batch_size(parts[0])
    if n is None or len(parts) == 1:
        return parts[0]

    def join(values: list[Any]) -> Any:
        if isinstance(values[0], torch.Tensor):
            if any(v.shape[1:] != values[0].shape[1:] for v in values):
                raise RaggedBatches(f"batches of shapes {[tuple(v.shape) for v in values]} cannot be joined")
            return torch.cat(values)
        return [item for value in values for item in value]

    return _walk(parts, n, join)


class RaggedBatches(ValueError):
    """Batches whose tensors differ beyond the batch dimension (padded to different lengths) cannot be joined."""
