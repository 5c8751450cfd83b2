"""A 2-rank CPU DDP fit (gloo), run as its own process: Lightning's `ddp` strategy relaunches this script for
rank 1, which under pytest would relaunch the test session.

    python tests/scripts/ddp_fit.py OUT_DIR {pipeopt|batch|cache|plain}

Each rank writes OUT_DIR/<mode>-rank<r>.json: the samples it saw, its final loader settings and its trials.
``pipeopt`` tunes the loader in a controlled world where any worker count measures 3x the main process
(``pipeopt.tuning.noise.window_rate``) and every window waits half its step for data (``window_wait``: the loader
model's picks, and so the steps their trials take, do not depend on the machine's pace), so a change must be kept -
the same one on both ranks. ``batch`` tunes
micro-batch x accumulation (and the loader) against an injected device memory of 1000 bytes, where a step peaks
at 200 bytes per sample of its micro-batch: the user's 8 do not fit, 4 x 2 does. ``cache`` tunes the sample cache
in a world where reading from the store measures 3x, so each rank's store is filled with its shard and kept.
"""

import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl  # noqa: E402
from rich.console import Console  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import pipeopt.apply.batch as batch_apply  # noqa: E402
from pipeopt import PipeOpt  # noqa: E402
from pipeopt.tuning import noise  # noqa: E402
from pipeopt.tuning.noise import Rate  # noqa: E402
from tests.helpers import (  # noqa: E402
    Regressor,
    SamplesPerStep,
    SleepyDataset,
    TightMemory,
    end_process_group,
    quiet_trainer_kwargs,
)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    pl.seed_everything(1, verbose=False)
    callbacks: list = []
    if mode == "pipeopt":
        noise.window_rate = lambda stats, settings: Rate(300.0 if settings.num_workers else 100.0, 0.01)
        noise.window_wait = noise.window_supply_wait = lambda stats, settings: 0.5
    if mode == "cache":
        noise.window_rate = lambda stats, settings: Rate(300.0 if settings.cache else 100.0, 0.01)
    if mode in ("pipeopt", "batch", "cache"):
        tune = {"pipeopt": ("loader",), "batch": ("batch", "loader"), "cache": ("cache",)}[mode]
        if mode == "batch":
            batch_apply.MEMORY = TightMemory(per_sample=200)
        callbacks.append(PipeOpt(tune=tune, window=4, window_s=0, warmup=2, budget_s=3, report_dir=out / "reports",
                                 console=Console(file=io.StringIO())))
    counter = SamplesPerStep()
    callbacks.append(counter)
    model = Regressor()
    # 4 epochs of 48 steps a rank: room for the whole search and its after-windows (a quiet machine fits more
    # trials into the 3 s budget; a 2-epoch fit could end mid-search and keep nothing)
    trainer = pl.Trainer(max_epochs=4, strategy="ddp", callbacks=callbacks,
                         **quiet_trainer_kwargs(devices=2))
    trainer.fit(model, DataLoader(SleepyDataset(n=768, delay_s=0.003), batch_size=8, shuffle=True))
    loader = trainer.train_dataloader
    result = {
        "seen": model.seen,
        "num_workers": loader.num_workers,
        "persistent_workers": loader.persistent_workers,
        "trials": [t.settings for t in callbacks[0].report.trials] if mode != "plain" else [],
        "changes": [[c.knob, c.after] for c in callbacks[0].report.changes] if mode != "plain" else [],
        "notes": callbacks[0].report.notes if mode != "plain" else [],
        "skipped": [[s.group, s.reason] for s in callbacks[0].report.skipped] if mode != "plain" else [],
        "windows": [w.label for w in callbacks[0].windows] if mode != "plain" else [],
        "accumulate": trainer.accumulate_grad_batches,
        "samples_per_step": counter.per_step,
    }
    figures = callbacks[0].report.sample_cache if mode != "plain" else None
    if figures is not None:
        result["cache"] = {"stored": figures.stored, "directory": figures.directory, "kept": figures.kept,
                           "last_hit_rate": figures.epochs[-1]["hit_rate"]}
    (out / f"{mode}-rank{trainer.global_rank}.json").write_text(json.dumps(result))
    end_process_group()


if __name__ == "__main__":
    main()
