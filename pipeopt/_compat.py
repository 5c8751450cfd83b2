"""Every Lightning detail pipeopt relies on that is not a public API, in one module.

Tested with ``pytorch_lightning`` and ``lightning.pytorch`` 2.6 (the range declared in pyproject.toml). A
Lightning upgrade that renames one of these breaks this file only; the callback warns when a seam stops answering.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
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


# Profiler action names the training loop uses (Trainer.profiler is the loop's own, public, timing seam):
#: ``_DataFetcher.__next__`` wraps exactly ``next(iterator)`` of the train loader in this action.
FETCH_ACTION = "[_TrainingEpochLoop].train_dataloader_next"
#: forward + backward + optimizer step of one batch (``automatic`` and ``manual`` optimization alike).
COMPUTE_ACTION = "run_training_batch"


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
# torch DataLoader iterator internals (tested with torch 2.13 and 2.14).

#: Messages torch's DataLoader machinery raises when workers die, hang or run out of shared memory - as opposed to
#: an exception raised by the user's dataset, which must surface unchanged.
WORKER_FAILURE_MARKERS = (
    "DataLoader worker (pid",
    "DataLoader timed out after",
    "Pin memory thread exited unexpectedly",
)
SHM_MARKERS = ("/torch_", "shared memory", "No space left on device")


def is_worker_failure(err: BaseException) -> bool:
    msg = str(err)
    if not isinstance(err, RuntimeError):
        return False
    if any(marker in msg for marker in WORKER_FAILURE_MARKERS):
        return True
    return "in DataLoader worker" in msg and any(marker in msg for marker in SHM_MARKERS)


def take_index_stream(iterator: Any) -> Any:
    """Detach the main-process index stream from a running DataLoader iterator.

    Returns the iterator over the epoch's remaining (batches of) indices. The DataLoader iterator keeps what it
    already dispatched to its workers, delivers it, and then stops.
    """
    if hasattr(iterator, "take_index_stream"):  # pipeopt's own iterators (apply/batch.py's Recut, DALI's)
        return iterator.take_index_stream()
    stream = iterator._sampler_iter
    iterator._sampler_iter = iter(())
    return stream


def shutdown_iterator(iterator: Any) -> None:
    """Stop a DataLoader iterator's workers now (also for persistent workers, which otherwise wait for reuse)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def kill_workers(iterator: Any) -> None:
    """Terminate a failed DataLoader iterator's live workers at once, and shut the iterator down around them.

    torch's own shutdown joins each worker with a 5 s timeout before terminating it, so a trial whose workers hang
    would cost 5 s per worker; its batches are re-fed from the index stream, so nothing a worker held is needed.
    The workers leave torch's SIGCHLD watch first (otherwise their termination raises "worker killed" in the main
    thread, wherever it then is), and torch's shutdown is not run after them: it sets an event shared with the
    workers, whose lock a worker killed inside it still holds - the main process then waits forever.
    """
    detach_worker_watch(iterator)
    workers = getattr(iterator, "_workers", ())
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(timeout=1.0)
    if getattr(iterator, "_shutdown", True):  # single-process, or already shut down
        return
    iterator._shutdown = True
    pin_done = getattr(iterator, "_pin_memory_thread_done_event", None)
    if pin_done is not None:
        pin_done.set()  # the pin-memory thread (a daemon) sees it within its poll interval and ends
    for queue in getattr(iterator, "_index_queues", ()):  # as torch's shutdown does: its feeder thread ends
        queue.cancel_join_thread()
        queue.close()


def cached_iterator(loader: Any) -> Any:
    """The iterator a loader with persistent workers keeps for its next epoch (None otherwise)."""
    return getattr(loader, "_iterator", None)


def forget_cached_iterator(loader: Any, iterator: Any) -> None:
    """A loader with persistent workers caches its iterator for reuse; drop it once its workers are gone."""
    if getattr(loader, "_iterator", None) is iterator:
        loader._iterator = None


def set_fetch_timeout(iterator: Any, seconds: float) -> None:
    """Change how long a running iterator waits for a batch before raising (0: forever)."""
    if hasattr(iterator, "_timeout"):
        iterator._timeout = seconds


@contextlib.contextmanager
def quiet_worker_deaths() -> Iterator[None]:
    """Start a trial loader without torch's SIGCHLD handler raising for it.

    torch registers a new iterator's workers with its SIGCHLD handler before they start, and the handler raises
    in the main thread - anywhere - when one dies. A trial's worker that dies at once would then escape
    pipeopt. Inside this block the handler is paused; ``detach_worker_watch`` then removes the workers from its
    watch, and a death is reported by ``next()`` instead.
    """
    import signal
    import threading

    from torch.utils.data._utils import signal_handling

    if not hasattr(signal, "SIGCHLD") or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal_handling._set_SIGCHLD_handler()  # install torch's handler now, so it is the one restored below
    handler = signal.getsignal(signal.SIGCHLD)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, handler)


def detach_worker_watch(iterator: Any) -> None:
    """Stop torch's SIGCHLD handler from raising for this iterator's workers anywhere in the main thread.

    A dead worker of a trial is then reported where pipeopt can survive it: in ``next()`` on the iterator.
    """
    if getattr(iterator, "_worker_pids_set", False):
        import torch

        torch._C._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False


def attach_worker_watch(iterator: Any) -> None:
    """Undo ``detach_worker_watch`` (for the iterator that the run keeps)."""
    workers = getattr(iterator, "_workers", None)
    if workers and not getattr(iterator, "_worker_pids_set", True):
        import torch

        torch._C._set_worker_pids(id(iterator), tuple(w.pid for w in workers))
        iterator._worker_pids_set = True


def ready_batches(iterator: Any) -> int | None:
    """Batches a DataLoader iterator's workers have finished that the training loop has not taken yet: results in
    its queues (a worker's result counts from the moment it is put) plus results that arrived out of order and wait
    in ``_task_info``. 0 for a single-process iterator; None where torch's queues cannot be counted. pipeopt's own
    iterators (DALI's) count their own."""
    if callable(getattr(iterator, "ready_batches", None)):
        return iterator.ready_batches()
    if not hasattr(iterator, "_worker_result_queue"):
        return 0 if hasattr(iterator, "_sampler_iter") else None
    try:
        ready = iterator._worker_result_queue.qsize()
        data_queue = getattr(iterator, "_data_queue", None)
        if data_queue is not None and data_queue is not iterator._worker_result_queue:
            ready += data_queue.qsize()  # pin-memory thread: pinned results wait in a second queue
    except (NotImplementedError, OSError, AttributeError):  # qsize() is not implemented on macOS
        return None
    return ready + sum(1 for info in getattr(iterator, "_task_info", {}).values() if len(info) == 2)


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


def planned_steps(trainer: Any) -> int | None:
    """The optimizer steps the whole fit will run, from ``max_steps`` and ``max_epochs`` x the epoch's steps (None
    when neither bounds it)."""
    limits = []
    if trainer.max_steps not in (None, -1):
        limits.append(int(trainer.max_steps))
    batches = trainer.num_training_batches
    if trainer.max_epochs not in (None, -1) and batches not in (None, float("inf")):
        limits.append(int(trainer.max_epochs) * -(-int(batches) // max(1, int(trainer.accumulate_grad_batches))))
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
