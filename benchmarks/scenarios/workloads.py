from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from benchmarks.scenarios.base import Scenario

CACHE = Path(__file__).resolve().parents[1] / ".cache"


class Classifier(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def mlp(dim: int, hidden: int, depth: int, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    width = dim
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, classes))


def small_cnn(classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=4, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
    )


# -- storage latency -------------------------------------------------------------------------------------
class SlowStorage(Dataset):
    """A read waits ``delay_s`` (a network file system, an object store): no CPU, only latency."""

    def __init__(self, n: int = 8192, dim: int = 64, delay_s: float = 0.010) -> None:
        self.n, self.dim, self.delay_s = n, dim, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return torch.randn(self.dim, generator=torch.Generator().manual_seed(i)), i % 10


# -- CPU decode / augment --------------------------------------------------------------------------------
def jpeg_folder(n: int = 512, size: int = 384) -> Path:
    """JPEGs written with Pillow on first use (smooth random images, quality 90)."""
    from PIL import Image

    folder = CACHE / f"jpeg-{n}-{size}"
    done = folder / ".complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        small = rng.integers(0, 256, size=(size // 8, size // 8, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((size, size), Image.BILINEAR)
        img.save(folder / f"{i:05d}.jpg", quality=90)
    done.write_text("ok")
    return folder


class JpegDecode(Dataset):
    """Decode, random-resized-crop to 112, flip, normalise: the classic image pipeline, in Pillow + numpy."""

    def __init__(self, folder: Path, out: int = 112) -> None:
        self.files = sorted(folder.glob("*.jpg"))
        self.out = out
        self.mean = np.array([0.485, 0.456, 0.406], dtype=np.float32)
        self.std = np.array([0.229, 0.224, 0.225], dtype=np.float32)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        from PIL import Image

        rng = np.random.default_rng()
        with Image.open(self.files[i]) as img:
            img = img.convert("RGB")
            w, h = img.size
            s = int(min(w, h) * rng.uniform(0.5, 1.0))
            x0, y0 = rng.integers(0, w - s + 1), rng.integers(0, h - s + 1)
            img = img.resize((self.out, self.out), Image.BILINEAR, box=(x0, y0, x0 + s, y0 + s))
            if rng.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
            arr = (np.asarray(img, dtype=np.float32) / 255.0 - self.mean) / self.std
        return torch.from_numpy(arr.transpose(2, 0, 1).copy()), i % 10


# -- balanced --------------------------------------------------------------------------------------------
class CpuFeatures(Dataset):
    """Per-sample CPU work (an FFT feature transform) of a few milliseconds."""

    def __init__(self, n: int = 8192, length: int = 16384, dim: int = 256, rounds: int = 1) -> None:
        self.n, self.length, self.dim, self.rounds = n, length, dim, rounds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        rng = np.random.default_rng(i)
        signal = rng.standard_normal(self.length).astype(np.float32)
        for _ in range(self.rounds):
            signal = np.fft.irfft(np.fft.rfft(signal) * 0.99, n=self.length).astype(np.float32)
        return torch.from_numpy(np.abs(signal[: self.dim])), i % 10


def _workers(*counts: int, persistent: bool = True, prefetch: int = 2) -> tuple[dict, ...]:
    return tuple({"num_workers": n, "persistent_workers": persistent, "prefetch_factor": prefetch} for n in counts)


NAIVE = ({"num_workers": 0},)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="storage_latency",
            description="8 samples/step, 10 ms storage latency per sample, 2x2048 MLP (~5 ms of compute)",
            make_dataset=lambda: SlowStorage(),
            make_model=lambda: Classifier(mlp(64, 2048, 2)),
            batch_size=8,
            steps=120,
            warmup=20,
            tuned_steps=3000,
            grid=NAIVE + _workers(1, 2, 4, 8, 16) + _workers(32, prefetch=4),
        ),
        Scenario(
            name="cpu_decode",
            description="32 JPEGs/step decoded + augmented with Pillow, small CNN",
            make_dataset=lambda: JpegDecode(jpeg_folder()),
            make_model=lambda: Classifier(small_cnn()),
            batch_size=32,
            steps=40,
            warmup=8,
            tuned_steps=400,
            grid=NAIVE + _workers(1, 2, 3, 4),
        ),
        Scenario(
            name="compute_bound",
            description="resident tensors, 256 samples/step into a 3x2048 MLP",
            make_dataset=lambda: TensorDataset(torch.randn(16384, 512), torch.randint(0, 10, (16384,))),
            make_model=lambda: Classifier(mlp(512, 2048, 3)),
            batch_size=256,
            steps=40,
            warmup=8,
            tuned_steps=60,
            grid=NAIVE + _workers(1, 2),
        ),
        Scenario(
            name="balanced",
            description="16 samples/step with ~1 ms of FFT work each, 2x2048 MLP",
            make_dataset=lambda: CpuFeatures(rounds=2),
            make_model=lambda: Classifier(mlp(256, 2048, 2)),
            batch_size=16,
            steps=60,
            warmup=10,
            tuned_steps=400,
            grid=NAIVE + _workers(1, 2, 3),
        ),
    )
}
