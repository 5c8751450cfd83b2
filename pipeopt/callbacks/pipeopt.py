"""The Lightning callback: a thin adapter from Lightning's hooks to the instruments that measure the fit
(``instruments``) and the tuning run that decides and applies (``run``); it reports at the end of the fit."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from rich.console import Console

from pipeopt import _lightning
from pipeopt._lightning import rank_zero_warn
from pipeopt.callbacks.instruments import Instruments
from pipeopt.callbacks.run import TuningRun
from pipeopt.config import TUNE_GROUPS, PathLike, PipeOptConfig
from pipeopt.measure.window import WindowStats
from pipeopt.report.metrics import summary_metrics, window_metrics
from pipeopt.report.model import Report
from pipeopt.report.publish import publish

#: Version of the state PipeOpt saves in checkpoints.
STATE_VERSION = 1


class PipeOpt(_lightning.JoinedCallback):
    """Measure where a training step's time goes (data wait, transfer, compute; CUDA events on GPU; CPU, memory
    and NVML figures per window), tune what ``tune`` allows on the live run, and report before/after figures: a
    table (rank zero), JSON and HTML files in ``report_dir``, ``pipeopt/...`` logger metrics
    (:mod:`pipeopt.report.metrics`).

    Args:
        tune: knob groups pipeopt may turn, drawn from ``{"loader", "dali", "precision", "batch", "cache"}``;
            ``()`` observes only. ``"dali"``: NVIDIA DALI as one more loader candidate, where it is installed and can
            rebuild the train dataset. ``"cache"``: the sample cache (docs/cache.md), where the dataset is shown
            deterministic. A group that cannot run is skipped, with the reason in the report.
        budget_s: wall-clock budget for all tuning trials, seconds (> 0).
        memory_fraction: share of device memory a tuned configuration may plan to use, in (0, 1].
        window: optimizer steps per measurement window (>= 2).
        window_s: trial and after windows last at least this many seconds (in steps at the measured pace), so a
            shared machine's second-to-second wobble averages out; 0 for ``window`` steps only.
        warmup: optimizer steps ignored at the start of fit (>= 0).
        report_dir: directory for the JSON and HTML reports; ``None`` writes no file.
        cache: reuse tuned configurations across runs (``True``: the default location, see
            :mod:`pipeopt.cache`; ``False``: off; or a file path). A run whose fingerprint (model, dataset,
            loader arguments, accelerator, CPUs, versions) matches applies the cached configuration at once,
            verifies it with one window and tunes afresh only if that fails.
        stop_when_tuned: stop the fit cleanly once tuning and its after-window are done (``pipeopt tune``).
        cost_per_hour: the price of an hour of the run's machines (any currency): the report then gives each epoch's
            and the fit's cost before and after tuning. No prices are built in.
        sample_cache_dir, sample_cache_share, keep_sample_cache: the sample cache's place (default: shared memory
            or report_dir, sized by free memory; or a disk directory, by its space), its share, whether it is kept.
        console: where the table is printed (default: a new ``rich.console.Console``).
        clock: host clock, seconds (injectable for tests).

    A Lightning callback of whichever Lightning the program uses (``lightning.pytorch`` or ``pytorch_lightning``):
    the instance's class joins the ``Callback`` of the one already imported, so pipeopt never imports the other.
    """

    def __getstate__(self) -> dict[str, Any]:  # a console holds a lock: a spawned copy prints to its own
        return {**self.__dict__, "_console": None}

    def __init__(self, *, tune: Collection[str] = TUNE_GROUPS, budget_s: float = 60.0, memory_fraction: float = 0.9,
                 window: int = 20, window_s: float = 1.0, warmup: int = 5,
                 report_dir: PathLike | None = "pipeopt_reports", cache: bool | PathLike = True,
                 stop_when_tuned: bool = False, cost_per_hour: float | None = None,
                 sample_cache_dir: PathLike | None = None, sample_cache_share: float = 0.5,
                 keep_sample_cache: bool = False, console: Console | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = PipeOptConfig(  # validates; makes `tune` a frozenset and paths Paths (hence the ignore)
            tune=tune, budget_s=budget_s, memory_fraction=memory_fraction, window=window,  # type: ignore[arg-type]
            window_s=window_s, warmup=warmup, report_dir=report_dir, cache=cache,  # type: ignore[arg-type]
            stop_when_tuned=stop_when_tuned, cost_per_hour=cost_per_hour, sample_cache_dir=sample_cache_dir,  # type: ignore[arg-type]
            sample_cache_share=sample_cache_share, keep_sample_cache=keep_sample_cache)
        self._console = console
        self._clock = clock
        self.report: Report | None = None
        self.report_path: Path | None = None  # the JSON report
        self.html_path: Path | None = None  # the same report as an HTML page with charts
        self.cache_path: Path | None = None  # the tuning cache this fit used
        self.windows: list[WindowStats] = []
        self._restored: dict[str, Any] | None = None  # tuned state from a checkpoint, applied at train start
        self._instruments: Instruments | None = None
        self._run: TuningRun | None = None
        self._trainer: Any = None
        self._step_at_batch_start = 0
        self._log_step = 0  # the logger step of the last batch trained (Lightning's numbering)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self.windows = []
        self.report = self.report_path = self.html_path = self.cache_path = None
        self._trainer = trainer
        self._instruments = Instruments(trainer, self.config, self._clock, self._on_window)
        self._run = TuningRun(self.config, self._instruments, clock=self._clock, say=self._say, agree=self._agree)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._run is not None:
            self._run.start(trainer, pl_module, self._restored)
            self.cache_path = self._run.cache.path if self._run.cache is not None else None

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._release(trainer, failed=False)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._release(trainer, failed=True)

    def _release(self, trainer: Any, *, failed: bool) -> None:
        if self._run is not None:
            self._run.close(trainer, failed=failed)
        if self._instruments is not None:
            self._instruments.release(trainer)
        self._instruments = self._run = self._trainer = self._restored = None  # the restored state served this fit

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._interrupted(epoch="started")
        if self._run is not None:
            self._run.epoch_started()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._interrupted()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._interrupted(epoch="ended")
        if self._run is not None:
            self._run.epoch_ended(trainer.current_epoch)

    def _interrupted(self, epoch: str | None = None) -> None:  # validation or an epoch boundary: not a training step
        if self._instruments is not None:
            self._instruments.interrupted(epoch)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step
        if self._instruments is not None:
            self._instruments.batch_started(trainer, batch)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:  # the step's graph, read only
        if self._instruments is not None:
            self._instruments.memory.before_backward(loss, pl_module)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._instruments is not None:
            self._instruments.memory.before_optimizer_step(pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log_step = _lightning.logger_step(trainer)  # a window closing in this batch describes this step
        stepped = trainer.global_step > self._step_at_batch_start
        run, instruments = self._run, self._instruments
        if run is not None:
            run.batch_ended(trainer, outputs)
        if instruments is not None:
            instruments.batch_ended(trainer, batch, stepped)
        if run is not None:
            run.step_ended(trainer, stepped, len(self.windows))
            if self.config.stop_when_tuned and run.finished(len(self.windows)):
                trainer.should_stop = True

    def _on_window(self, stats: WindowStats) -> None:
        self.windows.append(stats)
        if self._run is not None:
            self._run.on_window(stats)
        if self._trainer is not None and self._trainer.is_global_zero:  # at the step of the last batch trained
            _lightning.log_metrics(self._trainer, window_metrics(stats), self._log_step)

    def _agree(self, values: list[float]) -> list[float]:  # the one collective every group agrees through
        return _lightning.reduce_max(self._trainer, values)

    def _say(self, line: str) -> None:
        (self._console or Console()).print(f"[bold]pipeopt[/bold] {line}", highlight=False)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        instruments, run = self._instruments, self._run
        if instruments is None or run is None:
            return
        run.finish()
        instruments.finish(self.config.window)
        report = self.report = run.report(trainer, self.windows, instruments)
        if trainer.is_global_zero:
            run.remember(report)
            _lightning.log_metrics(trainer, summary_metrics(report), self._log_step)
            self.report_path, self.html_path = publish(report, console=self._console,
                                                       report_dir=self.config.report_dir)

    state_key = property(lambda self: "PipeOpt")

    def state_dict(self) -> dict[str, Any]:
        """What tuning kept, so a run resumed from this checkpoint applies it without trials."""
        tuned = self._run.tuned() if self._run is not None else {}
        return {"version": STATE_VERSION, "tuned": tuned or None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != STATE_VERSION:
            rank_zero_warn(f"PipeOpt: ignoring checkpoint state of version {state_dict.get('version')!r} "
                           f"(this release reads version {STATE_VERSION}); the run is tuned afresh.")
            return
        self._restored = state_dict.get("tuned")
