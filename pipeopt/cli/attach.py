"""Attach a PipeOpt to every Trainer an unmodified script creates."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from pipeopt import _compat


@contextlib.contextmanager
def attached(make_callback: Callable[[], Any], kind: type) -> Iterator[list[Any]]:
    """While active, every Trainer (of either Lightning namespace) is built with ``make_callback()`` among its
    callbacks - unless the script already gave it a callback of type ``kind``, which is then used as it is. Yields
    the list of the callbacks of type ``kind`` in use, one per Trainer created, in order."""
    in_use: list[Any] = []
    patched: list[tuple[type, Any]] = []
    for cls in _compat.trainer_classes():
        original = cls.__init__

        @functools.wraps(original)
        def init(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> None:
            callbacks = kwargs.pop("callbacks", None)
            callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
            own = [c for c in callbacks if isinstance(c, kind)]
            if not own:
                own = [make_callback()]
                callbacks.append(own[0])
            in_use.extend(own)
            __original(self, *args, callbacks=callbacks, **kwargs)

        cls.__init__ = init  # type: ignore[method-assign]
        patched.append((cls, original))
    try:
        yield in_use
    finally:
        for cls, original in patched:
            cls.__init__ = original  # type: ignore[method-assign]
