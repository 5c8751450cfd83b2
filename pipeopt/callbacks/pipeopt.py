"""The Lightning callback: measure the live run, judge it, report before/after figures."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from rich.console import Console

from pipeopt import _compat
from pipeopt._compat import Callback, rank_zero_warn
from pipeopt.config import TUNE_GROUPS, PathLike, PipeOptConfig
from pipeopt.measure.batch import batch_size
from pipeopt.measure.cpu import CpuMeter
from pipeopt.measure.device import clock_for
from pipeopt.measure.nvml import NOT_CUDA, NvmlSampler, device_handle, open_nvml
from pipeopt.measure.resources import ResourceProbe
from pipeopt.measure.steps import StepTimer
from pipeopt.measure.tap import ProfilerTap
from pipeopt.measure.window import WindowMeter, WindowStats
from pipeopt.report import environment
from pipeopt.report.console import print_report
from pipeopt.report.json_io import write_report
from pipeopt.report.metrics import summary_metrics, window_metrics
from pipeopt.report.model import Report, Skipped
from pipeopt.verdict import judge

#: Knob groups whose tuner exists in this release. The others are skipped with one warning.
IMPLEMENTED_GROUPS: frozenset[str] = frozenset()


class PipeOpt(Callback):
    """Measure where a training step's time goes, and report it.

    Per optimizer step it times the wait for the next batch, the transfer to the device and the compute
    (forward + backward + optimizer; CUDA events on GPU), groups steps into windows and reports samples/s,
    data-wait and busy fractions, CPU use of the process and its loader workers, device memory and - with
    NVML - GPU utilisation, memory and power. At the end of fit it prints a before/after table (rank zero),
    writes a JSON report to ``report_dir`` and logs ``pipeopt/...`` metrics to the Trainer's loggers
    (keys: :mod:`pipeopt.report.metrics`).

    Args:
        tune: knob groups pipeopt may turn, drawn from ``{"loader", "dali", "precision", "batch"}``;
            ``()`` observes only. Groups not implemented in this release are skipped with a warning.
        budget_s: wall-clock budget for all tuning trials, seconds (> 0).
        memory_fraction: share of device memory a tuned configuration may plan to use, in (0, 1].
        window: optimizer steps per measurement window (>= 2).
        warmup: optimizer steps ignored at the start of fit (>= 0).
        report_dir: directory for the JSON report; ``None`` writes no file.
        cache: reuse tuned configurations across runs (``True``, ``False`` or a file path).
        console: where the table is printed (default: a new ``rich.console.Console``).
        clock: host clock, seconds (injectable for tests).
    """

    def __init__(
        self,
        *,
        tune: Collection[str] = TUNE_GROUPS,
        budget_s: float = 60.0,
        memory_fraction: float = 0.9,
        window: int = 20,
        warmup: int = 5,
        report_dir: PathLike | None = "pipeopt_reports",
        cache: bool | PathLike = True,
        console: Console | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = PipeOptConfig(
            tune=tune,  # type: ignore[arg-type]  # validated and normalised by the config
            budget_s=budget_s,
            memory_fraction=memory_fraction,
            window=window,
            warmup=warmup,
            report_dir=report_dir,  # type: ignore[arg-type]
            cache=cache,  # type: ignore[arg-type]
        )
        self._console = console
        self._clock = clock
        self.report: Report | None = None
        self.report_path: Path | None = None
        self.windows: list[WindowStats] = []
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._trainer: Any = None
        self._timer: StepTimer | None = None
        self._meter: WindowMeter | None = None
        self._sampler: NvmlSampler | None = None
        self._previous_profiler: Any = None
        self._step_at_batch_start = 0
        self._skipped: list[Skipped] = []
        self._env: environment.Environment | None = None

    # -- set-up and clean-up ------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self.windows = []
        self.report = self.report_path = None
        self._trainer = trainer
        missing = sorted(self.config.tune - IMPLEMENTED_GROUPS, key=TUNE_GROUPS.index)
        if missing:
            reason = "not implemented in this pipeopt release; observed only"
            self._skipped = [Skipped(group, reason) for group in missing]
            rank_zero_warn(
                f"PipeOpt: tuning of {', '.join(missing)} is not available in this release; the run is observed "
                "and reported, those knobs are left as they are. Pass `tune=()` to observe only without this warning."
            )

        device = trainer.strategy.root_device
        nvml, gpu_status = open_nvml()
        if nvml is not None and device.type != "cuda":
            nvml.nvmlShutdown()
            nvml, gpu_status = None, NOT_CUDA
        if nvml is not None:
            self._sampler = NvmlSampler(nvml, device_handle(nvml, device), clock=self._clock)
            self._sampler.start()
        device_clock = clock_for(device, self._clock)
        probe = ResourceProbe(device, cpu=CpuMeter(clock=self._clock), gpu=self._sampler, gpu_status=gpu_status,
                              clock=self._clock)
        cfg = self.config
        self._meter = WindowMeter(
            window=cfg.window, warmup=cfg.warmup, clock=device_clock, probe=probe, on_window=self._on_window
        )
        self._timer = timer = StepTimer(self._clock, device_clock, self._meter.update)
        transfer = _compat.transfer_action(trainer)
        tap = ProfilerTap(
            trainer.profiler,
            on_start={
                _compat.FETCH_ACTION: timer.fetch_started,
                transfer: timer.transfer_started,
                _compat.COMPUTE_ACTION: timer.compute_started,
            },
            on_stop={
                _compat.FETCH_ACTION: timer.fetch_stopped,
                transfer: timer.transfer_stopped,
                _compat.COMPUTE_ACTION: timer.compute_stopped,
            },
        )
        self._previous_profiler = _compat.swap_profiler(trainer, tap)
        self._env = environment.collect(device, world_size=trainer.world_size, gpu_monitoring=gpu_status)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._release(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._release(trainer)

    def _release(self, trainer: Any) -> None:
        if self._previous_profiler is not None and isinstance(trainer.profiler, ProfilerTap):
            _compat.swap_profiler(trainer, self._previous_profiler)
        if self._sampler is not None:
            self._sampler.stop()
        self._reset_run_state()

    # -- the loop -----------------------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is not None:
            self._timer.interrupted()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is not None:
            self._timer.interrupted()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is not None:
            self._timer.interrupted()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._timer is not None:
            self._timer.batch_ended(batch_size(batch), trainer.global_step > self._step_at_batch_start)

    def _on_window(self, stats: WindowStats) -> None:
        self.windows.append(stats)
        trainer = self._trainer
        if trainer is not None and trainer.is_global_zero:
            metrics = window_metrics(stats)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    # -- the report ---------------------------------------------------------------------------------------
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self._meter is None or self._timer is None or self._env is None:
            return
        self._timer.interrupted()
        if self._meter.pending_steps >= max(2, self.config.window // 2):
            self._meter.compute()  # a last, shorter window still tells the end of the run
        report = self._build_report()
        self.report = report
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(summary_metrics(report), step=trainer.global_step)
        print_report(report, self._console)
        if self.config.report_dir is not None:
            try:
                self.report_path = write_report(report, self.config.report_dir)
            except OSError as err:
                rank_zero_warn(f"PipeOpt could not write its report to {self.config.report_dir}: {err}. "
                               "Training results are unaffected; pass `report_dir=` a writable directory.")

    def _build_report(self) -> Report:
        windows = self.windows
        before = windows[0] if windows else None
        after = windows[-1] if len(windows) > 1 else None
        notes = []
        if self._timer is not None and self._timer.dropped_partial:
            notes.append(f"{self._timer.dropped_partial} accumulation group(s) cut short by validation or an epoch "
                         "end were not measured")
        if windows and all(w.wait_s == 0.0 for w in windows):
            notes.append("no data fetch was timed: this Lightning version or a custom data fetcher hides the "
                         "train loader's `next()`; data wait shows 0")
        return Report(
            mode="observe" if self.config.observe_only or not (self.config.tune & IMPLEMENTED_GROUPS) else "tune",
            environment=self._env,  # type: ignore[arg-type]
            before=before,
            after=after,
            verdict=judge(before) if before else None,
            skipped=list(self._skipped),
            notes=notes,
            timeline=list(windows),
            steps_measured=self._meter.steps_seen if self._meter else 0,
        )

    @property
    def state_key(self) -> str:
        return "PipeOpt"
