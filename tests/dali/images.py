"""Small image folders for the DALI tests, written with PIL (a torchvision dependency), and a classifier that
records which images it trained on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed: `make test` runs these tests "
                                  "in .venv-vision (torch 2.14.1 + torchvision 0.29.1 + DALI)")
pytest.importorskip("torchvision.transforms.v2")  # a submodule: imported for the tests that use v2
from PIL import Image  # noqa: E402

CLASSES = ("ants", "bees", "cats")
#: Images per class in ``solid_folder`` by default.
PER_CLASS = 8
STEP = 10  # colour levels per index step: decoded within +-2 of it
BASE = 24  # red counts the index modulo BASE, green the multiples of BASE


def smooth_folder(root: Path, per_class: int = 6, seed: int = 0) -> Path:
    """JPEGs of smooth gradients and waves (as photographs are, locally), of varied sizes and aspect ratios."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(90, 220, size=2))
            y, x = np.mgrid[0:h, 0:w]
            pixels = np.stack([128 + 100 * np.sin(x / 17 + c), 128 + 100 * np.cos(y / 23 + i), (x + y) * 255 / (h + w)],
                              axis=-1)
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(root / name / f"{i}.jpg", quality=92)
    return root


def solid_folder(root: Path, per_class: int = PER_CLASS, scale: int = 1) -> Path:
    """``per_class`` JPEGs per class (sized 40x30 up, times ``scale``), each a single colour that encodes its
    ImageFolder index (see ``indices_of``)."""
    index = 0
    for name in CLASSES:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            size = (scale * (40 + 3 * (i % 8)), scale * (30 + 5 * (i % 8)))
            colour = (STEP * (index % BASE), STEP * (index // BASE), 128)
            Image.new("RGB", size, colour).save(root / name / f"{i:03d}.jpg", quality=95)
            index += 1
    return root


def indices_of(images) -> list[int]:
    """The dataset indices of a batch of ``solid_folder`` images (float in [0, 1] or uint8, CHW)."""
    levels = images[:, :2].float().mean(dim=(2, 3))
    if images.dtype.is_floating_point:
        levels = levels * 255
    return [round(r / STEP) + BASE * round(g / STEP) for r, g in levels.tolist()]


class Classifier(pl.LightningModule):
    """Records the dataset index of every image it trains on (``solid_folder`` colours name them)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 3))
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        if labels.dtype != torch.int64:  # what a DataLoader over an ImageFolder yields; DALI's must match
            raise TypeError(f"labels arrived as {labels.dtype}, not torch.int64")
        self.seen.extend(indices_of(images))
        return nn.functional.cross_entropy(self.net(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
