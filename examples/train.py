"""A plain Lightning training script - no pipeopt in it - for ``pipeopt tune``:

    pipeopt tune examples/train.py -- --steps 600
    python examples/train.py --steps 600          # the same run without pipeopt

Synthetic regression data behind a slow "storage" (a few ms per sample) and a DataLoader left at its defaults.
"""

import argparse
import time

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowStorage(Dataset):
    def __init__(self, n: int, delay_s: float) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        x = torch.randn(32, generator=torch.Generator().manual_seed(i))
        return x, x.sum().unsqueeze(0)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--delay-ms", type=float, default=3.0)
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    loader = DataLoader(SlowStorage(args.samples, args.delay_ms / 1e3), batch_size=8, shuffle=True)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="auto", devices=1, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(Model(), loader)


if __name__ == "__main__":
    main()
