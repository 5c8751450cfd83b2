"""A capacity model of the input pipeline, fitted to the windows the run measured: what throughput any worker count
would reach, so the search can try the predicted best first and check it, instead of walking counts one by one.

Three limits, in samples/s (Plumber's view of a pipeline as stages with rates and CPU costs, fitted here to live
windows rather than traced):

* **the step**: the rate at which the step consumes samples once input is free - a window's rate over the share of
  it that did not wait for data (``rate / (1 - wait)``);
* **the loaders**: ``n`` workers deliver ``n`` times what one delivers. A window that still waited was limited by
  its supply: with ``n`` workers one delivers ``rate / n``; the main process, loading between steps, spent the waited
  share of each step loading, so it delivers ``rate / wait``;
* **the CPUs** this rank may use: each sample costs the training process ``main`` and the workers ``worker``
  CPU-seconds (measured once a window ran with workers: their CPU use over the rate), so no count can exceed
  ``cpus / (main + worker)``.

``rate(n) = min(step, n x loader, CPU limit)``; with no worker, loading and the step take turns. Until a window
with workers has measured what a worker costs in CPU, at most two workers per CPU are considered (a storage-bound
worker mostly waits; a CPU-bound one must be measured before more are started), and a worker's measured memory
bounds the count by the memory available.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeopt.tuning.loader_search import Trial

#: A window that waited at least this share of the step was limited by its loaders' supply.
SUPPLY_BOUND_WAIT = 0.10
#: The fewest workers whose predicted rate is within this share of the best predicted rate is the pick.
CLOSE_ENOUGH = 0.03
#: Waits are capped here so a window that waited almost all the time still yields a finite step rate.
MAX_WAIT = 0.95


@dataclass(frozen=True)
class Capacity:
    """The fitted limits. ``worker_cpu``/``main_cpu``: CPU-seconds per sample (None until measured with workers)."""

    step_rate: float
    loader_rate: float  # samples/s one worker delivers (or the main process, loading between steps)
    cpus: float
    main_cpu: float | None = None
    worker_cpu: float | None = None
    worker_mem_bytes: int | None = None
    memory_bytes: int | None = None

    def rate(self, workers: int) -> float:
        """Predicted samples/s with ``workers`` loader workers (0: the main process loads)."""
        if workers == 0:
            return 1.0 / (1.0 / self.step_rate + 1.0 / self.loader_rate)
        rate = min(self.step_rate, workers * self.loader_rate)
        cpu = self.cpu_limit
        return rate if cpu is None else min(rate, cpu)

    @property
    def cpu_limit(self) -> float | None:
        if self.main_cpu is None or self.worker_cpu is None or self.main_cpu + self.worker_cpu <= 0:
            return None
        return self.cpus / (self.main_cpu + self.worker_cpu)

    def most_workers(self, cap: int) -> int:
        """The largest count worth considering: ``cap``, two per CPU until a worker's CPU is measured, and what
        the memory available holds."""
        most = cap if self.worker_cpu is not None else min(cap, max(1, int(2 * self.cpus)))
        if self.worker_mem_bytes and self.memory_bytes is not None:
            most = min(most, max(1, self.memory_bytes // self.worker_mem_bytes))
        return max(1, most)

    def best(self, cap: int) -> int:
        """The fewest workers (>= 1) predicted within ``CLOSE_ENOUGH`` of the best rate any allowed count reaches."""
        counts = range(1, self.most_workers(cap) + 1)
        top = max(self.rate(n) for n in counts)
        return next(n for n in counts if self.rate(n) >= (1.0 - CLOSE_ENOUGH) * top)


def fit(trials: Sequence[Trial], *, cpus: float, memory_bytes: int | None = None) -> Capacity | None:
    """The model of the measured ``trials`` (the baseline first); None when no trial measured a rate."""
    ok = [t for t in trials if t.rate is not None and t.rate.value > 0]
    if not ok:
        return None

    def wait(t: Trial) -> float:
        return min(max(t.data_wait_frac or 0.0, 0.0), MAX_WAIT)

    step_rate = max(t.rate.value / (1.0 - wait(t)) for t in ok if t.rate is not None)
    loader_rate = None
    for t in ok:  # the latest window limited by its supply says what one loader delivers
        if t.rate is not None and not t.settings.dali and wait(t) >= SUPPLY_BOUND_WAIT:
            n = t.settings.num_workers
            loader_rate = t.rate.value / n if n else t.rate.value / wait(t)
    if loader_rate is None:  # nothing waited: every loader kept up; a worker delivers at least the step's share
        loader_rate = step_rate
    with_workers = [t for t in ok if t.settings.num_workers > 0 and not t.settings.dali
                    and t.cpu_workers_pct is not None and t.cpu_main_pct is not None]
    main_cpu = worker_cpu = None
    mem = next((t.worker_mem_bytes for t in reversed(with_workers) if t.worker_mem_bytes), None)
    if with_workers:
        last = with_workers[-1]
        rate = last.rate.value if last.rate is not None else 1.0
        main_cpu, worker_cpu = (last.cpu_main_pct or 0.0) / 100.0 / rate, (last.cpu_workers_pct or 0.0) / 100.0 / rate
    return Capacity(step_rate=step_rate, loader_rate=loader_rate, cpus=float(cpus), main_cpu=main_cpu,
                    worker_cpu=worker_cpu, worker_mem_bytes=mem, memory_bytes=memory_bytes)
