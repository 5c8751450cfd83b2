"""Probing precisions on a real batch of the run (sandboxed), and switching the running fit to the winner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipeopt import _compat
from pipeopt.measure.sandbox import Sandbox, time_probe, training_loss
from pipeopt.tuning.noise import Rate
from pipeopt.tuning.precision import PrecisionTrial, candidates

#: ``timing(precision, step, device=, repeats=)`` runs and times a probe step: its rate and its losses.
Timing = Callable[..., "tuple[Rate, tuple[float, ...]]"]


def _time(precision: str, step: Callable[[], torch.Tensor], **kwargs: Any) -> tuple[Rate, tuple[float, ...]]:
    return time_probe(step, **kwargs)


def unsupported(trainer: Any, module: Any) -> str | None:
    """Why pipeopt leaves this run's precision alone (None when it may tune it)."""
    current = _compat.precision_of(trainer)
    if current != "32-true":
        return f"you chose precision={current!r}; pipeopt respects it"
    if not getattr(module, "automatic_optimization", True):
        return "the module uses manual optimization: a probe of training_step would step its optimizers"
    if trainer.world_size > 1 and trainer.strategy.root_device.type != "cuda":
        return "mixed precision is only probed on CUDA or a single CPU process"
    return None


def probe_step(trainer: Any, module: Any, batch: Any, batch_idx: int, precision: str) -> Callable[[], torch.Tensor]:
    """One forward + backward of ``training_step`` on ``batch`` under ``precision`` (its autocast and scaler)."""
    plugin = _compat.precision_plugin(trainer, precision, trainer.strategy.root_device.type)

    def step() -> torch.Tensor:
        module.zero_grad(set_to_none=True)
        with plugin.forward_context():
            loss = training_loss(module, batch, batch_idx)
        scaled = plugin.scaler.scale(loss) if getattr(plugin, "scaler", None) is not None else loss
        scaled.backward()
        return loss

    return step


def probe_precisions(trainer: Any, module: Any, batch: Any, batch_idx: int, *, timing: Timing | None = None,
                     repeats: int = 5) -> list[PrecisionTrial]:
    """Each candidate precision's probe rate and losses on this batch; model, optimizers and RNGs untouched.
    ``timing`` (default: ``time_probe``, device-synchronised) runs and times each probe."""
    timing = timing or _time
    device = trainer.strategy.root_device
    bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported()
    trials = []
    with Sandbox(module, trainer.optimizers) as sandbox, _compat.no_logging(module):
        for precision in candidates(device.type, bf16):
            sandbox.rewind_rng()  # every candidate's runs draw the same dropout masks: losses compare like for like
            try:
                rate, losses = timing(precision, probe_step(trainer, module, batch, batch_idx, precision),
                                      device=device, repeats=repeats)
                trials.append(PrecisionTrial(precision, rate, losses))
            except (RuntimeError, TypeError) as err:  # an op without a kernel for the dtype, OOM, no loss
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                trials.append(PrecisionTrial(precision, None, error=error))
        module.zero_grad(set_to_none=True)
    return trials


def apply_precision(trainer: Any, precision: str) -> None:
    _compat.set_precision_plugin(trainer, _compat.precision_plugin(trainer, precision, trainer.strategy.root_device.type))
