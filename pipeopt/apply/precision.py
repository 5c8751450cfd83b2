"""Switching the running fit's precision between optimizer steps, and reading what a step trained on.

Autocast-style plugins only (``Precision`` for ``32-true``, ``MixedPrecision`` for ``bf16-mixed`` / ``16-mixed``):
they hold no state in the model, so the strategy's plugin can be swapped between two optimizer steps and the next
step runs under the new one (``16-mixed`` brings a fresh gradient scaler).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from pipeopt import _lightning


def unsupported(trainer: Any, module: Any) -> str | None:
    """Why pipeopt leaves this run's precision alone (None when it may try others on the live run)."""
    current = _lightning.precision_of(trainer)
    if current != "32-true":
        return f"you chose precision={current!r}; pipeopt respects it"
    plugin = type(trainer.strategy.precision_plugin).__name__
    if plugin != "Precision":
        return f"the strategy brings its own precision plugin ({plugin}); pipeopt does not replace it"
    if not getattr(module, "automatic_optimization", True):
        return "the module uses manual optimization: pipeopt cannot watch the loss its steps train on"
    if trainer.world_size > 1 and trainer.strategy.root_device.type != "cuda":
        return "mixed precision is tried on CUDA, or on the CPU in a single process"
    return None


def apply_precision(trainer: Any, precision: str) -> None:
    """Train the next optimizer step on under ``precision``."""
    plugin = _lightning.precision_plugin(trainer, precision, trainer.strategy.root_device.type)
    _lightning.set_precision_plugin(trainer, plugin)


def skipped_step(outputs: Any) -> bool:
    """Whether the training step returned no loss (a skipped batch) - without reading the loss's value."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return not isinstance(loss, torch.Tensor)


def step_loss(outputs: Any) -> float | None:
    """The loss a training step returned (``on_train_batch_end``'s ``outputs``: a tensor or a mapping with
    ``"loss"``); None when the step returned none (a skipped batch)."""
    if isinstance(outputs, Mapping):
        outputs = outputs.get("loss")
    if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
        return float(outputs.detach().float())
    return None


def scaler_scale(trainer: Any) -> float | None:
    """The gradient scaler's current scale (``16-mixed``), None without one: a drop means the last optimizer step
    was skipped for non-finite gradients."""
    scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    scale = float(scaler.get_scale())
    return scale if math.isfinite(scale) else None
