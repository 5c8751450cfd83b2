"""CPU use of the training process and its loader workers, from the OS's own accounting (psutil)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil


def cpus_available() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def descendants(process: psutil.Process) -> list[psutil.Process]:
    """The process's live descendants (its loader workers, and theirs). On Linux from ``/proc/<pid>/task/*/children``
    - a few small reads - where psutil's ``children()`` reads every process's entry in ``/proc`` (~1 ms per 70
    processes, twice a window); psutil's elsewhere, or where the kernel has no such files."""
    found: list[int] = []
    parents = [process.pid]
    while parents:
        pids = _child_pids(parents.pop())
        if pids is None:
            return process.children(recursive=True)
        found += pids
        parents += pids
    out = []
    for pid in found:
        try:
            out.append(psutil.Process(pid))
        except psutil.Error:  # exited meanwhile
            continue
    return out


def _child_pids(pid: int) -> list[int] | None:
    """The pids of ``pid``'s children, from each of its threads' ``children`` file; None where there are none to
    read (not Linux, or a kernel without ``CONFIG_PROC_CHILDREN``)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return [] if os.path.isdir("/proc/self/task") else None  # exited meanwhile; or no /proc
    except OSError:
        return None
    pids: list[int] = []
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # that thread ended meanwhile
            return None  # no such files on this kernel
        except OSError:
            return None
    return pids


@dataclass(frozen=True)
class CpuSnapshot:
    t: float
    main_s: float  # CPU seconds of the training process (all its threads)
    workers_s: float  # CPU seconds of its child processes, live and already reaped
    workers: int  # live child processes


class CpuMeter:
    """Takes snapshots; the difference of two is the utilisation in between (100 % = one core busy)."""

    def __init__(
        self,
        process: psutil.Process | None = None,
        clock: Callable[[], float] = time.perf_counter,
        process_time: Callable[[], float] = time.process_time,
    ) -> None:
        self._process = process or psutil.Process()
        self._clock = clock
        self._process_time = process_time  # this process, all threads, ns resolution (psutil has clock ticks)

    def snapshot(self) -> CpuSnapshot:
        times = self._process.cpu_times()
        workers_s = times.children_user + times.children_system  # children already waited for
        live = 0
        for child in descendants(self._process):
            try:
                ct = child.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue  # exited between listing and reading: its time is in children_* once reaped
            workers_s += ct.user + ct.system
            live += 1
        return CpuSnapshot(self._clock(), self._process_time(), workers_s, live)

    @staticmethod
    def utilisation(a: CpuSnapshot, b: CpuSnapshot) -> tuple[float, float] | None:
        """(main %, workers %) between two snapshots; None when no time passed."""
        wall = b.t - a.t
        if wall <= 0:
            return None
        return 100.0 * (b.main_s - a.main_s) / wall, 100.0 * max(0.0, b.workers_s - a.workers_s) / wall


def worker_private_memory(process: psutil.Process | None = None, sample: int = 4) -> int | None:
    """Mean unique memory (USS: pages no other process shares) of up to ``sample`` live children; None without
    children. Forked workers share the parent's pages until they write them, so RSS would overstate them."""
    sizes = [size for child in descendants(process or psutil.Process())[:sample]
             if (size := private_memory(child)) is not None]
    return int(sum(sizes) / len(sizes)) if sizes else None


def private_memory(process: psutil.Process | None = None) -> int | None:
    """A process's unique memory (USS); None where it cannot be read."""
    try:
        return int((process or psutil.Process()).memory_full_info().uss)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
