import pathlib
import re

import pytest

from pipeopt import TUNE_GROUPS, PipeOpt


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"tune": "loader"}, "tune"),
        ({"tune": ("loader", "turbo")}, "tune"),
        ({"tune": 3}, "tune"),
        ({"budget_s": 0}, "budget_s"),
        ({"budget_s": -5}, "budget_s"),
        ({"budget_s": "60"}, "budget_s"),
        ({"memory_fraction": 0}, "memory_fraction"),
        ({"memory_fraction": 1.5}, "memory_fraction"),
        ({"window": 1}, "window"),
        ({"window": 2.5}, "window"),
        ({"window_s": -0.5}, "window_s"),
        ({"window_s": "1s"}, "window_s"),
        ({"warmup": -1}, "warmup"),
        ({"warmup": True}, "warmup"),
        ({"report_dir": ""}, "report_dir"),
        ({"report_dir": 5}, "report_dir"),
        ({"cache": 3}, "cache"),
        ({"cache": ""}, "cache"),
        ({"cost_per_hour": 0}, "cost_per_hour"),
        ({"cost_per_hour": "2.5"}, "cost_per_hour"),
        ({"cost_per_hour": float("inf")}, "cost_per_hour"),
    ],
)
def test_invalid_arguments_name_the_argument_and_the_value(kwargs, name):
    (value,) = kwargs.values()
    with pytest.raises(ValueError, match=re.escape(f"PipeOpt({name}={value!r})` is not valid. Expected")):
        PipeOpt(**kwargs)


def test_unknown_group_is_named():
    with pytest.raises(ValueError, match=r"unknown: \['turbo'\]"):
        PipeOpt(tune=("loader", "turbo"))


def test_defaults_and_normalisation():
    cfg = PipeOpt().config
    assert cfg.tune == frozenset(TUNE_GROUPS)
    assert (cfg.budget_s, cfg.memory_fraction, cfg.cache) == (60.0, 0.9, True)
    assert cfg.report_dir == pathlib.Path("pipeopt_reports")
    observe = PipeOpt(tune=[], report_dir=None, cache="cache.json").config
    assert observe.tune == frozenset() and observe.report_dir is None
    assert observe.cache == pathlib.Path("cache.json")


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        PipeOpt(("loader",))  # type: ignore[misc]
