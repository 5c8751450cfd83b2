"""pipeopt demo: an input-bound training run on synthetic data, under PipeOpt.

The dataset mimics slow storage: every sample takes a few milliseconds to arrive (as from a network file
system or object store), and the DataLoader is left at its defaults (``num_workers=0``), so the model waits.
PipeOpt measures the run, says where the time goes, tries loader settings on the live run (every trial step is
a real training step, in the same data order), keeps the fastest and prints the before/after report.

    python examples/demo.py [--steps 1200] [--delay-ms 4]
"""

from __future__ import annotations

import argparse
import math
import time

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from pipeopt import PipeOpt


class SlowStorage(Dataset):
    """Deterministic (x, y) pairs; each read waits ``delay_s`` as if fetched from remote storage."""

    def __init__(self, n: int = 4096, dim: int = 64, delay_s: float = 0.004) -> None:
        self.n, self.dim, self.delay_s = n, dim, delay_s
        self.w = torch.randn(dim, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        x = torch.randn(self.dim, generator=torch.Generator().manual_seed(i))
        return x, (x @ self.w).unsqueeze(0)


class Regressor(pl.LightningModule):
    def __init__(self, dim: int = 64, hidden: int = 2048) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1200, help="optimizer steps to train (default 1200)")
    parser.add_argument("--delay-ms", type=float, default=4.0, help="storage latency per sample (default 4 ms)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--cost-per-hour", type=float, default=None,
                        help="price of an hour of this machine (any currency): the report adds the cost of an epoch "
                             "and of the fit before and after tuning")
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    loader = DataLoader(SlowStorage(delay_s=args.delay_ms / 1e3), batch_size=args.batch_size, shuffle=True)
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=args.steps,
        max_epochs=math.ceil(args.steps / len(loader)),  # the epoch max_steps ends in (the progress bar shows it)
        callbacks=[PipeOpt(window=20, warmup=5, cost_per_hour=args.cost_per_hour)],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), loader)


if __name__ == "__main__":
    main()
