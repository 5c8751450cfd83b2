"""A pytest plugin that attaches a PipeOpt to every Trainer Lightning's own test suite builds.

    PIPEOPT_TUNE=none|default|loader,precision,... python -m pytest -p pipeopt_everywhere ...

``none`` observes only (``tune=()``); ``default`` uses PipeOpt's default groups. The PipeOpt writes no files, keeps
no cache and prints to a buffer, so what a test sees of it is only what a user's program would: its hooks.

With ``PIPEOPT_TRIED_LOG=<file>``, it writes there, per test, what the PipeOpts of that test tried (the labels of
their trial windows) and whether a fit was too short to tune: how much of the suite exercised tuning at all.
"""

from __future__ import annotations

import functools
import io
import json
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


_made: list[PipeOpt] = []  # the PipeOpts of the running test
_tried: dict[str, dict[str, Any]] = {}


def pytest_runtest_setup(item: Any) -> None:
    _made.clear()


def pytest_runtest_teardown(item: Any, nextitem: Any) -> None:
    tried = sorted({w.label.split(":")[0] for p in _made for w in p.windows if "trial" in w.label})
    short = any("too short" in s.reason for p in _made if p.report is not None for s in p.report.skipped)
    _tried[item.nodeid] = {"fits": len(_made), "tried": tried, "too_short": short}


def pytest_sessionfinish(session: Any) -> None:
    path = os.environ.get("PIPEOPT_TRIED_LOG")
    if path:
        with open(path, "w") as f:
            json.dump(_tried, f)


def pytest_configure(config: Any) -> None:
    tune = _tune()
    original = L.Trainer.__init__

    @functools.wraps(original)  # Lightning reads this signature for its PL_TRAINER_* environment defaults
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        callbacks = kwargs.pop("callbacks", None)
        if callbacks is None:
            callbacks = []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        _made.append(PipeOpt(tune=tune, report_dir=None, cache=False, console=Console(file=io.StringIO())))
        callbacks.append(_made[-1])
        original(self, *args, callbacks=callbacks, **kwargs)

    L.Trainer.__init__ = init
