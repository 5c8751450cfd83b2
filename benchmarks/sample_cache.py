"""The sample cache against the best DataLoader setting and the compute-only ceiling, epoch by epoch.

    python -m benchmarks.sample_cache [--repeats 2] [--scenarios storage_latency storage_latency_high]
    .venv-vision/bin/python -m benchmarks.sample_cache --scenarios validation_chain imagefolder_decode [...]
    (``make bench-cache`` runs both)

For each scenario, in one invocation and in rounds whose order rotates (every repeat kept):
- **ceiling**: the same model and step over batches already resident in memory (one epoch's batches, made once by
  a DataLoader beforehand and replayed every epoch): what the step alone allows;
- **items** (where every item is deterministic, so a store may hold all of it): the same step over a DataLoader
  (``num_workers=0``, the same shuffle and batch) of the items made once beforehand and kept in memory - the best
  any store of whole items can do, since a fresh batch is still drawn, collated and handed over every step;
- **grid**: the DataLoader at each of the scenario's settings (no cache);
- **the ceiling beside each arm**: two epochs of the ceiling just before and just after every arm (the second
  epoch's rate, the two averaged) - the host's pace drifts over a round, so each arm is also read against the
  ceiling measured next to it in time; the ceiling arm too, which tells how far a whole fit of the ceiling reads
  from the two-epoch fits beside it (the bias of that yardstick). Every fit also records the training process's
  page faults a step from epoch 2: a step whose own memory is fresh to the process runs slower, in any arm;
- **the ceiling between an arm's epochs**: two epochs of the ceiling run in the arm's own process after each of its
  epochs (``CeilingBetween``; the pause is taken out of the arm's times): each epoch from the second is read against
  the ceiling ~1 s either side of it, where the brackets above lie a whole fit apart. The ceiling arm is read so too:
  what this yardstick reads of the same step;
- **pipeopt**: the naive loader (``num_workers=0``) under ``PipeOpt(tune=...)`` with the ``"cache"`` group.
Every fit runs under one heap policy (``harness.steady_heap``, written as ``heap`` in the results): memory a step
frees stays in the process for the next step. Left to glibc's defaults, whether the same step faulted ~1,100-1,800
fresh pages a step (and ran ~1.4x slower) depended on what the arms before it had left in the heap, in the ceiling
too.
Each arm runs the same epochs; throughput is measured per epoch (from batch-end times) and "from epoch 2" (every
epoch after the first). Ratios are within a round: pipeopt over that round's ceiling and over its best grid arm.
Memory: the peak of the whole process tree's memory (main process and loader workers), sampled every 0.5 s or less
often (the sampler takes at most 1/20 of a core): the sum of their proportional set sizes less the shared memory
they map, plus the shared-memory files they hold open or map (``PeakMemory``: a page a forked worker shares with
its parent, and the store, which every reader maps, each counted once) - and the store's bytes beside its budget.
Each fit starts by giving back the heap earlier fits in the process freed (``harness.release_free_heap``), and its
peak carries at most what of it the training process's allocator held free (``heap_free_at_peak_bytes``): freed
memory the heap kept, not any arm's data.
Writes
``benchmarks/results/sample_cache.json`` (merged per scenario, so the two venvs' runs sit side by side), a copy in
``results/history/`` and the tables in ``results/README.md``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytorch_lightning as pl
import torch
from rich.console import Console
from torch.utils.data import DataLoader, Dataset

from benchmarks.harness import heap_free, median, page_faults, release_free_heap, steady_heap
from benchmarks.run import RESULTS, keep_in_history, machine, write_markdown
from benchmarks.scenarios.base import label
from benchmarks.scenarios.workloads import CACHE, Classifier, SlowStorage, jpeg_folder, mlp, small_cnn
from pipeopt import PipeOpt
from pipeopt.measure.cpu import descendants

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@dataclass(frozen=True)
class CacheScenario:
    name: str
    description: str
    make_dataset: Callable[[], Dataset]
    make_model: Callable[[], pl.LightningModule]
    batch_size: int
    epochs: int
    grid: tuple[dict[str, Any], ...]
    tune: tuple[str, ...]
    vision: bool = False
    whole: bool = False  # every item is deterministic, so all of it may be cached: the "items" arm applies


def _workers(*counts: int, prefetch: int = 2) -> tuple[dict[str, Any], ...]:
    return tuple({"num_workers": n, "persistent_workers": True, "prefetch_factor": prefetch} for n in counts)


def image_folder(copies: int = 8) -> Path:
    """``jpeg_folder()``'s 512 JPEGs as an ImageFolder of ``copies`` x 512 entries (links): long epochs, real
    decodes (each entry is cached apart, as distinct files would be)."""
    source = sorted(jpeg_folder().glob("*.jpg"))
    root = CACHE / f"imagefolder-{copies}x512-384"
    done = root / ".complete"
    if not done.exists():
        for c in range(copies):
            for i, path in enumerate(source):
                target = root / f"class{i % 10}" / f"{c}-{path.name}"
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists():
                    target.symlink_to(path)
        done.write_text("ok")
    return root


def _folder(*steps: Any, copies: int = 8) -> Dataset:
    from torchvision import datasets
    from torchvision import transforms as T

    return datasets.ImageFolder(image_folder(copies),
                                transform=T.Compose([*steps, T.ToTensor(), T.Normalize(MEAN, STD)]))


def validation_chain(copies: int = 8) -> Dataset:
    from torchvision import transforms as T

    return _folder(T.Resize(128), T.CenterCrop(112), copies=copies)


def random_crop_chain(copies: int = 8) -> Dataset:
    from torchvision import transforms as T

    return _folder(T.RandomResizedCrop(112, scale=(0.25, 1.0)), T.RandomHorizontalFlip(), copies=copies)


SCENARIOS = {s.name: s for s in (
    CacheScenario("storage_latency", "8 samples/step, 10 ms storage latency per sample, 2x2048 MLP; 4,800 samples "
                  "(600 steps) an epoch", lambda: SlowStorage(n=4800, delay_s=0.010),
                  lambda: Classifier(mlp(64, 2048, 2)), 8, 4, _workers(8, 16), ("loader", "cache"), whole=True),
    CacheScenario("storage_latency_high", "40 ms storage latency a sample, 8 samples/step, a 1x256 MLP (a step of a "
                  "few ms): hiding 320 ms of latency a batch needs ~100 workers, pipeopt's cap is 64; 12,000 samples "
                  "(1,500 steps) an epoch", lambda: SlowStorage(n=12000, delay_s=0.040),
                  lambda: Classifier(mlp(64, 256, 1)), 8, 4, _workers(32, 64, prefetch=4), ("loader", "cache")),
    CacheScenario("validation_chain", "ImageFolder of 4,096 384 px JPEGs (512 files, each listed 8 times), "
                  "Resize(128) + CenterCrop(112) + ToTensor + Normalize (all deterministic), small CNN, 32/step",
                  validation_chain, lambda: Classifier(small_cnn(10)), 32, 4, _workers(2, 3, 4),
                  ("loader", "cache"), vision=True, whole=True),
    CacheScenario("validation_chain_long", "the validation chain over 16,384 entries (the 512 files each listed 32 "
                  "times): an epoch of ~20 s at the best DataLoader's pace, where the 4,096 of validation_chain take "
                  "~6 s - less than pipeopt's measured decisions (the loader search, then the cache's trial)",
                  lambda: validation_chain(32), lambda: Classifier(small_cnn(10)), 32, 4, _workers(2, 3, 4),
                  ("loader", "cache"), vision=True, whole=True),
    # 8 workers too: JPEG decoding on 2 CPUs kept gaining up to ~12 workers (``predict_verify --sweep``)
    CacheScenario("imagefolder_decode", "the same ImageFolder, RandomResizedCrop(112) + flip + ToTensor + Normalize "
                  "(only the decode is cacheable), small CNN, 32/step; DALI allowed too", random_crop_chain,
                  lambda: Classifier(small_cnn(10)), 32, 4, _workers(2, 3, 4, 8),
                  ("loader", "dali", "cache"), vision=True),
    CacheScenario("imagefolder_decode_long", "the same decode chain over 10,240 entries (the 512 files each listed 20 "
                  "times, 320 steps an epoch): the loader search with DALI's trial takes ~160 steps, more than "
                  "imagefolder_decode's 128-step epoch, so there the fill and the cache's trials fall in epoch 2; the "
                  "store holds ~4.5 GB of decoded images", lambda: random_crop_chain(20),
                  lambda: Classifier(small_cnn(10)), 32, 4, _workers(2, 3, 4, 8), ("loader", "dali", "cache"),
                  vision=True),
)}


class BatchClock(pl.Callback):
    """The time at the end of every training batch (on a GPU after the device has finished the step), and the
    training process's minor page faults so far: a step whose memory is fresh to the process faults on each page,
    which moved a step of the validation chain from ~3.7 to ~5 ms, in any arm, with the allocator's state
    (``benchmarks/results/README.md``, twenty-eighth pass) - ~0 a step under ``steady_heap``."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.faults: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)
        self.ends.append(time.perf_counter())
        self.faults.append(page_faults())


class PeakMemory:
    """The largest memory of this process and all its descendants, sampled in a thread: the sum of their proportional
    set sizes (``_own_memory``) without the shared memory they map, plus the shared-memory files (``/dev/shm``) they
    hold open or map (``_shm_held``) - the sample store, which every reader maps, and the batches workers hand over,
    each counted once, not once per process that maps it. A page that n processes map counts 1/n in each, so the
    pages a forked loader worker shares with the training process are counted once (a sum of RSS counted them in
    every worker: 21-24 GB for a tree whose store held 2.3 GB).

    Only the tree's own shared memory counts, all of it: what it held at the start too (the resident batches that
    loader workers made, 0.59 GiB in the vision scenarios). Until the thirty-third pass the sampler took what
    ``/dev/shm`` as a whole held beyond its use at the start: a store, a test or a leaked segment of another process
    counted as the fit's, and the shared memory the tree held at the start did not. That reading is kept beside, as
    ``host_shm_growth``: the most ``/dev/shm`` grew beyond what the tree's holding grew - another process's files, or
    the tree's own store in the moments the fit's end takes to free it (its files unlinked, held by no process, its
    pages not yet given back: ~1.7 GiB, the whole store of imagefolder_decode, while no process on the host held more
    than 4 MiB of ``/dev/shm``).

    The sampler must not slow the fit it measures. The kernel makes ``smaps_rollup`` by walking every page a process
    maps: ~60 ms of CPU for a process of 3.6 GB (the benchmark's own resident batches and items are in every arm's
    process and in the workers it forks), where ``status`` takes ~0.2 ms. Sampled every 0.5 s, it took ~11 % of a
    core from a fit of validation_chain_long's cache. So a process alone (no workers: it shares no page with the
    tree) is read from ``status``, which then gives the same figure to within ~1 MiB, and the next sample waits at
    least ``share`` times the CPU the last one took: the sampler takes at most 1/``share`` of a core."""

    def __init__(self, every_s: float = 0.5, share: float = 20.0) -> None:
        self.peak, self._every, self._share, self._stop = 0, every_s, share, threading.Event()
        self.heap_free_at_peak: int | None = None  # of the peak, what the training process's allocator held free
        self.host_shm_growth = 0  # the most /dev/shm grew, beyond what the tree's holding grew
        me = psutil.Process()
        self._shm_at_start, self._held_at_start = _shm_used(), _shm_held([me.pid, *(p.pid for p in descendants(me))])
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            cpu = time.thread_time()
            tree = [me, *descendants(me)]  # pipeopt's own: no scan of every process twice a second
            held = _shm_held([p.pid for p in tree])
            grown = _shm_used() - self._shm_at_start - (held - self._held_at_start)
            self.host_shm_growth = max(self.host_shm_growth, grown)
            total = held + sum(_own_memory(p.pid, alone=len(tree) == 1) for p in tree)
            if total > self.peak:
                self.peak, self.heap_free_at_peak = total, heap_free()
            self._stop.wait(max(self._every, self._share * (time.thread_time() - cpu)))


def _own_memory(pid: int, *, alone: bool = False) -> int:
    """A process's share of the memory it maps, less the shared memory (Linux's ``/proc/<pid>/smaps_rollup``: ``Pss``
    less ``Pss_Shmem``); for a process ``alone`` in its tree, or where the kernel gives no such split, its resident
    bytes less the shared memory it maps (``VmRSS`` less ``RssShmem`` in ``/proc/<pid>/status``). 0 for a process
    that ended meanwhile."""
    try:
        rollup = {} if alone else _kilobytes(Path(f"/proc/{pid}/smaps_rollup"))
        if "Pss" in rollup and "Pss_Shmem" in rollup:
            return 1024 * (rollup["Pss"] - rollup["Pss_Shmem"])
        status = _kilobytes(Path(f"/proc/{pid}/status"))
    except OSError:
        return 0
    return 1024 * (status.get("VmRSS", 0) - status.get("RssShmem", 0))


def _kilobytes(path: Path) -> dict[str, int]:
    """The ``Name:  <n> kB`` lines of a ``/proc`` file, as {name: n}."""
    fields = {}
    for line in path.read_text().splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[name] = int(parts[0])
    return fields


def _shm_held(pids: list[int]) -> int:
    """The bytes of the ``/dev/shm`` files the processes ``pids`` hold open (``/proc/<pid>/fd``) or map (the lines
    of ``/proc/<pid>/maps`` on its device, each looked up in ``/proc/<pid>/map_files``, which the kernel shows to a
    privileged reader), each file once, unlinked ones too (torch's worker batches): the pages each holds, as a
    RAM-backed file's allocated blocks."""
    try:
        shm = os.stat("/dev/shm").st_dev
    except OSError:
        return 0
    device = f" {os.major(shm):02x}:{os.minor(shm):02x} "
    files: dict[int, int] = {}
    for pid in pids:
        try:
            opened = [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/maps") as maps:
                mapped = [f"/proc/{pid}/map_files/{line.split(maxsplit=1)[0]}" for line in maps if device in line]
        except OSError:  # ended meanwhile
            continue
        for path in opened + mapped:
            try:
                st = os.stat(path)
            except OSError:  # closed meanwhile, or not shown to this reader
                continue
            if st.st_dev == shm:
                files[st.st_ino] = st.st_blocks * 512
    return sum(files.values())


def _shm_used() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def epoch_rates(ends: list[float], steps: int, batch_size: int, start: float,
                paused: list[float] | None = None) -> list[float]:
    """Samples/s of each epoch: its batches over the time from the previous epoch's last batch end, less the time
    the fit was ``paused`` after that epoch (``CeilingBetween``)."""
    rates, previous = [], start
    for k in range(len(ends) // steps):
        last = ends[(k + 1) * steps - 1]
        away = paused[k - 1] if paused and k else 0.0
        rates.append(steps * batch_size / (last - previous - away))
        previous = last
    return rates


def _trainer(callbacks: list[pl.Callback], epochs: int) -> pl.Trainer:
    return pl.Trainer(accelerator="auto", devices=1, max_epochs=epochs, callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


class CeilingBetween(pl.Callback):
    """The ceiling, measured in the fit's own process between its epochs: after every training epoch, a fit of two
    epochs of the same step over the resident batches (its second epoch's rate kept), the fit it pauses left where
    it was (the RNGs' states put back; the pause is taken out of the fit's epoch times and page faults).

    Brackets before and after a whole fit lie a fit's length apart (~18 s for pipeopt's, whose epochs from the
    second take the last ~3 s), over which the host's pace swings by up to ~1.3x; an epoch read against the ceiling
    run just before and just after it (~1 s each side) compares the two under the same pace. Between epochs no step
    is under way and nothing loads for the fit (its loader's iterator has ended; pipeopt counts no step across an
    epoch's end), so the pause does not help or hinder the epoch after it."""

    def __init__(self, s: CacheScenario, resident: Resident) -> None:
        self.s, self.resident = s, resident
        self.rates: list[float] = []  # the ceiling's samples/s after each epoch of the fit
        self.paused: list[float] = []  # seconds each pause took
        self.faults: list[int] = []  # page faults in each pause

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        start, faults = time.perf_counter(), page_faults()
        self.rates.append(ceiling_pace(self.s, self.resident))
        self.faults.append(page_faults() - faults)
        self.paused.append(time.perf_counter() - start)

    def over(self, rates: list[float]) -> dict[str, Any]:
        """A fit's epochs from the second against the ceiling just before and after each (the mean of the two
        rates): each epoch's ratio, and from epoch 2 the time the ceiling would take for those epochs' samples over
        the time they took."""
        beside = [(a + b) / 2 for a, b in zip(self.rates, self.rates[1:])]
        ratios = [r / c for r, c in zip(rates[1:], beside)]
        return {"ceiling_between_samples_per_s": self.rates, "paused_s": self.paused,
                "epoch_over_ceiling_between": ratios,
                "over_ceiling_between": sum(1 / c for c in beside) / sum(1 / r for r in rates[1:len(beside) + 1])}


def ceiling_pace(s: CacheScenario, resident: Resident) -> float:
    """The ceiling's samples/s over the second of two epochs, run now in this process; the global RNGs (a model's
    initialisation draws from torch's) are as they were after it."""
    clock = BatchClock()
    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        _trainer([clock], 2).fit(s.make_model(), resident)
    random.setstate(states[0])
    np.random.set_state(states[1])
    steps = len(resident)
    return steps * s.batch_size / (clock.ends[-1] - clock.ends[steps - 1])


def fit(s: CacheScenario, loader: Any, callbacks: list[pl.Callback], epochs: int | None = None,
        between: Resident | None = None) -> dict[str, Any]:
    """One fit, its throughput epoch by epoch; with ``between``, the ceiling over those batches is also run between
    its epochs (``CeilingBetween``) and each epoch read against it."""
    pl.seed_everything(0, verbose=False)
    clock = BatchClock()
    epochs = epochs or s.epochs
    ceiling = None if between is None else CeilingBetween(s, between)
    trainer = _trainer([clock, *callbacks, *([ceiling] if ceiling else [])], epochs)
    release_free_heap()  # not the free heap an earlier fit in this process left
    with PeakMemory() as memory:
        start = time.perf_counter()
        trainer.fit(s.make_model(), loader)
        wall = time.perf_counter() - start
    paused = ceiling.paused if ceiling else []
    steps = len(clock.ends) // epochs
    rates = epoch_rates(clock.ends, steps, s.batch_size, start, paused)
    from2 = (len(clock.ends) - steps) * s.batch_size / (clock.ends[-1] - clock.ends[steps - 1] - sum(paused[:-1]))
    whole = len(clock.ends) * s.batch_size / (clock.ends[-1] - start - sum(paused[:-1]))  # the fill and trials too
    away = sum(ceiling.faults[:-1]) if ceiling else 0
    faults = (clock.faults[-1] - clock.faults[steps - 1] - away) / (len(clock.faults) - steps)
    return {"epoch_samples_per_s": rates, "from_epoch2_samples_per_s": from2, "whole_fit_samples_per_s": whole,
            "wall_s": wall - sum(paused), "peak_memory_bytes": memory.peak,
            "heap_free_at_peak_bytes": memory.heap_free_at_peak,
            "host_shm_growth_bytes": memory.host_shm_growth,
            "page_faults_per_step_from_epoch2": faults, **(ceiling.over(rates) if ceiling else {})}


class Resident:
    """Batches already in memory, replayed every epoch (an iterable with a length: one train loader to Lightning)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def prep_workers(s: CacheScenario) -> int:
    """Workers that make the ceiling's batches and the items beforehand (only their values matter): many for
    storage latency (sleeps), one per CPU for decoding."""
    return (os.cpu_count() or 2) if s.vision else 32


def ceiling_batches(s: CacheScenario, dataset: Dataset) -> Resident:
    """One epoch's batches, made beforehand and kept resident."""
    return Resident(list(DataLoader(dataset, batch_size=s.batch_size, shuffle=True, drop_last=True,
                                    num_workers=prep_workers(s))))


class Items(Dataset):
    """Every item of a dataset, made once and kept in memory: the best any store of whole items can do - the
    DataLoader still draws, collates and hands over a fresh batch each step, as pipeopt's cached loader does."""

    def __init__(self, dataset: Dataset, workers: int) -> None:
        made = DataLoader(dataset, batch_size=None, num_workers=workers)  # made in parallel: only the values matter
        self.items = [tuple(x.clone() if hasattr(x, "clone") else x for x in item) for item in made]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def bracket(s: CacheScenario, resident: Resident) -> dict[str, Any]:
    """The ceiling over two epochs (its second measured), run just before or after an arm: the host's pace swings
    by up to 2x over the minutes a round takes (the same ceiling read 6,400 and 12,000 samples/s within one
    invocation), so each arm is also compared with the ceiling measured beside it."""
    return fit(s, resident, [], epochs=2)


def pipeopt_arm(s: CacheScenario, dataset: Dataset, report_dir: Path, between: Resident) -> dict[str, Any]:
    callback = PipeOpt(tune=s.tune, report_dir=report_dir, cache=False, console=Console(file=io.StringIO()))
    out = fit(s, DataLoader(dataset, batch_size=s.batch_size, shuffle=True, drop_last=True), [callback],
              between=between)
    report = callback.report
    cache = report.sample_cache
    out.update(
        kept={c.knob: c.after for c in report.changes},
        loader_trials=len(report.trials) - 1,
        cache=None if cache is None else {
            "cached": cache.cached, "kept": cache.kept, "stored": cache.stored, "length": cache.length,
            "bytes_used": cache.bytes_used, "budget_bytes": cache.budget_bytes, "fill_s": cache.fill_s,
            "trial_speedup": cache.trial_speedup, "epochs": cache.epochs},
        cache_windows=[w.label for w in callback.windows if w.label.startswith(("cache", "filling"))],
        trials=[{"settings": t.settings, "samples_per_s": t.samples_per_s, "status": t.status, "error": t.error}
                for t in report.trials],
        notes=list(report.notes),  # the loader search's too: why a round kept no workers, say
        skipped=[[k.group, k.reason] for k in report.skipped])
    return out


def scenario_figures(s: CacheScenario, repeats: int) -> dict[str, Any]:
    dataset = s.make_dataset()
    resident = ceiling_batches(s, dataset)
    items = Items(dataset, prep_workers(s)) if s.whole else None
    rounds = []
    for r in range(repeats):
        arms: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("ceiling", lambda: fit(s, resident, [], between=resident)),
            *([("items", lambda: fit(s, DataLoader(items, batch_size=s.batch_size, shuffle=True, drop_last=True),
                                     [], between=resident))] if items is not None else []),
            *[(label(g), lambda g=g: fit(s, DataLoader(dataset, batch_size=s.batch_size, shuffle=True,
                                                       drop_last=True, **g), [], between=resident)) for g in s.grid],
            ("pipeopt", lambda: pipeopt_arm(s, dataset, Path(tempfile.mkdtemp(prefix="pipeopt-bench-")), resident)),
        ]
        shift = r % len(arms)
        measured, beside, beside_faults = {}, {}, {}
        for name, run in arms[shift:] + arms[:shift]:
            before = bracket(s, resident)
            measured[name] = run()
            after = bracket(s, resident)  # the ceiling just before and after: the pace drifts
            beside[name] = (before["from_epoch2_samples_per_s"] + after["from_epoch2_samples_per_s"]) / 2
            beside_faults[name] = [b["page_faults_per_step_from_epoch2"] for b in (before, after)]
            print(f"{s.name} round {r}: {name}: {measured[name]['from_epoch2_samples_per_s']:,.1f} samples/s "
                  f"from epoch 2, {measured[name]['page_faults_per_step_from_epoch2']:,.0f} page faults a step "
                  f"(ceiling beside it {beside[name]:,.1f}; {beside_faults[name][0]:,.0f} and "
                  f"{beside_faults[name][1]:,.0f} page faults a step; over the ceiling between its epochs "
                  f"{measured[name]['over_ceiling_between']:.2f})", flush=True)
        grid = {label(g): measured[label(g)] for g in s.grid}
        best = max(grid, key=lambda k: grid[k]["from_epoch2_samples_per_s"])
        p, c = measured["pipeopt"]["from_epoch2_samples_per_s"], measured["ceiling"]["from_epoch2_samples_per_s"]
        last = measured["pipeopt"]["epoch_samples_per_s"][-1] / measured["ceiling"]["epoch_samples_per_s"][-1]
        bound = {} if items is None else {
            "items_over_ceiling": measured["items"]["from_epoch2_samples_per_s"] / c,
            "pipeopt_over_items": p / measured["items"]["from_epoch2_samples_per_s"],
            "items_over_ceiling_beside": measured["items"]["from_epoch2_samples_per_s"] / beside["items"],
            "items_over_ceiling_between": measured["items"]["over_ceiling_between"]}
        rounds.append({"arms": measured, "best_dataloader": best, **bound, "ceiling_beside": beside,
                       "ceiling_beside_page_faults_per_step": beside_faults,
                       "ceiling_over_ceiling_beside": c / beside["ceiling"],
                       "pipeopt_over_ceiling_beside": p / beside["pipeopt"],
                       "pipeopt_over_ceiling_between": measured["pipeopt"]["over_ceiling_between"],
                       "ceiling_over_ceiling_between": measured["ceiling"]["over_ceiling_between"],
                       "pipeopt_over_ceiling": p / c, "pipeopt_over_ceiling_last_epoch": last,
                       "pipeopt_over_best_dataloader": p / grid[best]["from_epoch2_samples_per_s"],
                       "pipeopt_over_best_dataloader_whole_fit": measured["pipeopt"]["whole_fit_samples_per_s"]
                       / grid[best]["whole_fit_samples_per_s"],
                       "best_dataloader_over_ceiling": grid[best]["from_epoch2_samples_per_s"] / c})
    return {"scenario": s.name, "description": s.description, "epochs": s.epochs, "tune": list(s.tune),
            "batch_size": s.batch_size, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scenarios", nargs="+", default=["storage_latency", "storage_latency_high"],
                        choices=sorted(SCENARIOS))
    args = parser.parse_args(argv)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    heap = steady_heap()
    path = RESULTS / "sample_cache.json"
    results = json.loads(path.read_text()) if path.exists() else {"scenarios": {}}
    command = "python -m benchmarks.sample_cache " + " ".join(argv if argv is not None else sys.argv[1:])
    for name in args.scenarios:
        figures = scenario_figures(SCENARIOS[name], args.repeats)
        figures.update(command=command.strip(), machine=machine(), heap=heap,
                       created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        results["scenarios"][name] = figures
        keep_in_history({**figures, "scenario": f"sample_cache_{name}"})
        path.write_text(json.dumps(results, indent=2) + "\n")
    write_markdown()
    return 0


def _mmm(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(median(values))} [{fmt.format(min(values))} - {fmt.format(max(values))}]"


def _peak(arm: dict[str, Any]) -> str:
    """An arm's peak memory: proportional (``PeakMemory``), with what of it the training process's allocator held
    free where measured, or - in results measured before it - the sum of RSS, which counts the pages forked workers
    share once per worker (marked "RSS")."""
    if arm.get("heap_free_at_peak_bytes") is not None:
        return f"{arm['peak_memory_bytes'] / 2**30:.2f} GiB ({arm['heap_free_at_peak_bytes'] / 2**30:.2f} free heap)"
    if "peak_memory_bytes" in arm:
        return f"{arm['peak_memory_bytes'] / 2**30:.2f} GiB"
    return f"{arm['peak_rss_bytes'] / 2**30:.2f} GiB RSS"


def _own_shm(scenario: dict[str, Any]) -> bool:
    """Its peaks count only the shared memory the process tree holds (results that have ``host_shm_growth_bytes``)."""
    return all("host_shm_growth_bytes" in r["arms"]["pipeopt"] for r in scenario["rounds"])


def _bound(rounds: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rounds if key in r]
    return _mmm(values) if values else "-"


def sample_cache_rows(data: dict[str, Any]) -> list[str]:
    """The results README's rows: per scenario, the ratios from epoch 2 (median [min - max] over rounds)."""
    lines = ["", "| sample cache (`make bench-cache`) | ceiling samples/s | best DataLoader | its samples/s | "
             "pipeopt samples/s | pipeopt / ceiling | pipeopt / the ceiling between its epochs | "
             "the ceiling / the ceiling between its epochs | items in memory / the ceiling between its epochs | "
             "pipeopt / the ceiling beside it | the ceiling / the ceiling beside it | "
             "pipeopt / ceiling, last epoch | pipeopt / best DataLoader | pipeopt / best DataLoader, whole fit | "
             "items in memory / the ceiling beside it | "
             "pipeopt / items in memory | "
             "pipeopt kept | store used / budget | peak memory of the process tree, pipeopt vs best DataLoader |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for name, s in data["scenarios"].items():
        rounds = s["rounds"]
        ceiling = [r["arms"]["ceiling"]["from_epoch2_samples_per_s"] for r in rounds]
        ours = [r["arms"]["pipeopt"]["from_epoch2_samples_per_s"] for r in rounds]
        best = [r["arms"][r["best_dataloader"]]["from_epoch2_samples_per_s"] for r in rounds]
        kept = "; ".join(", ".join(f"{k}={v}" for k, v in r["arms"]["pipeopt"]["kept"].items()) or "no change"
                         for r in rounds)
        stores = [r["arms"]["pipeopt"]["cache"] for r in rounds if r["arms"]["pipeopt"]["cache"]]
        used = "; ".join(f"{c['bytes_used'] / 2**20:,.0f} MiB / {c['budget_bytes'] / 2**30:,.1f} GiB" for c in stores)
        pss = "; ".join(f"{_peak(r['arms']['pipeopt'])} vs {_peak(r['arms'][r['best_dataloader']])}" for r in rounds)
        bests = ", ".join(sorted({r["best_dataloader"] for r in rounds}))
        lines.append(f"| {name} | {_mmm(ceiling, '{:,.0f}')} | {bests} | {_mmm(best, '{:,.0f}')} | "
                     f"{_mmm(ours, '{:,.0f}')} | "
                     f"{_mmm([r['pipeopt_over_ceiling'] for r in rounds])} | "
                     f"{_bound(rounds, 'pipeopt_over_ceiling_between')} | "
                     f"{_bound(rounds, 'ceiling_over_ceiling_between')} | "
                     f"{_bound(rounds, 'items_over_ceiling_between')} | "
                     f"{_bound(rounds, 'pipeopt_over_ceiling_beside')} | "
                     f"{_bound(rounds, 'ceiling_over_ceiling_beside')} | "
                     f"{_mmm([r['pipeopt_over_ceiling_last_epoch'] for r in rounds])} | "
                     f"{_mmm([r['pipeopt_over_best_dataloader'] for r in rounds])} | "
                     f"{_bound(rounds, 'pipeopt_over_best_dataloader_whole_fit')} | "
                     f"{_bound(rounds, 'items_over_ceiling_beside')} | {_bound(rounds, 'pipeopt_over_items')} | "
                     f"{kept} | {used or '-'} | {pss} |")
    lines += ["", "Sample cache: every arm runs the same epochs, in rounds whose order rotates; figures from epoch 2 "
              "on (every epoch after the first), median [min - max] over the rounds; ratios within a round. Ceiling: "
              "the same step over one epoch's batches already in memory. The ceiling between an arm's epochs: two "
              "epochs of it run in the arm's process after each of its epochs (the second's rate; the pause taken "
              "out of the arm's times), each epoch read against the mean of the two either side of it; from epoch 2, "
              "the time that ceiling would take for those epochs over the time they took (`CeilingBetween`), where "
              "measured. The ceiling beside an arm: two epochs of it just before and just after that arm's whole fit "
              "(the second's rate, averaged), where measured. Items in memory "
              "(where every item is deterministic): the same step over a DataLoader of the items made beforehand and "
              "kept in memory - the best a store of whole items can do, a fresh batch still drawn and collated each "
              "step; - where not measured. Whole fit: every epoch's samples over the time from the fit's start "
              "(the first epoch's fill and trials included), against the best DataLoader's. The ceiling / the ceiling "
              "between its epochs, or beside it: the ceiling arm's fit read against that yardstick - what it reads "
              "of the same step (1 when it is true). Heap: "
              f"{', '.join(n for n, s in data['scenarios'].items() if s.get('heap')) or 'no scenario'} ran under "
              "one heap policy for every fit (`harness.steady_heap`); the others under glibc's defaults, where a "
              "step's fresh pages moved any arm, the ceiling too, by up to ~1.4x. Peak memory: "
              f"{', '.join(n for n, s in data['scenarios'].items() if _own_shm(s)) or 'no scenario'} counted the "
              "shared memory the tree holds (`PeakMemory`); the others what `/dev/shm` as a whole gained over the "
              "fit, another process's included. Free heap, where shown: of that peak, at most what the training "
              "process's allocator held freed (glibc's `mallinfo2`); those fits began by giving back the free heap "
              "the fits before them in the process had left (`harness.release_free_heap`). Per-epoch figures, the "
              "cache's hit rate and fill cost per run are in "
              "`sample_cache.json`."]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
