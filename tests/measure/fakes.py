"""Fakes at the edges: a clock the test advances, and a resource probe that measures nothing."""

from __future__ import annotations

from pipeopt.measure.resources import ResourceFigures


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class NullProbe:
    def __init__(self) -> None:
        self.begun = 0

    def begin(self) -> object:
        self.begun += 1
        return self.begun

    def ready_now(self) -> None:
        return None

    def end(self, mark: object) -> ResourceFigures:
        return ResourceFigures(gpu_status="n/a (test)")
