"""What the run ran on, for the report."""

from __future__ import annotations

import platform

import torch

from pipeopt._lightning import lightning_versions
from pipeopt._version import __version__
from pipeopt.measure.cpu import cpus_available
from pipeopt.report.model import Environment


def collect(device: torch.device, *, world_size: int, gpu_monitoring: str) -> Environment:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        count = torch.cuda.device_count()
    else:
        name = platform.processor() or platform.machine() or device.type
        count = 1
    return Environment(
        accelerator=device.type,
        device_name=name,
        device_count=count,
        world_size=world_size,
        cpu_count=cpus_available(),
        python=platform.python_version(),
        torch=torch.__version__,
        lightning=lightning_versions(),
        pipeopt=__version__,
        gpu_monitoring=gpu_monitoring,
    )
