"""Run one scenario fit with given loader settings and measure its steady throughput."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import io
import resource
import statistics
import time
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
from rich.console import Console

from benchmarks.scenarios import Scenario
from pipeopt import PipeOpt


class Stopwatch(pl.Callback):
    """Timestamps at every batch end, with the optimizer steps done by then; nothing else (the oracle runs must not
    pay for pipeopt's measuring)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter())
        self.steps.append(trainer.global_step)

    def steady_rate(self, warmup: int) -> float:
        """Optimizer steps per second from the batch that ended optimizer step ``warmup`` on (with gradient
        accumulation, optimizer steps are not batches)."""
        first = next(i for i, step in enumerate(self.steps) if step > warmup)
        last = self.steps.index(self.steps[-1])  # the batch that ended the last optimizer step
        return (self.steps[last] - self.steps[first]) / (self.times[last] - self.times[first])


def quiet_pipeopt(**kwargs: Any) -> PipeOpt:
    """A PipeOpt that prints and writes nothing, and tunes from scratch every run (no cache)."""
    kwargs.setdefault("report_dir", None)
    kwargs.setdefault("cache", False)
    return PipeOpt(console=Console(file=io.StringIO()), **kwargs)


def run_fit(
    scenario: Scenario,
    dataset: Any,
    settings: dict[str, Any],
    callbacks: Sequence[pl.Callback] = (),
    steps: int | None = None,
    steady_from: float | None = None,
    loader: Any = None,
    batch_ends: list[float] | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    samples_per_step: int | None = None,
) -> dict[str, float]:
    """Fit ``scenario`` with loader ``settings`` (or a ready ``loader``, whose optimizer steps take
    ``samples_per_step``, by default the scenario's batch); steady throughput is measured from optimizer step
    ``warmup`` (or from the fraction ``steady_from`` of the run, to measure only after a tuner has finished).
    ``batch_ends``, when given, receives each optimizer step's end in seconds from the fit's start;
    ``trainer_kwargs`` go to the Trainer (a precision, an accumulation)."""
    pl.seed_everything(0, verbose=False)
    watch = Stopwatch()
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps or scenario.steps,
        callbacks=[watch, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **(trainer_kwargs or {}),
    )
    start = time.perf_counter()
    trainer.fit(scenario.make_model(), loader if loader is not None else scenario.loader(dataset, **settings))
    wall = time.perf_counter() - start
    if batch_ends is not None:  # one end per optimizer step
        batch_ends.extend(t - start for t, step, after in zip(watch.times, watch.steps, [*watch.steps[1:], None])
                          if after != step)
    total = steps or scenario.steps
    rate = watch.steady_rate(int(steady_from * total) if steady_from is not None else scenario.warmup)
    return {"steps_per_s": rate, "samples_per_s": rate * (samples_per_step or scenario.batch_size), "wall_s": wall}


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float]) -> float:
    """Relative spread of repeated measurements: (max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def page_faults() -> int:
    """Minor page faults of this process so far: each is a page of memory touched for the first time (fresh memory),
    which a step pays for in time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, or None where it cannot be loaded."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def steady_heap(trim_bytes: int = 1 << 30, mmap_bytes: int = 32 << 20) -> dict[str, int] | None:
    """Fix glibc's malloc thresholds for this process (and the loader workers it forks): memory a step frees stays in
    the heap for the next step (``M_TRIM_THRESHOLD``), and blocks up to ``mmap_bytes`` come from the heap, not from a
    map of their own returned at each free (``M_MMAP_THRESHOLD``, whose dynamic raise this also turns off). Without
    it, whether a step's memory goes back to the system after each step depends on what else lies in the heap: the
    same step over the same resident batches faulted 0 or 1,100-1,800 fresh pages a step, and ran ~1.4x slower when
    it did, with the arms run before it. Every arm then runs with the same heap policy, and compares the work of
    its loader, not its luck with the allocator. The settings, or None where the C library is not glibc."""
    mallopt = getattr(_libc(), "mallopt", None)
    # malloc.h: M_TRIM_THRESHOLD is -1, M_MMAP_THRESHOLD -3; mallopt returns 0 where it refuses a value
    if mallopt is None or not (mallopt(-1, trim_bytes) and mallopt(-3, mmap_bytes)):
        return None
    return {"M_TRIM_THRESHOLD": trim_bytes, "M_MMAP_THRESHOLD": mmap_bytes}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_free() -> int | None:
    """The bytes glibc's malloc holds free in this process's heaps, every arena's (``mallinfo2``'s ``fordblks``):
    memory the program freed and the allocator kept - resident unless ``malloc_trim`` gave its pages back and nothing
    touched them since, so at most what of the process's resident memory is free heap. None where the C library has
    no ``mallinfo2`` (not glibc 2.33 or later)."""
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


def release_free_heap() -> bool:
    """Give back to the system what glibc's malloc holds free in every arena, whole free pages inside a heap too
    (``malloc_trim(0)``). A fit run after others in the process then starts without the free heap they left: under
    ``steady_heap`` a plain 8-worker DataLoader arm of storage_latency once left 5.3 GiB of the training process's
    heap free (0.35 GiB in use; ~340 more free blocks than before it, ~15 MiB each, where each step allocates a
    16 MiB gradient), and the arms after it carried it in their peaks. False where the C library is not glibc."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)  # (its result says whether any memory was given back)
    return True
