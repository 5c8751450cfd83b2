"""A pass-through profiler that lets pipeopt see the training loop's own timing points."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Hook = Callable[[], None]


class _Scope:
    __slots__ = ("_tap", "_name")

    def __init__(self, tap: ProfilerTap, name: str) -> None:
        self._tap = tap
        self._name = name

    def __enter__(self) -> str:
        self._tap.start(self._name)
        return self._name

    def __exit__(self, *exc: object) -> None:
        self._tap.stop(self._name)


class ProfilerTap:
    """Wraps a profiler: every call goes to it unchanged; the named actions also call pipeopt's hooks.

    The Trainer already brackets the fetch, the transfer and the step with profiler actions, so wrapping its
    profiler times exactly those regions, whatever other callbacks or loggers do between them. Our hook runs
    *inside* the wrapped profiler's bracket so its own overhead is not counted.
    """

    __slots__ = ("_inner", "_on_start", "_on_stop")

    def __init__(self, inner: Any, on_start: Mapping[str, Hook], on_stop: Mapping[str, Hook]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_on_start", dict(on_start))
        object.__setattr__(self, "_on_stop", dict(on_stop))

    @property
    def inner(self) -> Any:
        return self._inner

    def start(self, action_name: str) -> None:
        self._inner.start(action_name)
        hook = self._on_start.get(action_name)
        if hook is not None:
            hook()

    def stop(self, action_name: str) -> None:
        hook = self._on_stop.get(action_name)
        if hook is not None:
            hook()
        self._inner.stop(action_name)

    def profile(self, action_name: str) -> _Scope:
        return _Scope(self, action_name)

    def __getattr__(self, name: str) -> Any:  # describe(), setup(), teardown(), summary(), dirpath, ...
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)
