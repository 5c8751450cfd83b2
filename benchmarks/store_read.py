"""What reading whole items from the sample store costs a step, once the cache is kept - without Lightning or pipeopt's
measuring around it.

    python -m benchmarks.store_read [--rounds 6] [--items 4096] [--device cpu]

The validation chain's cached items (3 x 112 x 112 float32 images, a label each), the small CNN and SGD step of
``benchmarks.sample_cache``, 32 a batch, in a plain training loop: on the CPU, or with ``--device cuda`` on a GPU
(the loaders still read on the CPU; each batch moves to the GPU in its step, and each step ends with its loss read,
so the training thread waits for the GPU there). Each round runs one epoch of each arm, in turn:
- **resident**: the epoch's batches made beforehand and kept in memory (the ceiling: no loader at all);
- **items**: a DataLoader (``num_workers=0``, shuffled) over the items kept in memory, collated by torch's default
  collate - what any store of whole items read through a DataLoader can at best do;
- **store**: the same DataLoader reading the items from a ``SampleStore`` the way pipeopt's kept cache of the
  validation chain does (the image alone stored, its label joined after the read - ``FolderSplit``; ``CachedDataset``
  reading a batch's rows straight into its tensors, ``collate_rows``, batch memory used again);
- **store, read ahead**: that loader run one batch ahead on a thread of the training process;
- **store, read ahead at idle priority**: the same, its thread scheduled ``SCHED_IDLE`` (Linux): it gets only a CPU
  nothing else wants - but it runs the loader's Python holding the GIL, which the training thread may then wait for;
- **the copy alone**: each batch's images gathered (one ``index_select``, the shuffled order of a DataLoader) from
  all of them held in one tensor into memory used before, its labels picked: no loader, no store, no Python around
  it - the least any loader pays that hands the step a batch of its own in the training thread.
Each step is split in two: taking the batch from the loader (fetch) and the step on it (compute), each with the
page faults it took (a page of fresh memory touched for the first time: torch's collate stacks each batch into new
memory, whose pages fault in the fetch and then in the step - or not, as the allocator reuses memory). It also
times the loaders alone (no step): milliseconds a batch. Ratios are within a round, every round kept.
Writes ``benchmarks/results/store_read.json`` and a copy in ``results/history/``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.harness import median, page_faults
from benchmarks.run import RESULTS, keep_in_history, machine
from benchmarks.scenarios.workloads import small_cnn
from pipeopt import _dataloader
from pipeopt.apply.sample_cache import CachedDataset, FolderSplit
from pipeopt.apply.sample_store import SampleStore, encode
from pipeopt.callbacks.cache_start import SHARED_MEMORY

BATCH = 32


class Items(Dataset):
    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = [(torch.randn(3, 112, 112, generator=generator), i % 10) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


class Folder:
    """``Items`` as the validation chain's ImageFolder is cached (``FolderSplit``): each image alone in the store, its
    label joined after the read."""

    target_transform = None

    def __init__(self, items: Items) -> None:
        self.images = [image for image, _ in items.items]
        self.samples = [(i, label) for i, (_, label) in enumerate(items.items)]

    def __len__(self) -> int:
        return len(self.samples)

    def loader(self, i: int) -> torch.Tensor:
        return self.images[i]


def gathered(images: torch.Tensor, labels: torch.Tensor, kept: int = 3) -> Iterator[Any]:
    """An epoch of shuffled batches, each gathered from ``images`` into one of ``kept`` tensors used in turn."""
    into = [torch.empty(BATCH, *images.shape[1:], dtype=images.dtype) for _ in range(kept)]
    order = torch.randperm(len(images))
    for k in range(len(images) // BATCH):
        picked = order[k * BATCH:(k + 1) * BATCH]
        yield torch.index_select(images, 0, picked, out=into[k % kept]), labels[picked]


def read_ahead(batches: Iterable[Any], depth: int = 2, *, idle: bool = False) -> Iterator[Any]:
    """``batches`` made on a thread, up to ``depth`` ahead of the loop; ``idle``: that thread at idle priority."""
    ready: queue.Queue[Any] = queue.Queue(depth)
    end = object()

    def work() -> None:
        if idle:  # pid 0: the calling thread alone
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        for batch in batches:
            ready.put(batch)
        ready.put(end)

    threading.Thread(target=work, daemon=True).start()
    while (batch := ready.get()) is not end:
        yield batch


class Step:
    """The small CNN's SGD step on ``device``; a batch moves there in the step, and each step ends when the device has
    finished it (its loss read, as a loop that logs each step's loss does)."""

    def __init__(self, device: str = "cpu") -> None:
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.model = small_cnn(10).to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def epoch(self, batches: Iterable[Any]) -> dict[str, float]:
        """One epoch of training steps over ``batches``: samples/s, and per step the time and the page faults of
        taking the batch (``fetch``) and of the step on it (``compute``)."""
        start, samples, steps = time.perf_counter(), 0, 0
        fetch_s = compute_s = 0.0
        fetch_faults = compute_faults = 0
        iterator = iter(batches)
        while True:
            faults, began = page_faults(), time.perf_counter()
            try:
                x, y = next(iterator)
            except StopIteration:
                break
            fetched, faults_fetched = time.perf_counter(), page_faults()
            x, y = x.to(self.device), y.to(self.device)  # (on the CPU, the same tensors)
            self.optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            loss.item()
            fetch_s, compute_s = fetch_s + fetched - began, compute_s + time.perf_counter() - fetched
            fetch_faults += faults_fetched - faults
            compute_faults += page_faults() - faults_fetched
            samples, steps = samples + len(y), steps + 1
        return {"samples_per_s": samples / (time.perf_counter() - start), "fetch_ms": 1e3 * fetch_s / steps,
                "compute_ms": 1e3 * compute_s / steps, "fetch_faults": fetch_faults / steps,
                "compute_faults": compute_faults / steps}


def load_ms(loader: Iterable[Any]) -> float:
    start, count = time.perf_counter(), 0
    for _ in loader:
        count += 1
    return 1e3 * (time.perf_counter() - start) / count


def measure(rounds: int, n: int, device: str = "cpu") -> dict[str, Any]:
    """Every arm, ``rounds`` times in turn over ``n`` items, the step on ``device``."""
    items = Items(n)
    root = SHARED_MEMORY if SHARED_MEMORY.is_dir() else None
    split = FolderSplit(Folder(items), None, [], [])
    store = SampleStore(tempfile.mkdtemp(prefix="pipeopt-store-read-", dir=root), len(items), 4 * 2**30)
    try:
        for i in range(len(items)):
            store.put(i, encode(split.make(i)), time.thread_time_ns())
        cached = CachedDataset(split, store, read=True, rows=True)
        loaders = {
            "items": DataLoader(items, batch_size=BATCH, shuffle=True, drop_last=True),
            "store": DataLoader(cached, batch_size=BATCH, shuffle=True, drop_last=True,
                                collate_fn=_dataloader.collate_rows),
        }
        resident = list(loaders["items"])
        images = torch.stack([image for image, _ in items.items])
        labels = torch.tensor([label for _, label in items.items])
        arms = {"resident": lambda: resident, "items": lambda: loaders["items"], "store": lambda: loaders["store"],
                "store, read ahead": lambda: read_ahead(loaders["store"]),
                **({"store, read ahead at idle priority": lambda: read_ahead(loaders["store"], idle=True)}
                   if hasattr(os, "SCHED_IDLE") else {}),
                "the copy alone": lambda: gathered(images, labels)}
        step = Step(device)
        for make in arms.values():  # warm-up: the allocator, the store's pages, torch's threads
            step.epoch(make())
        measured = []
        for _ in range(rounds):
            epochs = {name: step.epoch(make()) for name, make in arms.items()}
            rates = {name: e.pop("samples_per_s") for name, e in epochs.items()}
            loads = {name: load_ms(loaders[name]) for name in ("items", "store")}
            measured.append({"samples_per_s": rates, "load_ms_per_batch": loads, "per_step": epochs,
                             "over_resident": {k: v / rates["resident"] for k, v in rates.items() if k != "resident"}})
    finally:
        store.remove()
    ratios = {k: [r["over_resident"][k] for r in measured] for k in measured[0]["over_resident"]}
    return {"scenario": "store_read", "device": device, "items": n, "batch_size": BATCH,
            "rounds": measured, "median_over_resident": {k: median(v) for k, v in ratios.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--items", type=int, default=4096)
    parser.add_argument("--device", default="cpu", help="where the step runs (cpu, cuda); the loaders read on the CPU")
    args = parser.parse_args(argv)
    figures = measure(args.rounds, args.items, args.device)
    given = sys.argv[1:] if argv is None else argv
    result = {**figures, "command": " ".join(["python -m benchmarks.store_read", *given]), "machine": machine(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (RESULTS / "store_read.json").write_text(json.dumps(result, indent=2) + "\n")
    keep_in_history(result)
    rounds = figures["rounds"]
    for k in rounds[0]["over_resident"]:
        v = [r["over_resident"][k] for r in rounds]
        print(f"{k} / resident: {median(v):.2f} [{min(v):.2f} - {max(v):.2f}]")
    for k in ("items", "store"):
        ms = [r["load_ms_per_batch"][k] for r in rounds]
        print(f"{k} loader alone: {median(ms):.2f} [{min(ms):.2f} - {max(ms):.2f}] ms a batch")
    for k in rounds[0]["per_step"]:
        steps = {f: median([r["per_step"][k][f] for r in rounds]) for f in rounds[0]["per_step"][k]}
        print(f"{k}, a step: fetch {steps['fetch_ms']:.2f} ms ({steps['fetch_faults']:.0f} page faults), "
              f"compute {steps['compute_ms']:.2f} ms ({steps['compute_faults']:.0f} page faults) (medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
