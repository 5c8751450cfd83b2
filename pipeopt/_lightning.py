"""Every Lightning detail pipeopt relies on that is not a public API, in one module (the torch DataLoader's are in
``pipeopt._dataloader``).

Tested with ``pytorch_lightning`` and ``lightning.pytorch`` 2.6 (the range declared in pyproject.toml). A
Lightning upgrade that renames one of these breaks this file only; the callback warns when a seam stops answering.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from types import ModuleType
from typing import Any

# `rank_zero_warn` is lightning_utilities' own, shared by both Lightning distributions: importing it imports neither.
from lightning_utilities.core.rank_zero import rank_zero_warn  # noqa: F401  (re-exported)

# ---------------------------------------------------------------------------------------------------------------
# Which Lightning. `pytorch-lightning` installs `pytorch_lightning`, `lightning` installs `lightning.pytorch`: distinct
# classes, and a shared rank-zero logger that follows whichever was imported last. pipeopt imports neither at import
# time and never the one a program does not use.

#: The two namespaces, by import name.
NAMESPACES = ("pytorch_lightning", "lightning.pytorch")
#: Where each keeps its Trainer class (patched by ``pipeopt tune`` as soon as it is imported).
TRAINER_MODULES = tuple(f"{namespace}.trainer.trainer" for namespace in NAMESPACES)


def lightning_in_use() -> ModuleType:
    """The Lightning namespace this program trains with, importing nothing new when one is loaded: the one already
    imported (the later one where both are), else ``pytorch_lightning`` (pipeopt's declared dependency), else
    ``lightning.pytorch``."""
    loaded = [name for name in sys.modules if name in NAMESPACES]  # in import order
    if loaded:
        return sys.modules[loaded[-1]]
    try:
        return importlib.import_module("pytorch_lightning")
    except ImportError:
        return importlib.import_module("lightning.pytorch")


def namespace_of(obj: Any) -> ModuleType:
    """The Lightning namespace an object belongs to: a Trainer, or a user's LightningModule through its bases."""
    for cls in type(obj).__mro__:
        name = next((ns for ns in NAMESPACES if cls.__module__ == ns or cls.__module__.startswith(ns + ".")), None)
        if name is not None:
            return sys.modules[name]
    return lightning_in_use()


_CALLBACK_CLASSES: dict[tuple[type, type], type] = {}


def as_callback_class(cls: type, namespace: str | None = None) -> type:
    """``cls`` when it already derives from a loaded Lightning ``Callback``; otherwise ``cls`` joined with the
    ``Callback`` of ``namespace`` (default: the Lightning in use), made once per pair, named and pickled as ``cls``.
    A callback of either namespace runs under both Trainers."""
    for name in NAMESPACES:
        module = sys.modules.get(name)
        if module is not None and issubclass(cls, module.Callback):
            return cls
    lightning = importlib.import_module(namespace) if namespace else lightning_in_use()
    base = lightning.Callback
    made = _CALLBACK_CLASSES.get((cls, base))
    if made is None:
        made = type(cls.__name__, (cls, base), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                               "__doc__": cls.__doc__, "_lightning_namespace": lightning.__name__})
        _CALLBACK_CLASSES[(cls, base)] = made
    return made


def new_callback(cls: type, namespace: str) -> Any:
    """Unpickling: an empty instance of ``cls`` joined with ``namespace``'s ``Callback`` (see ``as_callback_class``)."""
    return object.__new__(as_callback_class(cls, namespace))


class JoinedCallback:
    """Base of a callback that names no Lightning: each instance's class joins the ``Callback`` of the Lightning the
    program already imported (``as_callback_class``), and pickles (``ddp_spawn``, ``copy.deepcopy``) as the user's
    class and the namespace it joined."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__new__(as_callback_class(cls))

    def __reduce_ex__(self, protocol: Any) -> Any:
        namespace = type(self).__dict__.get("_lightning_namespace")
        if namespace is None:  # a subclass that names its Lightning Callback base itself pickles as usual
            return super().__reduce_ex__(protocol)
        return (new_callback, (type(self).__mro__[1], namespace), self.__getstate__())

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)


# Profiler action names the training loop uses (Trainer.profiler is the loop's own, public, timing seam):
#: ``_DataFetcher.__next__`` wraps exactly ``next(iterator)`` of the train loader in this action.
FETCH_ACTION = "[_TrainingEpochLoop].train_dataloader_next"
#: forward + backward + optimizer step of one batch (``automatic`` and ``manual`` optimization alike).
COMPUTE_ACTION = "run_training_batch"


def reduce_max(trainer: Any, values: list[float]) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks of the fit (identity on one process)."""
    if trainer is None or trainer.world_size <= 1:
        return values
    import torch

    tensor = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
    return list(trainer.strategy.reduce(tensor, reduce_op="max").tolist())


def log_metrics(trainer: Any, metrics: dict[str, float], step: int) -> None:
    """``metrics`` to every logger of the Trainer at ``step`` - nothing when there is nothing to log."""
    if metrics:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def logger_step(trainer: Any) -> int:
    """The step Lightning's loggers give the batch whose ``on_train_batch_end`` is running: batches that stepped an
    optimizer before it (``_TrainingEpochLoop._batches_that_stepped``, incremented after that hook)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


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


# ---------------------------------------------------------------------------------------------------------------
# Where a running fit keeps its train loaders (Lightning privates).


def train_combined_loader(trainer: Any) -> Any:
    """The fit's ``CombinedLoader`` (``.flattened`` is its list of loaders), or None before data is set up."""
    return getattr(trainer.fit_loop, "_combined_loader", None)


def live_train_iterators(trainer: Any) -> list[Any] | None:
    """The iterators the running epoch pulls from (mutable: replacing an item redirects the epoch)."""
    combined = train_combined_loader(trainer)
    mode_iterator = getattr(combined, "_iterator", None)
    return getattr(mode_iterator, "iterators", None)


# ---------------------------------------------------------------------------------------------------------------
# Precision plugins (public classes; where the strategy keeps its plugin is the seam).


def precision_of(trainer: Any) -> str:
    """The run's precision flag, e.g. ``"32-true"`` (Lightning's default) or ``"bf16-mixed"``."""
    return str(trainer.strategy.precision_plugin.precision)


def precision_plugin(trainer: Any, precision: str, device_type: str) -> Any:
    """A fresh plugin for ``precision`` from the trainer's own Lightning namespace: autocast-style ``MixedPrecision``
    for the mixed ones (``16-mixed`` with its own gradient scaler), the plain ``Precision`` for ``32-true``."""
    plugins = importlib.import_module(namespace_of(trainer).__name__ + ".plugins.precision")
    if precision == "32-true":
        return plugins.Precision()
    return plugins.MixedPrecision(precision, device_type)


def set_precision_plugin(trainer: Any, plugin: Any) -> None:
    """Swap the strategy's precision plugin on a running fit. Safe for autocast-style plugins only: a later swap
    skips the module conversion a true-half plugin would need."""
    trainer.strategy.precision_plugin = plugin


# ---------------------------------------------------------------------------------------------------------------
# Batch plans: where a fit keeps its epoch length and accumulation (Lightning privates and attributes).


def accumulation(trainer: Any) -> int:
    return int(trainer.accumulate_grad_batches)


def train_setup(trainer: Any) -> tuple[list[Any], int, Any]:
    """What pipeopt may change of a fit's training set-up: its train loaders, the accumulation and the precision
    plugin (for ``restore_train_setup``)."""
    combined = train_combined_loader(trainer)
    loaders = list(combined.flattened) if combined is not None else []
    return loaders, int(trainer.accumulate_grad_batches), trainer.strategy.precision_plugin


def restore_train_setup(trainer: Any, setup: tuple[list[Any], int, Any]) -> None:
    """Put back what ``train_setup`` saw, for whatever runs on this trainer next."""
    loaders, accumulate, plugin = setup
    combined = train_combined_loader(trainer)
    if combined is not None and loaders:
        combined.flattened = loaders
    trainer.accumulate_grad_batches = accumulate
    trainer.strategy.precision_plugin = plugin


def steps_per_epoch(trainer: Any) -> int | None:
    """Optimizer steps in an epoch (a short last accumulation steps too); None for an epoch of unknown length."""
    batches = trainer.num_training_batches
    if batches in (None, float("inf")):
        return None
    return -(-int(batches) // max(1, int(trainer.accumulate_grad_batches)))


def planned_steps(trainer: Any) -> int | None:
    """The optimizer steps the whole fit will run, from ``max_steps`` and ``max_epochs`` x the epoch's steps (None
    when neither bounds it)."""
    limits = []
    if trainer.max_steps not in (None, -1):
        limits.append(int(trainer.max_steps))
    per_epoch = steps_per_epoch(trainer)
    if trainer.max_epochs not in (None, -1) and per_epoch is not None:
        limits.append(int(trainer.max_epochs) * per_epoch)
    return min(limits) if limits else None


def batches_this_epoch(trainer: Any) -> int:
    """The batches Lightning counted in the running epoch (it steps the optimizer when a multiple of the
    accumulation is reached)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def epoch_ends_here(trainer: Any) -> bool:
    """The batch just trained is the epoch's last (Lightning steps on it whatever the accumulation)."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def install_train_loader(trainer: Any, loader: Any, accumulate: int, epoch_iterator: Any = None, *,
                         epoch_batches: int | None = None) -> None:
    """Train on ``loader`` with ``accumulate`` batches per optimizer step, from the next batch on.

    Lightning sized the running epoch from the previous loader - the loop's ``max_batches``, the fetcher's length
    (its ``is_last_batch``), the validation interval - and created its iterator; ``epoch_iterator`` (the rest of
    the running epoch, re-cut) replaces that iterator, the running epoch is sized to ``epoch_batches`` (its
    batches so far and those left; default: the loader's length), and later epochs take the loader's length.
    Only for ``limit_train_batches=1.0`` and ``val_check_interval=1.0``."""
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    combined.flattened = [loader]
    combined.limits = [len(loader)]
    mode = getattr(combined, "_iterator", None)
    if mode is not None:
        mode.iterables = list(combined.flattened)
        mode.limits = [len(loader)]
        if epoch_iterator is not None:
            mode.iterators[0] = epoch_iterator
    length = len(loader) if epoch_batches is None else epoch_batches
    size_train_epoch(trainer, length)
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    if fetcher is not None:
        fetcher.length = length
        fetcher.done = fetcher.fetched >= length
    trainer.accumulate_grad_batches = accumulate


def size_train_epoch(trainer: Any, length: int) -> None:
    """The running epoch has ``length`` batches: where it ends and (``val_check_interval=1.0``) validates."""
    trainer.fit_loop.max_batches = length
    if getattr(trainer, "val_check_batch", None) not in (None, float("inf")):
        trainer.val_check_batch = max(1, length)
