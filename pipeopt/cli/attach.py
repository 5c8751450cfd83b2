"""Attach a PipeOpt to every Trainer an unmodified script creates."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from pipeopt import _compat


@contextlib.contextmanager
def attached(make_callback: Callable[[], Any], kind: type) -> Iterator[None]:
    """While active, every Trainer (of either Lightning namespace) is built with ``make_callback()`` among its
    callbacks - unless the script already gave it a callback of type ``kind``."""
    patched: list[tuple[type, Any]] = []
    for cls in _compat.trainer_classes():
        original = cls.__init__

        @functools.wraps(original)
        def init(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> None:
            callbacks = kwargs.pop("callbacks", None)
            callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
            if not any(isinstance(c, kind) for c in callbacks):
                callbacks.append(make_callback())
            __original(self, *args, callbacks=callbacks, **kwargs)

        cls.__init__ = init  # type: ignore[method-assign]
        patched.append((cls, original))
    try:
        yield
    finally:
        for cls, original in patched:
            cls.__init__ = original  # type: ignore[method-assign]
