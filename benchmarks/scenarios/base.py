from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
from torch.utils.data import DataLoader, Dataset


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    make_dataset: Callable[[], Dataset]
    make_model: Callable[[], pl.LightningModule]
    batch_size: int
    steps: int  # optimizer steps per oracle-grid run
    warmup: int  # steps ignored at the start of each run
    tuned_steps: int  # steps of a run under PipeOpt (tuning must finish well inside them)
    naive: dict[str, Any] = field(default_factory=lambda: {"num_workers": 0})
    grid: tuple[dict[str, Any], ...] = ()

    def loader(self, dataset: Dataset, **settings: Any) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, drop_last=True, **settings)


def label(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())
