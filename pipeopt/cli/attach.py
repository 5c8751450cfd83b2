"""Attach a PipeOpt to every Trainer an unmodified script creates - of the Lightning it imports, and only that one."""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import sys
from collections.abc import Callable, Iterator
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from pipeopt import _lightning


@contextlib.contextmanager
def attached(make_callback: Callable[[], Any], kind: type) -> Iterator[list[Any]]:
    """While active, every Trainer (of either Lightning namespace) is built with ``make_callback()`` among its
    callbacks - unless the script already gave it a callback of type ``kind``, which is then used as it is. Yields
    the list of the callbacks of type ``kind`` in use, one per Trainer created, in order.

    A Trainer module already imported is patched at once; the other is patched when the script imports it, never
    imported here (importing ``pytorch_lightning`` into a ``lightning.pytorch`` program moves Lightning's own log
    messages to the other namespace's logger)."""
    in_use: list[Any] = []
    patched: list[tuple[type, Any]] = []

    def patch(module: ModuleType) -> None:
        cls = module.Trainer
        original = cls.__init__

        @functools.wraps(original)  # Lightning reads the signature for its PL_TRAINER_* environment defaults
        def init(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> None:
            callbacks = kwargs.pop("callbacks", None)
            if callbacks is None:
                callbacks = []
            callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
            own = [c for c in callbacks if isinstance(c, kind)]
            if not own:
                own = [make_callback()]
                callbacks.append(own[0])
            in_use.extend(own)
            __original(self, *args, callbacks=callbacks, **kwargs)

        cls.__init__ = init  # restored when the block ends
        patched.append((cls, original))

    watcher = _AfterImport(set(_lightning.TRAINER_MODULES), patch)
    for name in _lightning.TRAINER_MODULES:
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, watcher)
    try:
        yield in_use
    finally:
        sys.meta_path.remove(watcher)
        for cls, original in patched:
            cls.__init__ = original  # type: ignore[misc]  # the class's own __init__, put back


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` right after one of ``names`` is first imported (found and loaded as usual)."""

    def __init__(self, names: set[str], then: Callable[[ModuleType], None]) -> None:
        self._names, self._then = names, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname not in self._names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self._then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, then: Callable[[ModuleType], None]) -> None:
        self._inner, self._then = inner, then

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._then(module)
