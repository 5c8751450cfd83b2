"""Datasets for handover tests (module level, so worker processes can use them under any start method)."""

import os

import torch
from torch.utils.data import Dataset, get_worker_info


class Indexed(Dataset):
    """Sample i is the tensor [i]: what arrives tells exactly which samples, in which order."""

    def __init__(self, n: int = 96) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


class CrashesWithManyWorkers(Indexed):
    """A worker process dies (no exception, no cleanup) when its loader has ``crash_at`` workers or more."""

    def __init__(self, n: int = 96, crash_at: int = 2) -> None:
        super().__init__(n)
        self.crash_at = crash_at

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        if info is not None and info.num_workers >= self.crash_at:
            os._exit(3)
        return super().__getitem__(i)


class CrashesOn(Indexed):
    """A worker process dies (no exception, no cleanup) when asked for one of ``positions``; the main process makes
    them as ``Indexed`` does."""

    def __init__(self, positions: set[int], n: int = 96) -> None:
        super().__init__(n)
        self.positions = positions

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.positions and get_worker_info() is not None:
            os._exit(3)
        return super().__getitem__(i)
