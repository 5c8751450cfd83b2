"""Tuned configurations remembered across runs, keyed by a fingerprint of what they depend on.

The file is JSON: ``{"pipeopt_cache": 1, "entries": {fingerprint: entry}}``. Writes are atomic (a temporary file
renamed over the old one) and read-modify-write cycles hold an exclusive lock on a side file, so concurrent runs
neither corrupt the file nor lose each other's entries. A corrupt or foreign file is ignored with a warning (and
replaced by the next write).

Location: ``PipeOpt(cache=path)``, else ``$PIPEOPT_CACHE``, else ``$XDG_CACHE_HOME/pipeopt/tuned.json``, else
``~/.cache/pipeopt/tuned.json``. ``cache=False`` disables it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pipeopt.files import write_atomic

FORMAT = 1


def default_path() -> Path:
    explicit = os.environ.get("PIPEOPT_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pipeopt" / "tuned.json"


def fingerprint(parts: Mapping[str, Any]) -> str:
    """A stable key for ``parts`` (JSON-able values; order of keys does not matter)."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class TunedCache:
    def __init__(self, path: Path) -> None:
        self.path = path

    def get(self, key: str) -> dict[str, Any] | None:
        entry = self._entries().get(key)
        return entry if isinstance(entry, dict) else None

    def put(self, key: str, entry: dict[str, Any]) -> None:
        """Store ``entry`` under ``key``. Raises ``OSError`` when the file cannot be written."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            entries = self._entries()
            entries[key] = entry
            self._write({"pipeopt_cache": FORMAT, "entries": entries})

    def _entries(self) -> dict[str, Any]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as err:
            warnings.warn(f"PipeOpt: cannot read the tuning cache {self.path} ({err}); ignoring it.", stacklevel=3)
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            warnings.warn(f"PipeOpt: the tuning cache {self.path} is corrupt ({err}); ignoring it. It is rewritten "
                          "at the next tuned run; delete it to start afresh.", stacklevel=3)
            return {}
        entries = data.get("entries") if isinstance(data, dict) else None
        if not isinstance(data, dict) or data.get("pipeopt_cache") != FORMAT or not isinstance(entries, dict):
            warnings.warn(f"PipeOpt: {self.path} is not a pipeopt tuning cache of format {FORMAT}; ignoring it. "
                          "Pass `cache=` another path to keep that file.", stacklevel=3)
            return {}
        return dict(data["entries"])

    def _write(self, data: dict[str, Any]) -> None:
        write_atomic(self.path, json.dumps(data, indent=1, sort_keys=True))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock_path = self.path.with_name(self.path.name + ".lock")
        with open(lock_path, "a+") as lock:
            try:
                import fcntl
            except ImportError:  # Windows: no advisory locks; the atomic rename still prevents corruption
                yield
                return
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
