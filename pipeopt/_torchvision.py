"""Recognising torchvision datasets and transforms by class and module, without importing torchvision: a dataset
pipeopt cannot rebuild is explained the same way on a machine without it. Used by the DALI recipe and the sample
cache."""

from __future__ import annotations

from typing import Any


def is_a(obj: Any, name: str, module: str) -> bool:
    """``obj`` is an instance of a class ``name`` from ``module`` (or a subclass of one)."""
    return any(c.__name__ == name and c.__module__.startswith(module) for c in type(obj).__mro__)


def is_transform(obj: Any, name: str | None = None) -> bool:
    """``obj`` is a torchvision transform (v1 or v2), of class ``name`` when given."""
    cls = type(obj)
    if not cls.__module__.startswith("torchvision.transforms"):
        return False
    return name is None or cls.__name__ == name


def flatten(transform: Any) -> list[Any]:
    """A transform chain's steps in order, nested ``Compose`` unrolled."""
    if is_transform(transform, "Compose"):
        return [t for inner in transform.transforms for t in flatten(inner)]
    return [transform]


def unwrap_subsets(dataset: Any) -> tuple[Any, list[int] | None]:
    """The dataset under any ``Subset`` wrappers, and its positions for theirs (None: no wrapper)."""
    indices: list[int] | None = None
    while is_a(dataset, "Subset", "torch.utils.data"):
        inner = [int(i) for i in dataset.indices]
        indices = inner if indices is None else [inner[i] for i in indices]
        dataset = dataset.dataset
    return dataset, indices


def folder_class(dataset: Any) -> Any:
    """torchvision's ``DatasetFolder`` when ``dataset`` is one (an ``ImageFolder`` included), else None."""
    return next((c for c in type(dataset).__mro__
                 if c.__name__ == "DatasetFolder" and c.__module__.startswith("torchvision.datasets")), None)


def name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__
