"""How much of the machine the rest of it took while we measured: other processes' CPU time
and the hypervisor's steal, from /proc/stat, less what this process used itself.

A kernel timing taken while a neighbour holds a core says nothing about the quiet machine:
with the work split statically over every thread, one shared core makes the whole call wait.
So the autotune reads this before and after it measures, and keeps (persists) only what it
measured quiet. The figure is in CPUs (core-equivalents): 1.0 is one CPU busy with others for
the whole window. CPUs beyond the threads we run are the neighbours' to use: only what others
took past those counts against us.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Protocol

# Others may take this many CPUs beyond our spare ones, on average over a measurement, and it
# still counts as quiet: a bound on the reading's own noise (whole jiffies per CPU) and on
# the background chatter of any idle host, not a figure of this CPU's speed.
QUIET_CPUS = 0.25


@dataclass(frozen=True, slots=True)
class CpuSample:
    """One reading: wall seconds, CPU-seconds busy on the whole machine (steal included), and
    CPU-seconds this process used (every thread)."""

    wall_s: float
    busy_s: float
    own_s: float
    steal_s: float = 0.0  # the hypervisor's part of busy_s


class CpuMeter(Protocol):
    """Where readings come from (/proc/stat on Linux; a scripted one in tests)."""

    num_cpus: int

    def read(self) -> CpuSample: ...


class ProcStatMeter:
    """The machine's busy time from /proc/stat's `cpu` line; this process's from
    `time.process_time`. Where /proc/stat cannot be read, the machine looks as busy as this
    process (never contended): there is nothing to judge by."""

    def __init__(self) -> None:
        self.num_cpus = os.cpu_count() or 1
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def read(self) -> CpuSample:
        own = time.process_time()
        busy, steal = own, 0.0
        with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/stat") as f:
            # user nice system idle iowait irq softirq steal (guest is inside user)
            v = [int(x) for x in f.readline().split()[1:9]]
            busy, steal = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / self._tick, v[7] / self._tick
        return CpuSample(time.perf_counter(), busy, own, steal)


def others_cpus(start: CpuSample, end: CpuSample) -> float:
    """CPUs that other processes and steal took, on average, from `start` to `end`."""
    wall = end.wall_s - start.wall_s
    if wall <= 0:
        return 0.0
    others = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    return max(0.0, others / wall)


@dataclass(slots=True)
class Window:
    """Readings summed over the slices of one measurement (the gaps between them left out)."""

    num_cpus: int
    num_threads: int
    wall_s: float = 0.0
    others_s: float = 0.0  # CPU-seconds the others took during the slices

    def add(self, start: CpuSample, end: CpuSample) -> None:
        wall = max(0.0, end.wall_s - start.wall_s)
        self.wall_s += wall
        self.others_s += others_cpus(start, end) * wall

    @property
    def others_cpus(self) -> float:
        """Others' CPUs beyond the ones our threads leave spare (see the module's docstring)."""
        if self.wall_s <= 0:
            return 0.0
        spare = max(0, self.num_cpus - self.num_threads)
        return max(0.0, self.others_s / self.wall_s - spare)

    @property
    def is_quiet(self) -> bool:
        return self.others_cpus <= QUIET_CPUS
