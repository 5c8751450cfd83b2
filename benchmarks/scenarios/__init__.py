"""Scenario workloads: ordinary Lightning modules and datasets on synthetic data, each with an oracle grid.

Each scenario is one typical way a training run uses (or starves) the accelerator:
- ``storage_latency``: every sample waits on slow storage (sleep, no CPU): more loader workers hide it.
- ``cpu_decode``: every sample is a JPEG decoded and augmented with Pillow: bounded by the CPU cores.
- ``compute_bound``: resident tensors into a big MLP: the loader is not the problem.
- ``balanced``: per-sample CPU work about as long as the step's compute.
"""

from __future__ import annotations

from benchmarks.scenarios.base import Scenario
from benchmarks.scenarios.workloads import SCENARIOS

__all__ = ["SCENARIOS", "Scenario"]
