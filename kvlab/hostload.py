"""Host counters around a measured run: CPU steal, the process's own CPU time, preemptions.

Why: batch-1 decode is host-bound (the GPU waits on Python launching kernels), and on the lent
H200 the step time switched between about 30 and 60 ms inside single runs, for every method
(2026-12-02). These deltas say where a slow run's time went: to the hypervisor (steal time of
the VM's CPUs), to other processes (involuntary context switches) or to this process itself.
Every field is None where the counter cannot be read (not Linux): never an error.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostCounters:
    """One reading of the counters (absolute values; :func:`host_delta` subtracts two)."""

    wall_s: float
    process_cpu_s: float
    steal_s: float | None = None
    nonvoluntary_switches: int | None = None


def parse_steal_s(proc_stat: str, ticks_per_s: float) -> float | None:
    """Steal time summed over all CPUs, in seconds, from the aggregate ``cpu`` line of /proc/stat
    (fields: user nice system idle iowait irq softirq steal ...)."""
    for line in proc_stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            return int(fields[8]) / ticks_per_s if len(fields) > 8 else None
    return None


def parse_nonvoluntary(proc_status: str) -> int | None:
    """``nonvoluntary_ctxt_switches`` from /proc/<pid>/status: times the scheduler took the CPU
    away from this process's main thread while it wanted to run."""
    for line in proc_status.splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split(":", 1)[1])
    return None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def read_counters() -> HostCounters:
    times = os.times()
    stat, status = _read("/proc/stat"), _read("/proc/self/status")
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return HostCounters(
        wall_s=time.perf_counter(),
        process_cpu_s=times.user + times.system,
        steal_s=parse_steal_s(stat, ticks) if stat else None,
        nonvoluntary_switches=parse_nonvoluntary(status) if status else None,
    )


def host_delta(before: HostCounters, after: HostCounters) -> dict[str, float | int | None]:
    """Record fields for the interval between two readings."""
    wall = after.wall_s - before.wall_s

    def diff(a, b):
        return None if a is None or b is None else b - a

    cpu = after.process_cpu_s - before.process_cpu_s
    steal = diff(before.steal_s, after.steal_s)
    return {
        "host_process_cpu_ms": cpu * 1000.0,
        "host_process_cpu_share": cpu / wall if wall > 0 else None,  # >1 with several busy threads
        "host_steal_ms": steal * 1000.0 if steal is not None else None,  # summed over the VM's CPUs
        "host_nonvoluntary_switches": diff(before.nonvoluntary_switches, after.nonvoluntary_switches),
    }
