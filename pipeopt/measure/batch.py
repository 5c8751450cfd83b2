"""How many samples a batch holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the first tensor found in ``batch`` (depth first); None when there is none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        children = batch.values()
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        children = (getattr(batch, f.name) for f in dataclasses.fields(batch))
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        children = batch
    else:
        return None
    for child in children:
        size = batch_size(child)
        if size is not None:
            return size
    return None
