"""Tiny models, datasets and Trainer settings shared by the tests (real Lightning fits on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import Dataset


class SleepyDataset(Dataset):
    """Each sample costs ``delay_s`` of waiting (storage latency), and returns its own index as the target."""

    def __init__(self, n: int = 512, dim: int = 16, delay_s: float = 0.002) -> None:
        self.n, self.dim, self.delay_s = n, dim, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.dim, generator=g), torch.tensor(i)


class Regressor(pl.LightningModule):
    """An MLP on (x, index) batches; ``hidden`` sets how much compute a step costs."""

    def __init__(self, dim: int = 16, hidden: int = 32, depth: int = 1, dropout: float = 0.0, batchnorm: bool = False):
        super().__init__()
        layers: list[nn.Module] = []
        width = dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden)]
            if batchnorm:
                layers += [nn.BatchNorm1d(hidden)]
            layers += [nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers += [nn.Linear(width, 1)]
        self.net = nn.Sequential(*layers)
        self.seen: list[int] = []
        self.calls = 0  # training_step calls

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, idx = batch
        self.calls += 1
        self.seen.extend(idx.tolist())
        return (self.net(x).squeeze(-1) - idx.float() / 512).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def quiet_pipeopt(**kwargs: Any):
    """A PipeOpt for tests: short windows, no files, console output kept out of the way; loader tuning unless
    ``tune`` says otherwise."""
    import io

    from rich.console import Console

    from pipeopt import PipeOpt

    kwargs.setdefault("tune", ("loader",))
    kwargs.setdefault("window", 4)
    kwargs.setdefault("window_s", 0.0)
    kwargs.setdefault("warmup", 2)
    kwargs.setdefault("report_dir", None)
    kwargs.setdefault("console", Console(file=io.StringIO(), width=120))
    return PipeOpt(**kwargs)


def controlled_rates(monkeypatch: Any, rate_of: Any) -> None:
    """Put the loader search of a real fit in a controlled world: every window it judges measures
    ``rate_of(in_place)`` samples/s (1 % noise) for what was tried in it (the loader settings, or a precision such
    as ``"bf16-mixed"``), however busy the machine is. The fit, its data and its order stay real; only the figures
    the decisions are made on are fixed, so a test can assert which setting is kept (the seam:
    ``pipeopt.tuning.noise.window_rate``)."""
    from pipeopt.tuning import noise

    monkeypatch.setattr(noise, "window_rate", lambda stats, in_place: noise.Rate(float(rate_of(in_place)), 0.01))


def controlled_wait(monkeypatch: Any, wait_frac: float) -> None:
    """Fix the data-wait fraction every window the searches judge reads (the seams:
    ``pipeopt.tuning.noise.window_wait``, and ``window_supply_wait`` beside it: all of that wait with no batch
    ready), so that whether a real fit counts as compute-bound, and what the loader model is fitted to, do not
    depend on how busy the machine is; the fit and its report's windows stay as measured."""
    from pipeopt.tuning import noise

    monkeypatch.setattr(noise, "window_wait", lambda stats, in_place: wait_frac)
    monkeypatch.setattr(noise, "window_supply_wait", lambda stats, in_place: wait_frac)


def controlled_cpu_room(monkeypatch: Any, room: float) -> None:
    """Fix the CPUs a cached trial finds idle for workers to load beside the step (the seam:
    ``pipeopt.tuning.cache_session.cpu_room``), so that whether the workers are tried after the main process alone
    does not depend on how busy the machine is; the fit and its report's windows stay as measured."""
    from pipeopt.tuning import cache_session

    monkeypatch.setattr(cache_session, "cpu_room", lambda figures, cpus: room)


def synchronous_backfill(monkeypatch: Any) -> None:
    """Run the sample cache's backfill (``pipeopt.apply.backfill``) to its end where it starts, in worker processes as
    always: when the cache is tried then no longer depends on how long those workers take, so two fits meant to
    switch loaders at the same steps do (with random augmentation in workers, the step of a switch decides which
    worker draws for which sample). The fit, its data and what is stored stay real."""
    import time

    from pipeopt.apply.backfill import Backfill

    def start(self: Any) -> None:
        self.started_at = time.perf_counter()
        self._run(iter(self._loader))

    monkeypatch.setattr(Backfill, "start", start)


def quiet_trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    kwargs.update(overrides)
    return kwargs


def resident_dataset(n: int = 1024, dim: int = 256) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, dim, generator=g), torch.arange(n))


def make_window(**overrides: Any):
    """A WindowStats with consistent figures: 10 steps of 100 ms, 40 % of it waiting for data."""
    from pipeopt.measure.resources import ResourceFigures
    from pipeopt.measure.window import WindowStats

    fields: dict[str, Any] = dict(
        index=0, label="observe", first_step=5, steps=10, samples=320, duration_s=1.0, step_time_s=0.1,
        step_time_std_s=0.01, rate_rel_se=0.02, wait_s=0.04, transfer_s=0.0, compute_s=0.05, samples_per_s=320.0,
        steps_per_s=10.0, data_wait_frac=0.4, transfer_frac=0.0, busy_frac=0.5,
        resources=ResourceFigures(cpu_main_pct=98.0, cpu_workers_pct=0.0, workers=0,
                                  gpu_status="n/a (no NVIDIA driver)"),
    )
    fields.update(overrides)
    return WindowStats(**fields)


class TightMemory:
    """A device memory for ``pipeopt.apply.batch.MEMORY`` on CPU: ``budget`` bytes to spend, and a window of
    training steps under a plan peaking at ``per_sample`` bytes per sample of its micro-batch (nothing kept
    between steps)."""

    def __init__(self, per_sample: int = 100, budget: int = 1000) -> None:
        self.per_sample, self._budget = per_sample, budget

    def budget(self, device: Any, fraction: float) -> int:
        return self._budget

    def window_peak(self, stats: Any, plan: Any) -> int:
        return self.per_sample * plan.micro

    def between_steps(self, device: Any) -> int:
        return 0


class SamplesPerStep(pl.Callback):
    """Counts the samples that reach each optimizer step."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._count = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._count += len(batch[0])

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.per_step.append(self._count)
        self._count = 0


class StateAtTrainEnd(pl.Callback):
    """What a checkpoint written at the end of training would hold of a PipeOpt's state."""

    def __init__(self, pipeopt: Any) -> None:
        self.pipeopt, self.state = pipeopt, None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.state = self.pipeopt.state_dict()


def end_process_group() -> None:
    """End a DDP script's default process group before the interpreter exits.

    Lightning's DDP teardown leaves the group alive. Exiting with it alive lets gloo's worker threads still hold
    work objects while the interpreter finalises; destroying those then aborts the process with "terminate called
    without an active exception" and a non-zero status, at random (torch 2.13, gloo; pytorch/pytorch#190489). Not
    pipeopt's: it happened in the plain fits, with no PipeOpt attached. Destroying the group while the interpreter is
    fully alive is the documented order."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_ddp(script: Path, out: Path, mode: str, *args: str) -> list[dict]:
    """Run a 2-rank DDP fit script as its own process (Lightning's ``ddp`` relaunches the command line for rank 1,
    which under pytest would relaunch the test session); each rank writes ``OUT/<mode>-rank<r>.json``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE",
                                                                    "MASTER_", "PL_"))}
    proc = subprocess.run([sys.executable, str(script), str(out), mode, *args], capture_output=True, text=True,
                          timeout=300, env=env)
    if proc.returncode != 0:  # not `assert`: pytest rewrites asserts in test modules only, and -O strips them here
        raise AssertionError(f"{script.name} {mode} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]
