"""Probe steps that are not training steps, and leave no trace.

``Sandbox`` snapshots what a probe may touch - the module's parameters, buffers and gradients, each optimizer's
state, and the torch (CPU and CUDA), numpy and Python RNG states - and restores all of it in ``finally``, whatever
the probe did or raised. ``time_probe`` runs a probe step a few times and returns its device-synchronised times and
losses; ``training_loss`` is the loss a probe step takes from ``training_step``.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pipeopt.tuning.noise import Rate


class Sandbox:
    def __init__(self, module: torch.nn.Module, optimizers: Sequence[Any] = ()) -> None:
        self._module = module
        self._optimizers = list(optimizers)

    def __enter__(self) -> Sandbox:
        module = self._module
        self._state = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}
        self._grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in module.parameters()]
        self._optim = [copy.deepcopy(o.state_dict()) for o in self._optimizers]
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None,
                     np.random.get_state(), random.getstate())
        self._training = module.training
        return self

    def rewind_rng(self) -> None:
        """Put the RNGs back to where they were on entry, so each probe draws the same numbers (dropout masks)."""
        cpu, cuda, np_state, py_state = self._rng
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        np.random.set_state(np_state)
        random.setstate(py_state)

    def __exit__(self, *exc: object) -> None:
        module = self._module
        with torch.no_grad():
            for name, tensor in module.state_dict(keep_vars=True).items():
                tensor.copy_(self._state[name])
        for p, grad in self._grads:
            p.grad = grad
        for optimizer, state in zip(self._optimizers, self._optim):
            optimizer.load_state_dict(state)
        self.rewind_rng()
        module.train(self._training)


def training_loss(module: Any, batch: Any, batch_idx: int) -> torch.Tensor:
    """The loss of ``module.training_step`` on ``batch`` (a tensor, or a dict's ``"loss"``), for a probe."""
    output = module.training_step(batch, batch_idx)
    if isinstance(output, dict):
        output = output.get("loss")
    if not isinstance(output, torch.Tensor):
        raise NoLoss("training_step returned no loss tensor for a probe batch (it may skip batches)")
    return output


class NoLoss(TypeError):
    """A probe's ``training_step`` returned no loss (a valid Lightning step may return None to skip a batch)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_probe(
    step: Callable[[], torch.Tensor],
    *,
    device: torch.device,
    repeats: int = 5,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Rate, tuple[float, ...]]:
    """Run ``step`` (forward + backward, returning the loss) ``warmup + repeats`` times; the steps/s of the timed
    runs (the relative standard error of their mean time as noise) and every timed run's loss."""
    times: list[float] = []
    losses: list[float] = []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = clock()
        loss = step()
        _sync(device)
        if i >= warmup:
            times.append(clock() - t0)
            losses.append(float(loss.detach().float()))
    mean = statistics.fmean(times)
    se = statistics.stdev(times) / len(times) ** 0.5 / mean if len(times) > 1 and mean > 0 else 0.0
    return Rate(1.0 / mean if mean > 0 else 0.0, se), tuple(losses)
