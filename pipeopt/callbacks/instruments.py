"""What measures a fit: the step timer fed by a profiler tap on the Trainer's own profiler, the window meter with its
CPU, memory and (on CUDA, with a driver) NVML probe, the memory breakdown, each epoch's wall time, and the environment
for the report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeopt import _lightning
from pipeopt.apply.loader import live_ready_batches
from pipeopt.config import PipeOptConfig
from pipeopt.measure.batch import batch_size
from pipeopt.measure.cpu import CpuMeter
from pipeopt.measure.device import clock_for, device_memory_bytes
from pipeopt.measure.memory import MemoryMeter
from pipeopt.measure.nvml import NOT_CUDA, NvmlSampler, device_handle, open_nvml
from pipeopt.measure.resources import ResourceProbe
from pipeopt.measure.steps import StepTimer
from pipeopt.measure.tap import ProfilerTap
from pipeopt.measure.window import WindowMeter, WindowStats
from pipeopt.report import environment


class Instruments:
    """Started on a fit's trainer; ``release`` gives the trainer its profiler back and stops the NVML sampler."""

    def __init__(self, trainer: Any, config: PipeOptConfig, clock: Callable[[], float],
                 on_window: Callable[[WindowStats], None]) -> None:
        device = trainer.strategy.root_device
        nvml, gpu_status = open_nvml()
        if nvml is not None and device.type != "cuda":
            nvml.nvmlShutdown()
            nvml, gpu_status = None, NOT_CUDA
        self.sampler = NvmlSampler(nvml, device_handle(nvml, device), clock=clock) if nvml is not None else None
        if self.sampler is not None:
            self.sampler.start()
        device_clock = clock_for(device, clock)
        self.probe = ResourceProbe(device, cpu=CpuMeter(clock=clock), gpu=self.sampler, gpu_status=gpu_status,
                                   ready=lambda: live_ready_batches(trainer), clock=clock)
        self.meter = WindowMeter(window=config.window, warmup=config.warmup, clock=device_clock, probe=self.probe,
                                 on_window=on_window)
        self.timer = timer = StepTimer(clock, device_clock, self.meter.update)
        transfer = _lightning.transfer_action(trainer)
        tap = ProfilerTap(
            trainer.profiler,
            on_start={_lightning.FETCH_ACTION: timer.fetch_started, transfer: timer.transfer_started,
                      _lightning.COMPUTE_ACTION: timer.compute_started},
            on_stop={_lightning.FETCH_ACTION: timer.fetch_stopped, transfer: timer.transfer_stopped,
                     _lightning.COMPUTE_ACTION: timer.compute_stopped},
        )
        self._previous_profiler = _lightning.swap_profiler(trainer, tap)
        self.environment = environment.collect(device, world_size=trainer.world_size, gpu_monitoring=gpu_status)
        self.device_memory = device_memory_bytes(device)
        self.memory = MemoryMeter()
        self.epochs_s: list[float] = []  # wall time of each train epoch run to its end
        self._clock = clock
        self._epoch_start: float | None = None
        self._samples: int | None = None  # samples in the batch in progress

    @property
    def batch_samples(self) -> int | None:
        """Samples in the batch in progress (None: not counted)."""
        return self._samples

    def batch_started(self, trainer: Any, batch: Any) -> None:
        self._samples = batch_size(batch)  # walked once a batch: the timer counts the same batch at its end
        self.memory.batch_started(batch, self._samples, _lightning.precision_of(trainer))

    def batch_ended(self, trainer: Any, batch: Any, stepped: bool) -> None:
        self.timer.batch_ended(self._samples, stepped)
        if stepped:
            self.memory.after_step(trainer.optimizers)

    def interrupted(self, epoch: str | None) -> None:
        """Validation or an epoch boundary (``epoch``: "started" or "ended"): the step in progress is not a training
        step; an epoch's wall time is kept."""
        self.timer.interrupted()
        if epoch == "started":
            self._epoch_start = self._clock()
        elif epoch == "ended" and self._epoch_start is not None:
            self.epochs_s.append(self._clock() - self._epoch_start)
            self._epoch_start = None

    def finish(self, window: int) -> None:
        """The fit ends: the step in progress is dropped; a last, shorter window (at least half of ``window``) still
        tells the end of the run."""
        self.timer.interrupted()
        if self.meter.pending_steps >= max(2, window // 2):
            self.meter.compute()

    def release(self, trainer: Any) -> None:
        if isinstance(trainer.profiler, ProfilerTap):
            _lightning.swap_profiler(trainer, self._previous_profiler)
        if self.sampler is not None:
            self.sampler.stop()
