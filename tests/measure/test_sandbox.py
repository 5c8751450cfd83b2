"""Probes that are not training steps leave no trace: weights, buffers, gradients, optimizer state, RNGs."""

import random

import numpy as np
import pytest
import torch
from torch import nn

from pipeopt.measure.sandbox import Sandbox, time_probe


def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # some optimizer state and gradients exist before the probe
    return model, optimizer


def _snapshot(model, optimizer):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    opt = optimizer.state_dict()
    opt_state = {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in v.items()} for k, v in opt["state"].items()}
    return state, grads, opt_state, torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def test_everything_a_probe_touched_is_restored():
    model, optimizer = _model_and_optimizer()
    model.eval()
    before = _snapshot(model, optimizer)
    with Sandbox(model, [optimizer]):
        model.train()
        for _ in range(3):  # forward (batch-norm stats move), backward, optimizer steps, random draws
            model(torch.randn(4, 8)).pow(2).mean().backward()
            optimizer.step()
            np.random.rand()
            random.random()
    after = _snapshot(model, optimizer)
    state, grads, opt_state, rng, np_rng, py_rng = before
    assert all(torch.equal(state[k], after[0][k]) for k in state)  # parameters and running stats
    assert all(torch.equal(a, b) for a, b in zip(grads, after[1]))
    assert all(torch.equal(opt_state[k][n], after[2][k][n]) for k in opt_state for n in opt_state[k]
               if torch.is_tensor(opt_state[k][n]))
    assert torch.equal(rng, after[3]) and (np_rng == after[4]).all() and py_rng == after[5]
    assert not model.training  # the mode is the caller's


def test_an_exception_in_the_probe_still_restores():
    model, optimizer = _model_and_optimizer()
    weight = model[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match="boom"), Sandbox(model, [optimizer]):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        raise RuntimeError("boom")
    assert torch.equal(model[0].weight, weight)


def test_time_probe_times_the_repeats_and_keeps_their_losses():
    calls = []

    def step():
        calls.append(1)
        return torch.tensor(float(len(calls)))

    rate, losses = time_probe(step, device=torch.device("cpu"), repeats=4, warmup=1)
    assert len(calls) == 5 and losses == (2.0, 3.0, 4.0, 5.0)  # the warm-up run is not kept
    assert rate.value > 0 and rate.rel_se >= 0
