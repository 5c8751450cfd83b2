"""The Lightning callback: measure the live run, judge it, report before/after figures."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import psutil
import torch
from rich.console import Console

from pipeopt import _lightning
from pipeopt._lightning import rank_zero_warn
from pipeopt.apply.loader import LoaderSwitcher, live_ready_batches, unsupported
from pipeopt.cache import TunedCache, default_path, fingerprint
from pipeopt.callbacks.fingerprint import fit_parts
from pipeopt.callbacks.start_tuning import BatchTuning, PrecisionTuning
from pipeopt.config import TUNE_GROUPS, PathLike, PipeOptConfig
from pipeopt.dali import DaliSource
from pipeopt.dali import blocker as dali_blocker
from pipeopt.measure.batch import batch_size
from pipeopt.measure.cpu import CpuMeter, cpus_available, worker_private_memory
from pipeopt.measure.device import clock_for
from pipeopt.measure.nvml import NOT_CUDA, NvmlSampler, device_handle, open_nvml
from pipeopt.measure.resources import ResourceProbe
from pipeopt.measure.steps import StepTimer
from pipeopt.measure.tap import ProfilerTap
from pipeopt.measure.window import WindowMeter, WindowStats
from pipeopt.report import environment
from pipeopt.report.console import print_report
from pipeopt.report.findings import loader_suggestion, trial_rows
from pipeopt.report.html import write_html
from pipeopt.report.json_io import write_report
from pipeopt.report.metrics import summary_metrics, window_metrics
from pipeopt.report.model import Report, Skipped
from pipeopt.tuning.loader_search import Budget, LoaderSettings
from pipeopt.tuning.session import LoaderSession
from pipeopt.verdict import judge

#: Version of the state PipeOpt saves in checkpoints.
STATE_VERSION = 1


class PipeOpt:
    """Measure where a training step's time goes, and report it.

    Per optimizer step it times the wait for the next batch, the transfer to the device and the compute
    (forward + backward + optimizer; CUDA events on GPU), groups steps into windows and reports samples/s,
    data-wait and busy fractions, CPU use of the process and its loader workers, device memory and - with
    NVML - GPU utilisation, memory and power. At the end of fit it prints a before/after table (rank zero),
    writes a JSON report to ``report_dir`` and logs ``pipeopt/...`` metrics to the Trainer's loggers
    (keys: :mod:`pipeopt.report.metrics`).

    Args:
        tune: knob groups pipeopt may turn, drawn from ``{"loader", "dali", "precision", "batch"}``;
            ``()`` observes only. ``"dali"`` makes NVIDIA DALI one more candidate of the loader search, where it is
            installed and can rebuild the train dataset (``pipeopt.dali``); otherwise it is skipped with the reason.
        budget_s: wall-clock budget for all tuning trials, seconds (> 0).
        memory_fraction: share of device memory a tuned configuration may plan to use, in (0, 1].
        window: optimizer steps per measurement window (>= 2).
        window_s: trial and after windows last at least this many seconds (in steps at the measured pace), so a
            shared machine's second-to-second wobble averages out; 0 for ``window`` steps only.
        warmup: optimizer steps ignored at the start of fit (>= 0).
        report_dir: directory for the JSON report; ``None`` writes no file.
        cache: reuse tuned configurations across runs (``True``: the default location, see
            :mod:`pipeopt.cache`; ``False``: off; or a file path). A run whose fingerprint (model, dataset,
            loader arguments, accelerator, CPUs, versions) matches applies the cached configuration at once,
            verifies it with one window and tunes afresh only if that fails.
        stop_when_tuned: stop the fit cleanly once tuning and its after-window are done (``pipeopt tune``).
        console: where the table is printed (default: a new ``rich.console.Console``).
        clock: host clock, seconds (injectable for tests).

    A Lightning callback of whichever Lightning the program uses (``lightning.pytorch`` or ``pytorch_lightning``):
    the instance's class joins the ``Callback`` of the one already imported, so pipeopt never imports the other.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> PipeOpt:
        return super().__new__(_lightning.as_callback_class(cls))

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``ddp_spawn``, ``copy.deepcopy``) as the user's class and the Lightning namespace it joined."""
        namespace = type(self).__dict__.get("_lightning_namespace")
        if namespace is None:  # a subclass that names its Lightning Callback base itself pickles as usual
            return super().__reduce_ex__(protocol)
        return (_lightning.new_callback, (type(self).__mro__[1], namespace), self.__getstate__())

    def __getstate__(self) -> dict[str, Any]:
        """A console belongs to its process (it holds a lock): a spawned copy prints to a console of its own."""
        return {**self.__dict__, "_console": None}

    def __init__(
        self,
        *,
        tune: Collection[str] = TUNE_GROUPS,
        budget_s: float = 60.0,
        memory_fraction: float = 0.9,
        window: int = 20,
        window_s: float = 1.0,
        warmup: int = 5,
        report_dir: PathLike | None = "pipeopt_reports",
        cache: bool | PathLike = True,
        stop_when_tuned: bool = False,
        console: Console | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = PipeOptConfig(
            tune=tune,  # type: ignore[arg-type]  # validated and normalised by the config
            budget_s=budget_s,
            memory_fraction=memory_fraction,
            window=window,
            window_s=window_s,
            warmup=warmup,
            report_dir=report_dir,  # type: ignore[arg-type]  # a str or a path: the config makes it a Path
            cache=cache,  # type: ignore[arg-type]  # likewise
            stop_when_tuned=stop_when_tuned,
        )
        self._console = console
        self._clock = clock
        self.report: Report | None = None
        self.report_path: Path | None = None  # the JSON report
        self.html_path: Path | None = None  # the same report as an HTML page with charts
        self.cache_path: Path | None = None  # the tuning cache this fit used
        self.windows: list[WindowStats] = []
        self._restored: dict[str, Any] | None = None  # tuned state from a checkpoint, applied at train start
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._trainer: Any = None
        self._timer: StepTimer | None = None
        self._meter: WindowMeter | None = None
        self._sampler: NvmlSampler | None = None
        self._previous_profiler: Any = None
        self._step_at_batch_start = 0
        self._log_step = 0  # the logger step of the last batch trained (Lightning's numbering)
        self._skipped: list[Skipped] = []
        self._env: environment.Environment | None = None
        self._switcher: LoaderSwitcher | None = None
        self._session: LoaderSession | None = None
        self._cache: TunedCache | None = None
        self._cache_key: str | None = None
        self._done_at_window: int | None = None
        self._precision: PrecisionTuning | None = None
        self._batch: BatchTuning | None = None
        self._user_setup: tuple[list[Any], int, Any] | None = None  # restored if the fit fails

    # -- set-up and clean-up ------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self.windows = []
        self.report = self.report_path = self.html_path = self.cache_path = None
        self._trainer = trainer
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
                              ready=lambda: live_ready_batches(trainer), clock=self._clock)
        cfg = self.config
        self._meter = WindowMeter(
            window=cfg.window, warmup=cfg.warmup, clock=device_clock, probe=probe, on_window=self._on_window
        )
        self._timer = timer = StepTimer(self._clock, device_clock, self._meter.update)
        transfer = _lightning.transfer_action(trainer)
        tap = ProfilerTap(
            trainer.profiler,
            on_start={
                _lightning.FETCH_ACTION: timer.fetch_started,
                transfer: timer.transfer_started,
                _lightning.COMPUTE_ACTION: timer.compute_started,
            },
            on_stop={
                _lightning.FETCH_ACTION: timer.fetch_stopped,
                transfer: timer.transfer_stopped,
                _lightning.COMPUTE_ACTION: timer.compute_stopped,
            },
        )
        self._previous_profiler = _lightning.swap_profiler(trainer, tap)
        self._env = environment.collect(device, world_size=trainer.world_size, gpu_monitoring=gpu_status)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._release(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._user_setup is not None:  # the fit failed: the trainer gets back the set-up it was given
            _lightning.restore_train_setup(trainer, self._user_setup)
        self._release(trainer)

    def _release(self, trainer: Any) -> None:
        if self._switcher is not None:
            self._switcher.close()
        if self._previous_profiler is not None and isinstance(trainer.profiler, ProfilerTap):
            _lightning.swap_profiler(trainer, self._previous_profiler)
        if self._sampler is not None:
            self._sampler.stop()
        self._reset_run_state()
        self._restored = None  # a checkpoint's tuned state serves the fit that loaded it

    # -- loader tuning ------------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._meter is None:
            return
        self._user_setup = _lightning.train_setup(trainer)
        short = None if self._restored is not None else self._too_short(trainer)
        if "precision" in self.config.tune:
            self._precision = PrecisionTuning(agree=self._agree, say=self._say, reset_meter=self._meter.reset,
                                              window=self.config.window, min_window_s=self.config.window_s)
            reason = self._precision.start(trainer, pl_module, self._restored) or short
            if reason is not None:
                self._precision.leave_alone()
                self._skip("precision", reason, warn=reason is not short)
        if "batch" in self.config.tune:
            self._batch = BatchTuning(memory_fraction=self.config.memory_fraction, agree=self._agree, say=self._say,
                                      reset_meter=self._meter.reset, window=self.config.window,
                                      min_window_s=self.config.window_s)
            reason = self._batch.start(trainer, pl_module, self._restored) or short
            if reason is not None:
                self._batch.leave_alone()
                self._skip("batch", reason, warn=reason is not short)
        if self.config.tune & {"loader", "dali"}:
            self._start_loader_session(trainer, short)
        plan = self._batch
        if plan is not None and plan.choice is not None and (self._session is None or self._session.state == "done"):
            plan.begin(trainer, 0)  # the checkpoint's plan, from the first batch (the loader is settled)
        shorted = [s.group for s in self._skipped if s.reason is short]
        if shorted:  # one warning for the fit, not one a group
            rank_zero_warn(f"PipeOpt: not tuning the {', '.join(shorted)}: {short}.")

    def _too_short(self, trainer: Any) -> str | None:
        """Why the fit is too short for any tuning to pay back its cost (None when it is not, or unbounded): a
        group needs a window before, one trial and one after, each ``window`` steps, after the warm-up."""
        planned = _lightning.planned_steps(trainer)
        if planned is None:
            return None
        left, need = planned - trainer.global_step, self.config.warmup + 3 * self.config.window
        if left >= need:
            return None
        return (f"the fit has {left} optimizer steps left; a window before, one trial and one after need at least "
                f"{need} (warmup={self.config.warmup} + 3 x window={self.config.window}): too short for tuning to pay "
                "back its cost, so pipeopt only observes")

    def _start_loader_session(self, trainer: Any, short: str | None) -> None:
        groups = [g for g in ("loader", "dali") if g in self.config.tune]
        loaders = _lightning.train_combined_loader(trainer)
        flattened = list(loaders.flattened) if loaders is not None else []
        reason = (f"the fit has {len(flattened)} train loaders; pipeopt tunes a single one" if len(flattened) != 1
                  else unsupported(flattened[0]))
        if reason is not None:
            for group in groups:
                self._skip(group, reason)
            return
        cuda = trainer.strategy.root_device.type == "cuda"
        dali = None
        if "dali" in groups:
            reason = dali_blocker(flattened[0])
            if reason is None:
                dali = "mixed" if cuda else "cpu"
            else:
                self._skip("dali", reason)
        if short is not None:
            for group in [g for g in groups if g == "loader" or dali is not None]:
                self._skip(group, short, warn=False)
            return
        cpus = max(1, cpus_available() // max(1, trainer.num_devices))
        self._switcher = LoaderSwitcher(trainer, dali=DaliSource(cpus) if dali is not None else None)
        meter = self._meter
        if meter is None:  # set up in `setup`, which a fit always runs first
            return
        self._session = LoaderSession(
            self._switcher,
            budget=Budget(
                cpus=cpus,
                memory_bytes=int(0.5 * psutil.virtual_memory().available),
                cuda=cuda,
                more_epochs=_more_epochs_ahead(trainer),
                may_change_workers="loader" in groups,
                dali=dali,
            ),
            budget_s=self.config.budget_s,
            reset_meter=meter.reset,
            clock=self._clock,
            say=self._say if trainer.is_global_zero else (lambda line: None),
            worker_memory=worker_private_memory,
            agree=self._agree,
            window=self.config.window,
            min_window_s=self.config.window_s,
            epoch_steps=_epoch_steps(trainer),
        )
        restored = self._restored
        if restored is not None and "loader" in restored:
            loader = LoaderSettings(**restored["loader"]) if restored["loader"] else None
            if loader is None or loader.dali in (None, dali):
                self._session.restore(loader)
                return
            self._session.notes.append("the checkpoint's tuning kept DALI, which cannot be used here; tuned afresh")
        meter.label = "before"
        if self.config.cache is not False:
            path = default_path() if self.config.cache is True else Path(self.config.cache)
            self._cache = TunedCache(path)
            self.cache_path = path
            self._cache_key = fingerprint(fit_parts(trainer, trainer.lightning_module, flattened[0]))
            # Rank zero's entry for every rank: the same decision everywhere, whatever each node's cache holds.
            entry = trainer.strategy.broadcast(self._cache.get(self._cache_key) if trainer.is_global_zero else None)
            if entry is not None and "loader" in entry and "samples_per_s" in entry:
                cached = LoaderSettings(**entry["loader"]) if entry["loader"] else None
                if cached is None or cached.dali in (None, dali):  # DALI only where it may be tried now
                    self._session.verify_cached(cached, float(entry["samples_per_s"]))

    def _agree(self, values: list[float]) -> list[float]:
        """Element-wise maximum over all ranks (identity on one process)."""
        trainer = self._trainer
        if trainer is None or trainer.world_size <= 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
        return trainer.strategy.reduce(tensor, reduce_op="max").tolist()

    def _log(self, trainer: Any, metrics: dict[str, float]) -> None:
        """``pipeopt/...`` metrics to the Trainer's loggers, at the step of the last batch trained - nothing when
        there is nothing to log."""
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=self._log_step)

    def _skip(self, group: str, reason: str, *, warn: bool = True) -> None:
        self._skipped.append(Skipped(group, reason))
        if warn:
            rank_zero_warn(f"PipeOpt: not tuning the {group}: {reason}.")

    def _say(self, line: str) -> None:
        (self._console or Console()).print(f"[bold]pipeopt[/bold] {line}", highlight=False)

    # -- the loop -----------------------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is not None:
            self._timer.interrupted()
        if self._batch is not None:
            self._batch.epoch_started()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is not None:
            self._timer.interrupted()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is not None:
            self._timer.interrupted()
        if self._switcher is not None:
            self._switcher.end_of_epoch()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log_step = _lightning.logger_step(trainer)  # a window closing in this batch describes this step
        precision, plan = self._precision, self._batch
        if precision is not None:
            precision.on_batch_end(trainer, outputs)
        if plan is not None:
            plan.on_batch_end(outputs)
        if self._timer is not None:
            self._timer.batch_ended(batch_size(batch), trainer.global_step > self._step_at_batch_start)
        if self._session is not None:
            self._session.on_step_end()
        if trainer.global_step > self._step_at_batch_start:  # between optimizer steps: the groups' turns
            self._between_steps(trainer)
        if self.config.stop_when_tuned and self._tuning_finished():
            trainer.should_stop = True

    def _between_steps(self, trainer: Any) -> None:
        """The groups after the loader, one after the other: the batch plan, then precision."""
        precision, plan = self._precision, self._batch
        if plan is not None:
            plan.on_step_end(trainer)
        if precision is not None:
            precision.on_step_end(trainer)
        if self._session is not None and self._session.state != "done":
            return
        if plan is not None and plan.state == "waiting":
            reason = plan.begin(trainer, len(self.windows))
            if reason is not None:
                self._skip("batch", reason)
        if precision is not None and precision.state == "waiting" and (plan is None or plan.decided):
            precision.begin(len(self.windows))

    def _tuning_finished(self) -> bool:
        """Tuning is over and a window was measured after it (the session's own after-window counts)."""
        session = self._session
        if session is not None and session.state != "done":
            return False
        groups = [g for g in (self._batch, self._precision) if g is not None]
        if not all(g.decided for g in groups):
            return False
        after_from = self._after_from()
        if after_from is not None:
            return len(self.windows) > after_from  # a window measured after the last decision
        if session is not None and session.after is not None:
            return True
        if self._done_at_window is None:
            self._done_at_window = len(self.windows)
        return len(self.windows) > max(self._done_at_window, 1)

    def _after_from(self) -> int | None:
        """Windows measured before the last group's decision (precision decides after the batch plan)."""
        groups = [g for g in (self._precision, self._batch) if g is not None]
        return next((g.after_from for g in groups if g.after_from is not None), None)

    def _on_window(self, stats: WindowStats) -> None:
        self.windows.append(stats)
        if self._session is not None and self._session.state != "done":
            self._session.on_window(stats)
        elif self._batch is not None and self._batch.measuring:
            self._batch.on_window(stats)
        elif self._precision is not None and self._precision.measuring:
            self._precision.on_window(stats)
        trainer = self._trainer
        if trainer is not None and trainer.is_global_zero:
            self._log(trainer, window_metrics(stats))

    # -- the report ---------------------------------------------------------------------------------------
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self._meter is None or self._timer is None or self._env is None:
            return
        self._timer.interrupted()
        if self._session is not None:
            self._session.finish()
        if self._meter.pending_steps >= max(2, self.config.window // 2):
            self._meter.compute()  # a last, shorter window still tells the end of the run
        report = self._build_report()
        self.report = report
        if not trainer.is_global_zero:
            return
        self._remember(report)
        self._log(trainer, summary_metrics(report))
        print_report(report, self._console)
        if self.config.report_dir is not None:
            try:
                self.report_path = write_report(report, self.config.report_dir)
                self.html_path = write_html(report, self.report_path.with_suffix(".html"))
            except OSError as err:
                rank_zero_warn(f"PipeOpt could not write its report to {self.config.report_dir}: {err}. "
                               "Training results are unaffected; pass `report_dir=` a writable directory.")

    def _remember(self, report: Report) -> None:
        """Put the change tuning kept in the cache (rank zero; a failure to write only warns). Runs that kept the
        user's settings are not remembered: a rerun costs only a before-window, and a noisy revert must not
        stick."""
        session, cache, key = self._session, self._cache, self._cache_key
        if session is None or cache is None or key is None or session.state != "done" or session.from_cache:
            return
        kept, rate = session.kept, session.after_rate
        if kept is None or not rate:
            return  # only a change that its after-window confirmed is worth remembering
        entry = {"loader": kept.as_kwargs(), "samples_per_s": rate, "created": report.created}
        try:
            cache.put(key, entry)
        except OSError as err:
            rank_zero_warn(f"PipeOpt could not write the tuning cache {cache.path}: {err}. Training results are "
                           "unaffected; pass `cache=` a writable path or `cache=False`.")

    def _build_report(self) -> Report:
        windows = self.windows
        session = self._session
        notes = []
        if self._timer is not None and self._timer.dropped_partial:
            notes.append(f"{self._timer.dropped_partial} accumulation group(s) cut short by validation or an epoch "
                         "end were not measured")
        if windows and all(w.wait_s == 0.0 for w in windows):
            notes.append("no data fetch was timed: this Lightning version or a custom data fetcher hides the "
                         "train loader's `next()`; data wait shows 0")
        if session is None:
            before = windows[0] if windows else None
            after = windows[-1] if len(windows) > 1 else None
            extra: dict[str, Any] = {}
        else:
            before, after = session.before, session.after
            if before is None:  # applied from a checkpoint or the cache: no window of the user's settings exists
                before = windows[0] if windows else None
                after = windows[-1] if len(windows) > 1 else None
            elif after is None and session.state == "done" and windows and windows[-1] is not before:
                after = windows[-1]  # nothing changed: the run's last window, measured after tuning ended
            if session.state not in ("done",) and session.before is not None:
                notes.append(f"the fit ended before loader tuning finished (it was in its {session.state} phase); "
                             f"the run ended with {self._switcher.current.describe()}")  # type: ignore[union-attr]  # a session has one
            notes.extend(session.notes)
            extra = dict(
                changes=list(session.changes),
                trials=trial_rows(session.trials),
                suggestions=[s for s in [loader_suggestion(session.changes)] if s],
                predicted_speedup=session.predicted_speedup,
            )
        after_from = self._after_from()
        changed = any(g is not None and g.outcome().changes for g in (self._precision, self._batch))
        if changed and after_from is not None and len(windows) > after_from:
            after = windows[after_from]  # measured after every change, the batch plan's and precision's included
        for group in (self._precision, self._batch):
            if group is None:
                continue
            outcome = group.outcome()
            extra = dict(extra)
            first = group is self._precision  # precision reads first, the batch plan after the loader
            for key, items in (("changes", outcome.changes), ("suggestions", outcome.suggestions)):
                extra[key] = [*items, *extra.get(key, [])] if first else [*extra.get(key, []), *items]
            notes.extend(outcome.notes)
        return Report(
            mode="tune" if session is not None or self._precision is not None or self._batch is not None else "observe",
            environment=self._env,  # type: ignore[arg-type]  # on_fit_end returns early without one
            before=before,
            after=after,
            verdict=judge(before) if before else None,
            skipped=list(self._skipped),
            notes=notes,
            timeline=list(windows),
            steps_measured=self._meter.steps_seen if self._meter else 0,
            **extra,
        )

    # -- checkpoints ---------------------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        return "PipeOpt"

    def state_dict(self) -> dict[str, Any]:
        """What tuning kept, so a run resumed from this checkpoint applies it without trials."""
        session = self._session
        tuned: dict[str, Any] = {}
        if session is not None and session.state == "done":
            tuned["loader"] = session.kept.as_kwargs() if session.kept else None
        for group in (self._precision, self._batch):
            if group is not None:
                tuned.update(group.state_dict())
        return {"version": STATE_VERSION, "tuned": tuned or None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != STATE_VERSION:
            rank_zero_warn(f"PipeOpt: ignoring checkpoint state of version {state_dict.get('version')!r} "
                           f"(this release reads version {STATE_VERSION}); the run is tuned afresh.")
            return
        self._restored = state_dict.get("tuned")


def _more_epochs_ahead(trainer: Any) -> bool:
    """Whether the fit will cross at least one more epoch boundary (so worker start-up would recur)."""
    max_epochs = trainer.max_epochs
    if max_epochs not in (None, -1) and trainer.current_epoch + 1 >= max_epochs:
        return False
    max_steps = trainer.max_steps
    per_epoch = trainer.num_training_batches
    if max_steps in (None, -1) or per_epoch in (None, float("inf")):
        return True
    accumulate = max(1, trainer.accumulate_grad_batches)
    return max_steps - trainer.global_step > per_epoch / accumulate


def _epoch_steps(trainer: Any) -> int | None:
    """Optimizer steps per epoch, when the epoch has a length."""
    batches = trainer.num_training_batches
    if batches in (None, float("inf")) or batches <= 0:
        return None
    return -(-int(batches) // max(1, trainer.accumulate_grad_batches))

