"""The user's options for PipeOpt, validated once, in one place (the callback and the CLI share it)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Union

#: The knob groups pipeopt may turn. ``tune=()`` means observe only.
TUNE_GROUPS: tuple[str, ...] = ("loader", "dali", "precision", "batch", "cache")

PathLike = Union[str, "os.PathLike[str]"]


def _bad(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"`PipeOpt({name}={value!r})` is not valid. Expected {allowed}.")


def unknown_groups(groups: Iterable[str]) -> list[str]:
    """The names in ``groups`` that are not knob groups (``TUNE_GROUPS``), in order."""
    return [g for g in groups if g not in TUNE_GROUPS]


def parse_tune(value: object) -> frozenset[str]:
    """Turn ``tune=`` into a set of group names, naming any unknown group and the allowed ones."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise _bad("tune", value,
                   f"a collection drawn from {set(TUNE_GROUPS)}, e.g. tune=('loader',); () observes only")
    groups = list(value)
    unknown = unknown_groups(groups)
    if unknown:
        raise _bad("tune", value, f"groups drawn from {set(TUNE_GROUPS)}; unknown: {unknown}")
    return frozenset(groups)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class PipeOptConfig:
    """Validated PipeOpt options. Every check raises a ``ValueError`` naming the argument and what is allowed."""

    tune: frozenset[str] = frozenset(TUNE_GROUPS)
    budget_s: float = 60.0
    memory_fraction: float = 0.9
    window: int = 20
    window_s: float = 1.0
    warmup: int = 5
    report_dir: Path | None = Path("pipeopt_reports")
    cache: bool | Path = True
    stop_when_tuned: bool = False
    cost_per_hour: float | None = None
    sample_cache_dir: Path | None = None
    sample_cache_share: float = 0.5
    keep_sample_cache: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalise in place
        set_(self, "tune", parse_tune(self.tune))
        if not _is_number(self.budget_s) or not self.budget_s > 0:
            raise _bad("budget_s", self.budget_s, "a number of seconds > 0")
        if not _is_number(self.memory_fraction) or not 0 < self.memory_fraction <= 1:
            raise _bad("memory_fraction", self.memory_fraction, "a fraction in (0, 1]")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 2:
            raise _bad("window", self.window, "an int >= 2 (optimizer steps per measurement window)")
        if not _is_number(self.window_s) or not self.window_s >= 0:
            raise _bad("window_s", self.window_s,
                       "a number of seconds >= 0 (the shortest trial window; 0: `window` steps)")
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 0:
            raise _bad("warmup", self.warmup, "an int >= 0 (optimizer steps ignored at the start)")
        if self.report_dir is not None:
            if not isinstance(self.report_dir, (str, os.PathLike)) or str(self.report_dir) == "":
                raise _bad("report_dir", self.report_dir, "a directory path, or None to write no files")
            set_(self, "report_dir", Path(self.report_dir))
        if isinstance(self.cache, (str, os.PathLike)) and not isinstance(self.cache, bool):
            if str(self.cache) == "":
                raise _bad("cache", self.cache, "True, False or a file path")
            set_(self, "cache", Path(self.cache))
        elif not isinstance(self.cache, bool):
            raise _bad("cache", self.cache, "True, False or a file path")
        if not isinstance(self.stop_when_tuned, bool):
            raise _bad("stop_when_tuned", self.stop_when_tuned, "True or False")
        if self.cost_per_hour is not None and (not _is_number(self.cost_per_hour) or not self.cost_per_hour > 0
                                               or self.cost_per_hour == float("inf")):
            raise _bad("cost_per_hour", self.cost_per_hour,
                       "the price of one hour of this run's machines (a number > 0, any currency), or None")
        if self.sample_cache_dir is not None:
            if not isinstance(self.sample_cache_dir, (str, os.PathLike)) or str(self.sample_cache_dir) == "":
                raise _bad("sample_cache_dir", self.sample_cache_dir,
                           "a local disk directory for the sample cache, or None (under report_dir, sized by RAM)")
            set_(self, "sample_cache_dir", Path(self.sample_cache_dir))
        if not _is_number(self.sample_cache_share) or not 0 < self.sample_cache_share <= 1:
            raise _bad("sample_cache_share", self.sample_cache_share,
                       "the share of free memory (or of sample_cache_dir's free space) the cache may use, in (0, 1]")
        if not isinstance(self.keep_sample_cache, bool):
            raise _bad("keep_sample_cache", self.keep_sample_cache, "True or False")
