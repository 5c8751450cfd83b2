"""Run one scenario fit with given loader settings and measure its steady throughput."""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
from rich.console import Console

from benchmarks.scenarios import Scenario
from pipeopt import PipeOpt


class Stopwatch(pl.Callback):
    """Timestamps at every batch end; nothing else (the oracle runs must not pay for pipeopt's measuring)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter())

    def steady_rate(self, warmup: int) -> float:
        ts = self.times[warmup:]
        return (len(ts) - 1) / (ts[-1] - ts[0])


def quiet_pipeopt(**kwargs: Any) -> PipeOpt:
    """A PipeOpt that prints and writes nothing, and tunes from scratch every run (no cache)."""
    kwargs.setdefault("report_dir", None)
    kwargs.setdefault("cache", False)
    return PipeOpt(console=Console(file=io.StringIO()), **kwargs)


def run_fit(
    scenario: Scenario,
    dataset: Any,
    settings: dict[str, Any],
    callbacks: Sequence[pl.Callback] = (),
    steps: int | None = None,
    steady_from: float | None = None,
    loader: Any = None,
    batch_ends: list[float] | None = None,
) -> dict[str, float]:
    """Fit ``scenario`` with loader ``settings`` (or a ready ``loader``); steady throughput is measured from step
    ``warmup`` (or from the fraction ``steady_from`` of the run, to measure only after a tuner has finished).
    ``batch_ends``, when given, receives each batch's end in seconds from the fit's start."""
    pl.seed_everything(0, verbose=False)
    watch = Stopwatch()
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps or scenario.steps,
        callbacks=[watch, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(scenario.make_model(), loader if loader is not None else scenario.loader(dataset, **settings))
    wall = time.perf_counter() - start
    if batch_ends is not None:
        batch_ends.extend(t - start for t in watch.times)
    total = steps or scenario.steps
    rate = watch.steady_rate(int(steady_from * total) if steady_from is not None else scenario.warmup)
    return {"steps_per_s": rate, "samples_per_s": rate * scenario.batch_size, "wall_s": wall}


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float]) -> float:
    """Relative spread of repeated measurements: (max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0
