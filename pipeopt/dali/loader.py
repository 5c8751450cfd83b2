"""A train loader whose images DALI decodes and augments, drawn in the order of an ordinary batch sampler.

``DaliLoader`` is an iterable with a ``len``, like a DataLoader: each ``iter()`` is one epoch of the batch sampler,
and each batch is ``[images, labels]`` - the structure the default collation gives a torchvision image dataset
(float32 or uint8 CHW images, int64 labels). The sampler decides everything a DataLoader's sampler decides: which
samples, in which order, each once per epoch, shuffled or not, the last batch kept or dropped, and - with a
``DistributedSampler`` - which shard this rank gets. pipeopt reads the chosen files' bytes in the main process (no
worker processes) and feeds them to the pipeline a few batches ahead, so DALI's threads decode while the step runs.

Because the pipeline has no reader, it has no epoch of its own to get out of step: an epoch stopped early (the
sanity check, ``limit_train_batches``, a handover) only drains the batches already fed, and the next ``iter()``
starts a fresh epoch from the sampler.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import numpy as np
import torch

from pipeopt.apply.handover import LoaderFailure
from pipeopt.dali import pipeline
from pipeopt.dali.recipe import Recipe
from pipeopt.tuning.loader_search import DALI_PREFETCH

#: Batches fed to DALI ahead of the one the training loop takes.
PREFETCH = DALI_PREFETCH  # batches fed ahead: what the loader search counts in flight


class DaliLoader:
    """Batches of ``recipe``'s images, in the order ``batch_sampler`` gives their indices.

    Args:
        recipe: the dataset and transform chain (``pipeopt.dali.recipe.translate``).
        batch_sampler: yields lists of indices into ``recipe.samples`` (a ``torch.utils.data.BatchSampler`` over a
            ``RandomSampler``, ``SequentialSampler`` or ``DistributedSampler``, for example).
        device: ``"cpu"`` (DALI's CPU backend) or ``"mixed"`` (decoding on the GPU; batches arrive on it).
        device_id: the CUDA device for ``"mixed"`` (default: the current one).
        num_threads: DALI's worker threads (>= 1).
        seed: seed of DALI's random augmentations.
        prefetch: batches fed ahead (>= 1).
        before_epoch: called at every ``iter()`` before the sampler is - where a DataLoader would draw its workers'
            base seed, so that the RNG stream, and the next shuffle, are what the DataLoader's would be.
        images: instead of the files, DALI is fed ``images(i)`` for each index ``i`` - the image already decoded
            (height x width x 3 uint8 RGB) and put through the recipe's first ``decoded`` geometric steps (pipeopt's
            sample cache: ``CachedDataset.image``); ``device="cpu"`` only.
    """

    def __init__(self, recipe: Recipe, batch_sampler: Iterable[Any], *, device: str = "cpu",
                 device_id: int | None = None, num_threads: int = 1, seed: int = 0, prefetch: int = PREFETCH,
                 before_epoch: Callable[[], Any] | None = None, images: Callable[[int], np.ndarray] | None = None,
                 decoded: int = 0) -> None:
        if device not in pipeline.DEVICES:
            raise ValueError(f"DaliLoader(device={device!r}) is not valid. Expected one of {pipeline.DEVICES}.")
        if images is not None and device != "cpu":
            raise ValueError(f"DaliLoader(device={device!r}, images=...): decoded images are fed to DALI's CPU "
                             "backend only. Use device='cpu'.")
        if device == "mixed" and not torch.cuda.is_available():
            raise ValueError("DaliLoader(device='mixed') decodes on a GPU, and torch sees none here. Use "
                             "device='cpu'.")
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"DaliLoader(num_threads={num_threads!r}) is not valid. Expected an int >= 1.")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"DaliLoader(prefetch={prefetch!r}) is not valid. Expected an int >= 1.")
        reason = pipeline.missing()
        if reason is not None:
            raise ImportError(reason)
        self.recipe = recipe
        self.batch_sampler = batch_sampler
        self.device = device
        self.device_id = None
        if device == "mixed":
            self.device_id = torch.cuda.current_device() if device_id is None else device_id
        self.num_threads = num_threads
        self.seed = int(seed) % (2**31 - 1)
        self.prefetch = prefetch
        self._before_epoch = before_epoch
        self._images, self._decoded = images, (decoded if images is not None else None)
        self._labels = torch.tensor([label for _, label in recipe.samples], dtype=torch.int64)
        self._pipe: Any = None
        self._pipe_batch = 0
        # Runs scheduled on the pipeline and not yet taken, with their labels, oldest first - kept here, not in the
        # iterator, so that a new epoch drops what an abandoned one fed (the pipeline returns runs in order).
        self._fed: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._epoch = 0
        #: when set (pipeopt's switcher sets it on the loaders it starts), each ``iter()`` is ``on_epoch(start, self)``,
        #: ``start`` making the epoch's ``DaliIterator`` - so that a trial's next epoch is guarded from its first batch
        self.on_epoch: Callable[[Callable[[], DaliIterator], Any], Iterator[Any]] | None = None

    @property
    def sampler(self) -> Any:
        """The sample sampler, where Lightning calls ``set_epoch`` (a ``DistributedSampler`` reshuffles with it)."""
        return getattr(self.batch_sampler, "sampler", None)

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]  # the user's batch sampler, which has a length

    def __iter__(self) -> Iterator[Any]:
        return self._start() if self.on_epoch is None else self.on_epoch(self._start, self)

    def _start(self) -> DaliIterator:
        self._drain()  # the previous epoch stopped early: drop what was fed ahead of it
        self._epoch += 1
        if self._before_epoch is not None:
            self._before_epoch()
        return DaliIterator(self, iter(self.batch_sampler), self._epoch)

    # -- for DaliIterator -----------------------------------------------------------------------------------
    def _pipeline(self, size: int) -> Any:
        """The pipeline, (re)built when a batch is larger than the one it was built for or it broke."""
        if self._pipe is None or size > self._pipe_batch:
            self._pipe = None
            self._pipe_batch = max(size, _batch_size(self.batch_sampler) or 0)
            self._pipe = pipeline.build(self.recipe, batch_size=self._pipe_batch, device=self.device,
                                        device_id=self.device_id, num_threads=self.num_threads, seed=self.seed,
                                        decoded=self._decoded)
        return self._pipe

    def _broken(self) -> None:
        self._pipe = None
        self._fed.clear()

    def _drain(self) -> None:
        """Wait out the runs already scheduled and drop them (the pipeline stays usable)."""
        while self._fed:
            pipe, _ = self._fed.popleft()
            try:
                pipe.outputs()
            except Exception:  # a broken pipeline is rebuilt by the next epoch
                self._broken()

    def _inputs(self, indices: list[int]) -> list[np.ndarray]:
        """What the pipeline is fed for ``indices``: each file's bytes, or its decoded image (``images``)."""
        if self._images is not None:
            return [self._images(i) for i in indices]
        return [np.fromfile(self.recipe.samples[i][0], dtype=np.uint8) for i in indices]


class DaliIterator(Iterator[Any]):
    """One epoch of a ``DaliLoader``: feeds the pipeline ``prefetch`` batches ahead and returns them in order. It
    stops when its loader starts another epoch."""

    def __init__(self, loader: DaliLoader, indices: Iterator[Any], epoch: int) -> None:
        self._loader = loader
        self._indices = indices
        self._epoch = epoch

    def __iter__(self) -> DaliIterator:
        return self

    @property
    def _current(self) -> bool:
        return self._epoch == self._loader._epoch

    def __next__(self) -> list[torch.Tensor]:
        loader = self._loader
        if not self._current:
            raise StopIteration
        self._feed()
        if not loader._fed:
            raise StopIteration
        pipe, labels = loader._fed.popleft()
        try:
            (images,) = pipe.outputs()
            batch = _to_torch(images, loader.device_id)
        except Exception as err:
            self._fail(err)
        return [batch, labels]

    def _feed(self) -> None:
        loader = self._loader
        while len(loader._fed) < loader.prefetch:
            try:
                indices = [int(i) for i in next(self._indices)]
            except StopIteration:
                self._indices = iter(())
                return
            try:
                if loader._fed and len(indices) > loader._pipe_batch:  # a rebuild would drop what is in flight
                    self._indices = itertools.chain([indices], self._indices)
                    return
                pipe = loader._pipeline(len(indices))
                pipe.feed_input(pipeline.ENCODED, loader._inputs(indices))
                pipe.schedule_run()
            except Exception as err:
                self._fail(err)
            loader._fed.append((pipe, loader._labels[indices]))

    def _fail(self, err: Exception) -> NoReturn:
        self._loader._broken()
        raise LoaderFailure(f"the DALI pipeline failed: {type(err).__name__}: {err}") from err

    # -- what pipeopt's loader handover asks of an iterator ---------------------------------------------------
    def take_index_stream(self) -> Iterator[Any]:
        """Stop taking indices: deliver the batches already fed, then stop; the rest of the epoch is returned."""
        stream, self._indices = self._indices, iter(())
        return stream

    def give_index_stream(self, stream: Iterator[Any]) -> None:
        """Feed from ``stream`` from now on (the one ``take_index_stream`` returned, wrapped)."""
        self._indices = stream

    def undelivered(self) -> list[Any] | None:
        """The index batches fed and not taken yet: known (none) until the first is fed; None after that."""
        return None if self._current and self._loader._fed else []

    def ready_batches(self) -> int:
        """Batches fed to DALI and not yet taken (at most ``prefetch``: the stock does not grow)."""
        return len(self._loader._fed) if self._current else 0

    def _shutdown_workers(self) -> None:
        """End the epoch now: drop the batches fed ahead (the pipeline stays usable)."""
        self._indices = iter(())
        if self._current:
            self._loader._drain()


def _batch_size(batch_sampler: Any) -> int | None:
    """The largest batch a batch sampler yields, where it says (``batch_size``, maybe on the sampler it wraps)."""
    while batch_sampler is not None:
        size = getattr(batch_sampler, "batch_size", None)
        if isinstance(size, int) and size > 0:
            return size
        batch_sampler = getattr(batch_sampler, "inner", None)
    return None


def _to_torch(images: Any, device_id: int | None) -> torch.Tensor:
    """A DALI TensorList (uniform shapes) copied into a new torch tensor on its device."""
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

    dense = images.as_tensor()
    device = torch.device("cpu") if device_id is None else torch.device("cuda", device_id)
    out = torch.empty(dense.shape(), dtype=to_torch_type[dense.dtype], device=device)
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    feed_ndarray(dense, out, cuda_stream=stream)
    return out
