"""Synthetic input pipelines that behave like real ones: a step that consumes samples at a fixed input-free rate,
loaders that deliver at a fixed rate each, and CPU-seconds per sample for the training thread and for loading that
stay what they are whatever the rate (so the CPU use a window reports is the rate times them). As on a real CPU
machine, the training process's CPU also counts its intra-op threads spinning while the loop waits for data
(``SPIN_PCT`` of a core for the whole wait): busy-looking time that is no load. Where workers compete with the
step for the CPUs, the step's intra-op threads also spin at their barriers while one of them is preempted
(``barrier_cpu``): CPU the step burns without needing it, less the more workers take the CPUs' share."""

from __future__ import annotations

from dataclasses import dataclass

from pipeopt.tuning.loader_search import LoaderSettings, Trial
from pipeopt.tuning.noise import Rate

GIB = 1024**3
#: CPU (100 = a core) the training process's idle intra-op threads burn while the loop waits for data.
SPIN_PCT = 100.0


@dataclass(frozen=True)
class World:
    step_rate: float  # samples/s the step consumes once input is free
    loader_rate: float  # samples/s one loader delivers when it has the CPU it needs
    cpus: float
    main_cpu: float  # CPU-seconds per sample of the training step
    load_cpu: float  # CPU-seconds per sample of loading
    worker_mem: int = 0
    fail_from: int | None = None  # this many workers or more crash
    receive_s: float = 0.0  # seconds per sample the loop spends taking a ready batch from a worker (a wait, not supply)
    barrier_cpu: float = 0.0  # CPU-seconds per sample the step spins at its barriers beside one worker (/ n beside n)

    def step_cpu(self, workers: int) -> float:
        """CPU-seconds per sample the step burns beside ``workers`` (its own, and its spin at the barriers)."""
        return self.main_cpu + (self.barrier_cpu / workers if workers else 0.0)

    def rate(self, workers: int) -> float:
        if workers == 0:  # loading and the step take turns in the main process
            return 1.0 / (1.0 / self.step_rate + 1.0 / self.loader_rate)
        step = 1.0 / (1.0 / self.step_rate + self.receive_s)  # with workers, each batch is also received
        return min(step, workers * self.loader_rate, self.cpus / (self.step_cpu(workers) + self.load_cpu))

    def best(self, most: int = 64) -> tuple[int, float]:
        """The fewest workers reaching the best rate, and that rate."""
        top = max(self.rate(n) for n in range(1, most + 1))
        return next(n for n in range(1, most + 1) if self.rate(n) >= top * 0.999), top

    def __call__(self, settings: LoaderSettings) -> Trial:
        n = settings.num_workers
        if self.fail_from is not None and n >= self.fail_from:
            return Trial(settings, None, error="RuntimeError: DataLoader worker (pid 1) exited unexpectedly")
        rate = self.rate(n)
        wait = 1.0 - rate / self.step_rate
        starved = wait - (rate * self.receive_s if n else 0.0)  # what remains once receiving is taken out
        if n == 0:
            main, workers = rate * (self.main_cpu + self.load_cpu), 0.0
        else:
            main, workers = rate * self.step_cpu(n), rate * self.load_cpu
        return Trial(settings, Rate(rate, 0.01), data_wait_frac=wait, cpu_main_pct=100 * main + SPIN_PCT * wait,
                     cpu_workers_pct=100 * workers, worker_mem_bytes=self.worker_mem if n else None,
                     load_cpu_s=self.load_cpu, step_cpu_s=self.step_cpu(n), supply_wait_frac=max(0.0, starved))


#: Storage latency: each loader waits on slow storage (100 samples/s, little CPU); the step takes 1000/s.
LATENCY = World(step_rate=1000.0, loader_rate=100.0, cpus=2, main_cpu=0.001, load_cpu=0.0002)
#: CPU-bound decoding: a sample costs 4 ms of CPU to load; 2 CPUs cap the rate at 400/s whatever the workers.
CPU_BOUND = World(step_rate=1000.0, loader_rate=250.0, cpus=2, main_cpu=0.001, load_cpu=0.004)
#: Storage latency where taking a batch from a worker costs the loop 0.2 ms a sample: with workers the step reaches
#: 1 / (1 ms + 0.2 ms) = 833/s and then still waits 17 % of it - with a batch ready every time, so no worker count
#: takes that wait away.
RECEIVING = World(step_rate=1000.0, loader_rate=100.0, cpus=2, main_cpu=0.001, load_cpu=0.0002, receive_s=0.0002)
#: Storage latency, where each worker takes 2 GiB of private memory and workers may take 5 GiB.
MEMORY_BOUND = World(step_rate=1000.0, loader_rate=100.0, cpus=2, main_cpu=0.001, load_cpu=0.0002,
                     worker_mem=2 * GIB)
#: CPU-bound decoding where the step's threads spin at their barriers beside the workers (0.9 ms a sample beside one,
#: 0.3 ms beside three): each added worker takes back some of that CPU, so the rate climbs past what the CPUs allowed
#: beside three - 2 / (1 + 0.3 + 0.3) ms = 1,250/s - towards 2 / 1.3 ms = 1,538/s, as on ``cpu_decode``.
CONTENDED = World(step_rate=1500.0, loader_rate=1000.0, cpus=2, main_cpu=0.0003, load_cpu=0.001, barrier_cpu=0.0009)
