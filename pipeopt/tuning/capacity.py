"""A capacity model of the input pipeline, fitted to the windows the run measured: what throughput any worker count
would reach, so the search tries the predicted best first and checks it, instead of walking counts one by one.

Three limits, in samples/s (Plumber's view of a pipeline as stages with rates and CPU costs, fitted here to live
windows rather than traced):

* **the step**: the rate at which the step consumes samples once input is free - a window's rate over the share of
  it that did not wait for data (``rate / (1 - wait)``), the largest any window with workers read (the
  before-window's until one is measured: with workers the step also takes each batch from a worker). A lower
  bound: a step that waited also pays for having waited (intra-op threads woken from sleep, cold caches), so a
  window that waits less reads a faster step. ``wait`` here is the wait with no finished batch ready
  (``WindowStats.starved_wait_frac``): a fetch that finds a batch ready still waits - to receive it from the
  worker, to wake - and that share is the step's own, which no worker count takes away (measured on 2 CPUs: 7, 10
  and 16 storage workers each waited 12-15 % of a step at the same rate, none of it with the stock empty);
* **the loaders**: ``n`` workers deliver ``n`` times what one delivers. A window that still waited with nothing
  ready was limited by its supply: with ``n`` workers one delivers ``rate / n``; the main process, loading between
  steps, spent the waited share of each step loading, so it delivers ``rate / wait``;
* **the CPUs** this rank may use: a sample costs ``load_cpu`` CPU-seconds to load (measured where it is loaded: the
  training thread's CPU inside the fetch when the main process loads, the workers' CPU when they do) and the
  training process ``step_cpu`` outside it (the step's own, intra-op threads included), so no count exceeds
  ``cpus / (load_cpu + step_cpu)``. Not the process's CPU while the loop waits: its intra-op threads spin then
  and read as busy. ``step_cpu`` is the least any window measured: beside workers competing for the CPUs the
  step burns CPU it does not need (its intra-op threads preempted, the others spinning at their barriers, we
  read), which more workers take back (their share of the CPUs grows). Measured on 2 CPUs (``cpu_decode``): the
  step read 0.53-0.67 ms of CPU a sample in windows with 2 and 3 workers, 0.22 ms in the before-window; over a
  whole fit the training process took 0.77 ms a sample with 3 workers and 0.34 ms with 16, which read 1.3x as
  many samples/s with the CPUs as busy. The latest window's figure capped the model at the rate 3 workers had
  just measured. Read while the step waited, this limit is a lower bound too: a step that waits less costs less.

The pick aims ``HEADROOM`` above the lower of the two bounds: enough workers that the loaders do not limit the
step where it turns out faster than a waiting window could show; the trial and the refit correct the rest.

``rate(n) = min(step, n x loader, CPU limit)``; with no worker, loading and the step take turns. Until loading's
CPU is measured, at most two workers per CPU are considered; until a window with workers has measured what a
worker takes in memory, each is taken to need as much memory as the training process holds privately (the most a
forked copy comes to by writing every page it shares), and the memory available bounds the count by it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeopt.tuning.loader_search import Trial

#: A window that waited at least this share of the step was limited by its loaders' supply.
SUPPLY_BOUND_WAIT = 0.10
#: The pick is the fewest workers whose supply comes within this share of what it aims for.
CLOSE_ENOUGH = 0.03
#: The pick aims this far above the lower of the step's measured rate and the CPU limit (both lower bounds).
HEADROOM = 1.25
#: Waits are capped here so a window that waited almost all the time still yields a finite step rate.
MAX_WAIT = 0.95


@dataclass(frozen=True)
class Capacity:
    """The fitted limits. ``load_cpu``/``step_cpu``: CPU-seconds per sample (None until measured);
    ``worker_mem_bytes``: one worker's private memory, measured or the stand-in above."""

    step_rate: float
    loader_rate: float  # samples/s one worker delivers (or the main process, loading between steps)
    cpus: float
    step_cpu: float | None = None
    load_cpu: float | None = None
    worker_mem_bytes: int | None = None
    memory_bytes: int | None = None
    worker_mem_measured: bool = False  # else the training process's private memory stands in for a worker's

    def rate(self, workers: int) -> float:
        """Predicted samples/s with ``workers`` loader workers (0: the main process loads)."""
        if workers == 0:
            return 1.0 / (1.0 / self.step_rate + 1.0 / self.loader_rate)
        return min(self.step_rate, workers * self.loader_rate, self.cpu_limit)

    @property
    def cpu_limit(self) -> float:
        """The most samples/s the CPUs can load and step (infinite until a sample's CPU is measured)."""
        per_sample = (self.load_cpu or 0.0) + (self.step_cpu or 0.0)
        return self.cpus / per_sample if per_sample > 0 else math.inf

    def most_workers(self, cap: int) -> int:
        """The largest count worth considering: ``cap``, two per CPU until what loading a sample costs in CPU is
        measured (a CPU-bound loader must be measured before more are started), and what the memory holds."""
        most = cap if self.load_cpu is not None else min(cap, max(1, int(2 * self.cpus)))
        held = self._memory_holds()
        return max(1, most if held is None else min(most, held))

    def best(self, cap: int) -> int:
        """The fewest workers (>= 1) whose supply reaches, within ``CLOSE_ENOUGH``, ``HEADROOM`` times the step's
        rate or the CPU limit, whichever is lower; the most allowed when none does."""
        return max(1, min(self.most_workers(cap), self._aimed()))

    def held_back(self, cap: int) -> str | None:
        """Why ``best(cap)`` is fewer workers than the model aims for, in words for the report: the memory the
        workers may take, two per CPU until loading's CPU is measured, or the cap; None where it is not."""
        aimed, most = self._aimed(), self.most_workers(cap)
        if aimed <= most:
            return None
        held = self._memory_holds()
        if held is not None and max(1, held) == most:  # (both sizes known, then)
            each = ("measured" if self.worker_mem_measured
                    else "the training process's private memory, until a worker is measured")
            return (f"it aims for {aimed}, but {most} fit the {(self.memory_bytes or 0) / 2**30:.1f} GiB workers may "
                    f"take at {(self.worker_mem_bytes or 0) / 2**30:.1f} GiB each ({each})")
        if self.load_cpu is None and most < cap:
            return f"it aims for {aimed}, but considers two per CPU until loading a sample's CPU is measured"
        return f"it aims for {aimed}, but {most} is the most pipeopt starts"

    def _aimed(self) -> int:
        """The workers whose supply reaches, within ``CLOSE_ENOUGH``, ``HEADROOM`` times the lower bound."""
        goal = (1.0 - CLOSE_ENOUGH) * HEADROOM * min(self.step_rate, self.cpu_limit)
        return max(1, math.ceil(goal / self.loader_rate))

    def _memory_holds(self) -> int | None:
        """How many workers the memory they may take holds (None: not known)."""
        if self.worker_mem_bytes and self.memory_bytes is not None:
            return self.memory_bytes // self.worker_mem_bytes
        return None


def supply_wait(t: Trial) -> float:
    """The share of ``t``'s steps more loaders could take away: the wait with no batch ready (all of the wait where
    the loader's stock was not read), capped at ``MAX_WAIT``."""
    share = t.data_wait_frac if t.supply_wait_frac is None else t.supply_wait_frac
    return min(max(share or 0.0, 0.0), MAX_WAIT)


def fit(trials: Sequence[Trial], *, cpus: float, memory_bytes: int | None = None,
        training_mem_bytes: int | None = None) -> Capacity | None:
    """The model of the measured ``trials`` (the baseline first); None when no trial measured a rate.
    ``training_mem_bytes``: the training process's private memory, a worker's stand-in until one is measured."""
    ok = [t for t in trials if t.rate is not None and t.rate.value > 0 and not t.settings.dali]
    if not ok:
        return None

    stepped = [t for t in ok if t.settings.num_workers] or ok  # with workers, the step also receives each batch
    step_rate = max(t.rate.value / (1.0 - supply_wait(t)) for t in stepped if t.rate is not None)
    loader_rate = None
    for t in ok:  # the latest window limited by its supply says what one loader delivers
        if t.rate is not None and supply_wait(t) >= SUPPLY_BOUND_WAIT:
            n = t.settings.num_workers
            loader_rate = t.rate.value / n if n else t.rate.value / supply_wait(t)
    if loader_rate is None:  # nothing waited: every loader kept up; a worker delivers at least the step's share
        loader_rate = step_rate
    measured_load = [t.load_cpu_s for t in ok if t.load_cpu_s is not None]
    measured_step = [t.step_cpu_s for t in ok if t.step_cpu_s is not None]  # the least: without contention
    mem = next((t.worker_mem_bytes for t in reversed(ok) if t.settings.num_workers and t.worker_mem_bytes), None)
    return Capacity(step_rate=step_rate, loader_rate=loader_rate, cpus=float(cpus),
                    step_cpu=min(measured_step) if measured_step else None,
                    load_cpu=measured_load[-1] if measured_load else None,
                    worker_mem_bytes=mem or training_mem_bytes, memory_bytes=memory_bytes,
                    worker_mem_measured=mem is not None)
