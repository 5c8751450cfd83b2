from unittest.mock import MagicMock

import pytest
import pytorch_lightning as _pl

from pipeopt.measure.tap import ProfilerTap


def test_every_call_reaches_the_wrapped_profiler_and_named_actions_reach_the_hooks():
    inner = MagicMock(spec=_pl.profilers.SimpleProfiler)
    calls = []
    tap = ProfilerTap(inner, on_start={"fetch": lambda: calls.append("start")},
                      on_stop={"fetch": lambda: calls.append("stop")})
    with tap.profile("fetch") as name:
        assert name == "fetch"
    tap.start("other")
    tap.stop("other")
    assert calls == ["start", "stop"]
    assert [c.args for c in inner.start.call_args_list] == [("fetch",), ("other",)]
    assert [c.args for c in inner.stop.call_args_list] == [("fetch",), ("other",)]


def test_hooks_run_inside_the_wrapped_profilers_bracket():
    order = []
    inner = MagicMock(spec=_pl.profilers.SimpleProfiler)
    inner.start.side_effect = lambda name: order.append("inner.start")
    inner.stop.side_effect = lambda name: order.append("inner.stop")
    tap = ProfilerTap(inner, on_start={"a": lambda: order.append("hook.start")},
                      on_stop={"a": lambda: order.append("hook.stop")})
    tap.start("a")
    tap.stop("a")
    assert order == ["inner.start", "hook.start", "hook.stop", "inner.stop"]


def test_other_attributes_are_the_wrapped_profilers():
    inner = _pl.profilers.SimpleProfiler()
    tap = ProfilerTap(inner, on_start={}, on_stop={})
    tap.dirpath = "somewhere"
    assert inner.dirpath == "somewhere" and tap.dirpath == "somewhere"
    assert tap.summary() == inner.summary()
    assert tap.inner is inner


def test_the_stop_runs_when_the_profiled_block_raises():
    inner = MagicMock(spec=_pl.profilers.SimpleProfiler)
    tap = ProfilerTap(inner, on_start={}, on_stop={})
    with pytest.raises(KeyError):
        with tap.profile("x"):
            raise KeyError("boom")
    inner.stop.assert_called_once_with("x")
