"""What a tuned loader configuration depends on: the key under which the cache keeps it."""

from __future__ import annotations

from typing import Any

import torch

from pipeopt._lightning import lightning_versions
from pipeopt._version import __version__
from pipeopt.measure.cpu import cpus_available
from pipeopt.tuning.loader_search import LoaderSettings


def _name(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def fit_parts(trainer: Any, pl_module: Any, loader: Any) -> dict[str, Any]:
    """Model class, dataset type and length, batch size and loader arguments, accelerator, CPUs, versions."""
    dataset = loader.dataset
    try:
        length: int | None = len(dataset)
    except TypeError:
        length = None
    device = trainer.strategy.root_device
    return {
        "model": _name(pl_module),
        "dataset": _name(dataset),
        "dataset_len": length,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": _name(loader.sampler),
        "collate_fn": getattr(loader.collate_fn, "__qualname__", _name(loader.collate_fn)),
        "loader": LoaderSettings.of(loader).as_kwargs(),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "accelerator": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "devices": trainer.num_devices,
        "nodes": trainer.num_nodes,
        "cpus": cpus_available(),
        "torch": torch.__version__,
        "lightning": lightning_versions(),
        "pipeopt": __version__,
    }
