"""DALI under PipeOpt: a torchvision ImageFolder whose decoding and augmentation keep the step waiting.

Writes a synthetic ImageFolder (smooth JPEGs, 10 classes) to a temporary directory, trains a small CNN on it with
the classic train chain (RandomResizedCrop, flip, ToTensor, Normalize) from ``num_workers=0``, and lets PipeOpt try
DataLoader workers and DALI on the live run; the report says what it kept. Needs torchvision and DALI:

    make test                      # builds .venv-vision (torchvision + DALI) once
    .venv-vision/bin/python examples/dali_imagefolder.py [--steps 400] [--images 512]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from pipeopt import PipeOpt


def write_images(root: Path, n: int, size: int = 320, classes: int = 10) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        small = rng.integers(0, 256, size=(size // 16, size // 16, 3), dtype=np.uint8)
        Image.fromarray(small).resize((size, size), Image.BILINEAR).save(folder / f"{i:05d}.jpg", quality=90)
    return root


class SmallCNN(pl.LightningModule):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.net(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--images", type=int, default=512)
    args = parser.parse_args()
    try:
        from torchvision import datasets
        from torchvision import transforms as T
    except ImportError as err:
        raise SystemExit(f"this example needs torchvision ({err}); run it with .venv-vision/bin/python") from err

    with tempfile.TemporaryDirectory() as tmp:
        chain = T.Compose([T.RandomResizedCrop(112), T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        dataset = datasets.ImageFolder(write_images(Path(tmp), args.images), transform=chain)
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(accelerator="auto", devices=1, max_steps=args.steps, logger=False,
                             enable_checkpointing=False, enable_model_summary=False,
                             callbacks=[PipeOpt(tune=("loader", "dali"), report_dir=None, cache=False)])
        trainer.fit(SmallCNN(), DataLoader(dataset, batch_size=32, shuffle=True, drop_last=True))


if __name__ == "__main__":
    main()
