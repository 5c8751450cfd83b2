"""The code a report gives to keep the loader changes without pipeopt: code that runs."""

import os

import torch
from torch.utils.data import DataLoader, TensorDataset

import pipeopt
from pipeopt.report.findings import loader_suggestion
from pipeopt.tuning.findings import Change


def test_workers_giving_way_are_kept_with_pipeopts_worker_init_fn_in_code_that_builds_a_loader():
    changes = [Change("num_workers", 0, 1, "faster"), Change("prefetch_factor", None, 2, "comes with workers"),
               Change("give_way", False, True, "faster")]
    code = loader_suggestion(changes)
    assert code == "DataLoader(..., num_workers=1, prefetch_factor=2, worker_init_fn=pipeopt.GiveWay())"
    loader = eval(code.replace("...", "dataset"), {"DataLoader": DataLoader, "pipeopt": pipeopt,  # noqa: S307
                                                   "dataset": TensorDataset(torch.arange(4.0))})
    assert isinstance(loader.worker_init_fn, pipeopt.GiveWay)
    niceness = DataLoader(TensorDataset(torch.zeros(2)), batch_size=None, num_workers=1,
                          worker_init_fn=loader.worker_init_fn, collate_fn=lambda _: os.nice(0))
    assert list(niceness) == [min(os.nice(0) + 10, 19)] * 2  # its workers run below this process's priority


def test_other_changes_are_the_dataloaders_own_arguments():
    code = loader_suggestion([Change("num_workers", 0, 2, "faster"), Change("persistent_workers", False, True, "x")])
    assert code == "DataLoader(..., num_workers=2, persistent_workers=True)"
    assert loader_suggestion([]) is None
