"""A pytest plugin that attaches a PipeOpt to every Trainer Lightning's own test suite builds.

    PIPEOPT_TUNE=none|default|loader,precision,... python -m pytest -p pipeopt_everywhere ...

``none`` observes only (``tune=()``); ``default`` uses PipeOpt's default groups. The PipeOpt writes no files, keeps
no cache and prints to a buffer, so what a test sees of it is only what a user's program would: its hooks.
"""

from __future__ import annotations

import functools
import io
import os
from typing import Any

import lightning.pytorch as L  # the namespace Lightning's own tests train with
from rich.console import Console

from pipeopt import PipeOpt
from pipeopt.config import TUNE_GROUPS


def _tune() -> tuple[str, ...]:
    value = os.environ.get("PIPEOPT_TUNE", "default").strip()
    if value == "default":
        return TUNE_GROUPS
    return () if value == "none" else tuple(g.strip() for g in value.split(",") if g.strip())


def pytest_configure(config: Any) -> None:
    tune = _tune()
    original = L.Trainer.__init__

    @functools.wraps(original)  # Lightning reads this signature for its PL_TRAINER_* environment defaults
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        callbacks = kwargs.pop("callbacks", None)
        if callbacks is None:
            callbacks = []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        callbacks.append(PipeOpt(tune=tune, report_dir=None, cache=False, console=Console(file=io.StringIO())))
        original(self, *args, callbacks=callbacks, **kwargs)

    L.Trainer.__init__ = init
