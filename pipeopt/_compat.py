"""Every Lightning detail pipeopt relies on that is not a public API, in one module.

Checked against ``pytorch_lightning`` and ``lightning.pytorch`` 2.2 - 2.6 (the range pinned in pyproject.toml). A
Lightning upgrade that renames one of these breaks this file only; the callback warns when a seam stops answering.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

try:  # `pytorch-lightning` is the declared dependency; `lightning` is a separate install with distinct classes.
    import pytorch_lightning as _pl
except ImportError:  # pragma: no cover - only when a user installed `lightning` alone
    import lightning.pytorch as _pl  # type: ignore[no-redef]

from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn  # noqa: E402  (public re-exports)

#: Base class of the callback. A callback subclassing either namespace's ``Callback`` runs under both Trainers.
Callback = _pl.Callback

# Profiler action names the training loop uses (Trainer.profiler is the loop's own, public, timing seam):
#: ``_DataFetcher.__next__`` wraps exactly ``next(iterator)`` of the train loader in this action.
FETCH_ACTION = "[_TrainingEpochLoop].train_dataloader_next"
#: forward + backward + optimizer step of one batch (``automatic`` and ``manual`` optimization alike).
COMPUTE_ACTION = "run_training_batch"


def transfer_action(trainer: Any) -> str:
    """The action name under which the strategy moves a batch to the device (``Strategy.batch_to_device``)."""
    return f"[Strategy]{type(trainer.strategy).__name__}.batch_to_device"


def swap_profiler(trainer: Any, profiler: Any) -> Any:
    """Install ``profiler`` as the Trainer's profiler and return the previous one."""
    previous = trainer.profiler
    trainer.profiler = profiler
    return previous


def lightning_versions() -> dict[str, str]:
    """Installed versions of the Lightning distributions (``pytorch-lightning`` and/or ``lightning``)."""
    found = {}
    for dist in ("pytorch-lightning", "lightning"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found
