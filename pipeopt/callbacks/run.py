"""One fit's tuning, behind the callback: the groups in their order - the loader search, then the micro-batch plan,
then precision, then the sample cache (once its store is warm) - which window goes to which, when tuning is over,
and what the run kept (for the report, the cache and checkpoints). Lightning reaches it only through ``PipeOpt``'s
hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeopt import _lightning
from pipeopt._lightning import rank_zero_warn
from pipeopt.apply.loader import LoaderSwitcher
from pipeopt.cache import TunedCache
from pipeopt.callbacks.cache_start import CacheLedger, start_cache_session
from pipeopt.callbacks.instruments import Instruments
from pipeopt.callbacks.loader_start import more_epochs_ahead, start_loader_session
from pipeopt.callbacks.start_tuning import BatchTuning, PrecisionTuning
from pipeopt.config import PipeOptConfig
from pipeopt.measure.window import WindowStats
from pipeopt.report.assemble import assemble
from pipeopt.report.fit import fit_and_cost, time_and_cost
from pipeopt.report.model import Report, Skipped
from pipeopt.tuning.agreement import ReduceMax
from pipeopt.tuning.cache_session import CacheSession
from pipeopt.tuning.noise import Rate
from pipeopt.tuning.session import LoaderSession


class TuningRun:
    """Started at train start with what the fit may tune; fed each trained batch and each measured window."""

    def __init__(self, config: PipeOptConfig, instruments: Instruments, *, clock: Callable[[], float],
                 say: Callable[[str], None], agree: ReduceMax) -> None:
        self._config, self._clock, self._say, self._agree = config, clock, say, agree
        self._instruments, self._meter = instruments, instruments.meter
        self.skipped: list[Skipped] = []
        self.session: LoaderSession | None = None
        self.switcher: LoaderSwitcher | None = None
        self.cache: TunedCache | None = None
        self.cache_key: str | None = None
        self.precision: PrecisionTuning | None = None
        self.batch: BatchTuning | None = None
        self.sample_cache: CacheSession | None = None
        self._ledger = CacheLedger()  # the sample cache's hit rate, an epoch at a time
        self._user_setup: tuple[list[Any], int, Any] | None = None  # restored if the fit fails
        self._epoch_steps: tuple[int | None, int | None] = (None, None)  # per epoch and for the fit, at its start
        self._done_at_window: int | None = None

    # -- the start --------------------------------------------------------------------------------------------
    def start(self, trainer: Any, module: Any, restored: dict[str, Any] | None) -> None:
        """Start every group the fit may tune; a checkpoint's tuned state is applied without trials."""
        cfg, meter = self._config, self._meter
        self._user_setup = _lightning.train_setup(trainer)
        self._epoch_steps = (_lightning.steps_per_epoch(trainer), _lightning.planned_steps(trainer))
        short = None if restored is not None else self._too_short(trainer)
        kwargs = dict(agree=self._agree, say=self._say, reset_meter=meter.reset, window=cfg.window,
                      min_window_s=cfg.window_s)
        if "precision" in cfg.tune:
            self.precision = PrecisionTuning(**kwargs)  # type: ignore[arg-type]  # the shared keyword arguments
            self._start_group("precision", self.precision, trainer, module, restored, short)
        if "batch" in cfg.tune:
            self.batch = BatchTuning(memory_fraction=cfg.memory_fraction, **kwargs)  # type: ignore[arg-type]  # same
            self._instruments.probe.resets_peak = self.batch.peak_window_begins  # the only windows that reset it
            self._start_group("batch", self.batch, trainer, module, restored, short)
        if cfg.tune & {"loader", "dali"}:
            start = start_loader_session(trainer, cfg, meter, clock=self._clock, say=self._say, agree=self._agree,
                                         restored=restored, skip=self.skip, short=short)
            if start is not None:
                self.session, self.switcher, self.cache, self.cache_key = (start.session, start.switcher,
                                                                            start.cache, start.cache_key)
        if "cache" in cfg.tune:
            started = start_cache_session(trainer, cfg, meter, self.switcher, say=self._say, agree=self._agree,
                                          restored=restored, more_epochs=more_epochs_ahead(trainer), short=short)
            if isinstance(started, str):  # in the report; no warning: the cache is a bonus a dataset may not allow
                self.skip("cache", started, warn=False)
            else:
                self.sample_cache, self.switcher = started.session, started.switcher
                if self.session is not None:  # the loader search asks the store (``CacheStart``)
                    self.session.store_warm, self.session.store_read_in = started.holds_epoch, started.read_in
        plan = self.batch
        if plan is not None and plan.choice is not None and self._loader_settled:
            plan.begin(trainer, 0)  # the checkpoint's plan, from the first batch (the loader is settled)
        shorted = [s.group for s in self.skipped if s.reason is short]
        if shorted:  # one warning for the fit, not one a group
            rank_zero_warn(f"PipeOpt: not tuning the {', '.join(shorted)}: {short}.")

    def _start_group(self, name: str, group: PrecisionTuning | BatchTuning, trainer: Any, module: Any,
                     restored: dict[str, Any] | None, short: str | None) -> None:
        reason = group.start(trainer, module, restored) or short
        if reason is not None:
            group.leave_alone()
            self.skip(name, reason, warn=reason is not short)

    def _too_short(self, trainer: Any) -> str | None:
        """Why the fit is too short for any tuning to pay back its cost (None when it is not, or unbounded): a
        group needs a window before, one trial and one after, each ``window`` steps, after the warm-up."""
        planned = _lightning.planned_steps(trainer)
        if planned is None:
            return None
        cfg = self._config
        left, need = planned - trainer.global_step, cfg.warmup + 3 * cfg.window
        if left >= need:
            return None
        return (f"the fit has {left} optimizer steps left; a window before, one trial and one after need at least "
                f"{need} (warmup={cfg.warmup} + 3 x window={cfg.window}): too short for tuning to pay back its "
                "cost, so pipeopt only observes")

    def skip(self, group: str, reason: str, *, warn: bool = True) -> None:
        self.skipped.append(Skipped(group, reason))
        if warn:
            rank_zero_warn(f"PipeOpt: not tuning the {group}: {reason}.")

    # -- the loop ---------------------------------------------------------------------------------------------
    @property
    def _loader_settled(self) -> bool:
        return self.session is None or self.session.state == "done"

    def epoch_started(self) -> None:
        self._ledger.epoch_started(self.switcher is not None and self.switcher.current.cache)
        if self.batch is not None:
            self.batch.epoch_started()
        if self.sample_cache is not None:
            self.sample_cache.epoch_started()

    def epoch_ended(self, epoch: int) -> None:
        if self.switcher is not None:
            self._ledger.epoch_ended(epoch, self.switcher.cache, self.switcher.current.cache)
            if self.sample_cache is not None:  # (a switch now: the next epoch's loader, from its first batch)
                self.sample_cache.epoch_ended()
            self.switcher.end_of_epoch()

    def batch_ended(self, trainer: Any, outputs: Any) -> None:
        """A trained batch, before the timer counts it."""
        self._ledger.trained(self._instruments.batch_samples or 0,
                             self.switcher is not None and self.switcher.current.cache)
        if self.precision is not None:
            self.precision.on_batch_end(trainer, outputs)
        if self.batch is not None:
            self.batch.on_batch_end(outputs)

    def step_ended(self, trainer: Any, stepped: bool, windows: int) -> None:
        """After the timer counted the batch; ``stepped``: an optimizer step ended with it."""
        cache = self.sample_cache
        if cache is not None and cache.measuring:  # first: a failure of its trial's loader is its to judge
            cache.on_step_end()
        if self.session is not None:
            self.session.on_step_end()
        if not stepped:
            return
        precision, plan = self.precision, self.batch  # between optimizer steps: the groups' turns, in order
        if plan is not None:
            plan.on_step_end(trainer)
        if precision is not None:
            precision.on_step_end(trainer)
        if not self._loader_settled:
            return
        # the sample cache goes last: once the batch plan and precision are decided
        if cache is not None and not cache.started and all(g.decided for g in (plan, precision) if g is not None):
            search = self.session.search if self.session is not None else None
            filler = search.best_dataloader(filling=True).settings if search is not None else None
            cache.begin(search.baseline.data_wait_frac if search is not None else None, filler, self._loader_windows())
        if plan is not None and plan.state == "waiting":
            reason = plan.begin(trainer, windows)
            if reason is not None:
                self.skip("batch", reason)
        if precision is not None and precision.state == "waiting" and (plan is None or plan.decided):
            precision.begin(windows)

    def _loader_windows(self) -> list[tuple[Rate, float, float]]:
        """The loader search's windows of the settings in place (rate, s, wait) - none once the batch plan or precision
        changed the step: they measured another one."""
        session, switcher, groups = self.session, self.switcher, (self.batch, self.precision)
        if session is None or switcher is None or any(g.outcome().changes for g in groups if g is not None):
            return []
        return [(rate, s, wait) for applied, rate, s, wait in session.measured if applied == switcher.current]

    def on_window(self, stats: WindowStats) -> None:
        """A window closed: it belongs to the group measuring now."""
        if self.session is not None and self.session.state != "done":
            self.session.on_window(stats)
        elif self.sample_cache is not None and self.sample_cache.measuring:
            self.sample_cache.on_window(stats)
        elif self.batch is not None and self.batch.measuring:
            self.batch.on_window(stats)
        elif self.precision is not None and self.precision.measuring:
            self.precision.on_window(stats)

    def finished(self, windows: int) -> bool:
        """Tuning is over and a window was measured after it (the session's own after-window counts)."""
        if not self._loader_settled:
            return False
        if not all(g.decided for g in (self.batch, self.precision) if g is not None):
            return False
        cache = self.sample_cache
        if cache is not None and cache.state != "done":
            return False
        if cache is not None and cache.after is not None:
            return True
        after_from = self.after_from
        if after_from is not None:
            return windows > after_from  # a window measured after the last decision
        if self.session is not None and self.session.after is not None:
            return True
        if self._done_at_window is None:
            self._done_at_window = windows
        return windows > max(self._done_at_window, 1)

    @property
    def after_from(self) -> int | None:
        """Windows measured before the last group's decision (precision decides after the batch plan)."""
        return next((g.after_from for g in (self.precision, self.batch) if g is not None and g.after_from is not None),
                    None)

    # -- the end ----------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """The fit ends: a loader trial still open is closed."""
        if self.session is not None:
            self.session.finish()

    def report(self, trainer: Any, windows: list[WindowStats], instruments: Instruments) -> Report:
        current = self.switcher.current.describe() if self.switcher is not None else None
        cache = self.sample_cache
        refused = [Skipped("cache", cache.refused)] if cache is not None and cache.refused else []
        report = assemble(windows=windows, environment=instruments.environment, skipped=self.skipped + refused,
                          steps_measured=instruments.meter.steps_seen,
                          dropped_partial=instruments.timer.dropped_partial, session=self.session,
                          current_loader=current, precision=self.precision.outcome() if self.precision else None,
                          batch=self.batch.outcome() if self.batch else None, after_from=self.after_from,
                          cache=cache.report() if cache is not None else None,
                          cache_after=cache.after if cache is not None else None)
        report.sample_cache = self._ledger.figures(self.switcher.cache if self.switcher else None, cache)
        steps_per_epoch, planned = self._epoch_steps
        time = time_and_cost(report.before, report.after, steps_per_epoch=steps_per_epoch, planned_steps=planned,
                             epochs_measured_s=instruments.epochs_s, cost_per_hour=self._config.cost_per_hour)
        report.fit = fit_and_cost(
            windows=windows, after=report.after, memory=instruments.memory.breakdown(),
            memory_note=instruments.memory.unavailable, accumulate=_lightning.accumulation(trainer),
            device_memory_bytes=instruments.device_memory, memory_fraction=self._config.memory_fraction,
            shrunk=any(c.knob == "batch_size" and c.after < c.before for c in report.changes), time=time)
        return report

    def remember(self, report: Report) -> None:
        """Put the change tuning kept in the cache (a failure to write only warns). Runs that kept the user's
        settings are not remembered: a rerun costs only a before-window, and a noisy revert must not stick."""
        session, cache, key = self.session, self.cache, self.cache_key
        if session is None or cache is None or key is None or session.state != "done" or session.from_cache:
            return
        kept, rate = session.kept, session.after_rate
        if kept is None or not rate:
            return  # only a change that its after-window confirmed is worth remembering
        try:
            cache.put(key, {"loader": kept.as_kwargs(), "samples_per_s": rate, "created": report.created})
        except OSError as err:
            rank_zero_warn(f"PipeOpt could not write the tuning cache {cache.path}: {err}. Training results are "
                           "unaffected; pass `cache=` a writable path or `cache=False`.")

    def tuned(self) -> dict[str, Any]:
        """What tuning kept, for a checkpoint."""
        tuned: dict[str, Any] = {}
        if self.session is not None and self.session.state == "done":
            tuned["loader"] = self.session.kept.as_kwargs() if self.session.kept else None
        for group in (self.precision, self.batch):
            if group is not None:
                tuned.update(group.state_dict())
        if (cache := self.sample_cache) is not None and cache.state == "done":
            tuned["cache"] = cache.kept.as_kwargs() if cache.kept else None
        return tuned

    def close(self, trainer: Any, *, failed: bool) -> None:
        """The fit is over: stop pipeopt's workers; after a failure, the trainer gets back its own set-up."""
        if failed and self._user_setup is not None:
            _lightning.restore_train_setup(trainer, self._user_setup)
        if self.switcher is not None:
            self.switcher.close()
            if self.switcher.cache is not None:  # after the workers that read it stopped
                self.switcher.cache.close()
