"""The direct cost of pipeopt's per-step bookkeeping, without a training loop around it.

    python -m benchmarks.bookkeeping [--steps 20000]

Drives the same pieces a fit drives - the profiler tap's three action pairs, the step timer, the window meter with
the real CPU/memory probe closing a window every 20 steps, and the per-step count of ready batches in a live
DataLoader iterator with 8 workers (its queue's ``qsize`` and out-of-order results) - and reports microseconds
per step, and that cost as a share of the compute-bound scenario's measured step time
(benchmarks/results/compute_bound.json). This is the figure behind "measuring costs <= 1 %" that the side-by-side
fits cannot resolve: their noise is +-2 % here.
Writes benchmarks/results/bookkeeping.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from pipeopt import _dataloader
from pipeopt._lightning import COMPUTE_ACTION, FETCH_ACTION
from pipeopt.measure.batch import batch_size
from pipeopt.measure.cpu import CpuMeter
from pipeopt.measure.device import HostClock
from pipeopt.measure.resources import ResourceProbe
from pipeopt.measure.steps import StepTimer
from pipeopt.measure.tap import ProfilerTap
from pipeopt.measure.window import WindowMeter

RESULTS = Path(__file__).resolve().parent / "results"
TRANSFER = "[Strategy]SingleDeviceStrategy.batch_to_device"


class _NoProfiler:
    def start(self, name: str) -> None:
        pass

    def stop(self, name: str) -> None:
        pass


def per_step_seconds(steps: int, instrumented: bool, live: object) -> float:
    windows: list = []
    epoch = object()
    meter = WindowMeter(window=20, warmup=5, clock=HostClock(),
                        probe=ResourceProbe(torch.device("cpu"), cpu=CpuMeter(), gpu=None, gpu_status="n/a",
                                            ready=lambda: (epoch, _dataloader.ready_batches(live) or 0)),
                        on_window=windows.append)
    timer = StepTimer(time.perf_counter, HostClock(), meter.update)
    hooks = {FETCH_ACTION: (timer.fetch_started, timer.fetch_stopped),
             TRANSFER: (timer.transfer_started, timer.transfer_stopped),
             COMPUTE_ACTION: (timer.compute_started, timer.compute_stopped)}
    profiler = ProfilerTap(_NoProfiler(), {k: v[0] for k, v in hooks.items()},
                           {k: v[1] for k, v in hooks.items()}) if instrumented else _NoProfiler()
    batch = (torch.zeros(8, 4), torch.zeros(8))
    start = time.perf_counter()
    for _ in range(steps):
        for action in (FETCH_ACTION, TRANSFER, COMPUTE_ACTION, "[Callback]other.on_train_batch_end"):
            profiler.start(action)
            profiler.stop(action)
        if instrumented:
            timer.batch_ended(batch_size(batch), optimizer_stepped=True)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()
    live = iter(DataLoader(TensorDataset(torch.zeros(64, 4)), batch_size=4, num_workers=8, prefetch_factor=2))
    try:
        plain = min(per_step_seconds(args.steps, False, live) for _ in range(3))
        tapped = min(per_step_seconds(args.steps, True, live) for _ in range(3))
    finally:
        _dataloader.shutdown_iterator(live)
    cost = tapped - plain
    compute = json.loads((RESULTS / "compute_bound.json").read_text())
    step_s = compute["batch_size"] / compute["oracle_best"]["samples_per_s"]
    result = {
        "command": f"python -m benchmarks.bookkeeping --steps {args.steps}",
        "bookkeeping_us_per_step": cost * 1e6,
        "compute_bound_step_ms": step_s * 1e3,
        "share_of_compute_bound_step_pct": 100 * cost / step_s,
    }
    (RESULTS / "bookkeeping.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
