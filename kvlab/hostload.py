"""Host counters around a measured run: CPU steal, the process's own CPU time, preemptions.

Why: batch-1 decode is host-bound (the GPU waits on Python launching kernels), and on the lent
H200 the step time switched between about 30 and 60 ms inside single runs, for every method.
These deltas say where a slow run's time went: to the hypervisor (steal time of
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


# A run is contended when other work took the CPU it needed. Thresholds from records: on the lent
# H200 (95 runs, nothing else running) the main thread was switched out 1-5 times per second of
# decode and never saw steal above 1.1% of a CPU; on a shared 2-core CPU machine the same smoke
# configuration ran at 43.5 ms/token with 0-3 switches and a CPU share of 2.0 (both threads busy),
# and at 850 ms/token with 300-1764 switches and a share of 1.0.
MAX_SWITCHES_PER_S = 20.0
MIN_CPU_SHARE_OF_THREADS = 0.7  # CPU only: a compute-bound decode keeps its torch threads busy...
# ...when they spin. Waiting passively (kvlab's default, kvlab/__init__), a batch-1 decode keeps one
# thread busy: 0.95-1.01 CPU share with 2 threads on a quiet 2-core machine, 0.48-0.65 under load,
# so the expected share is then one thread's.
MIN_SWITCHES_PER_S_WITH_LOW_SHARE = 5.0  # ...unless its code is serial: a low share counts with switches
MAX_STEAL_SHARE = 0.1  # steal summed over the VM's CPUs, per second of decode


def openmp_waits_passively() -> bool:
    """Whether torch's OpenMP threads sleep between parallel regions (``OMP_WAIT_POLICY=PASSIVE``)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def contention(host: dict, decode_s: float | None, threads: int | None = None,
               device: str = "cpu", waits_passively: bool | None = None) -> tuple[bool | None, str]:
    """Was a run measured while other work took its CPU? ``(contended, why)`` from the decode's host
    counters (:func:`host_delta` fields, without the ``decode_`` prefix); None when they are missing.

    Rules: involuntary switches above ``MAX_SWITCHES_PER_S`` per second of decode; steal above
    ``MAX_STEAL_SHARE``; on CPU, a process CPU share below ``MIN_CPU_SHARE_OF_THREADS`` x threads
    together with at least ``MIN_SWITCHES_PER_S_WITH_LOW_SHARE`` switches per second (a serial code
    path, e.g. a quantizer, leaves threads idle on a quiet machine too; on a GPU the host thread
    waits on kernels, so its share says nothing). Threads that wait passively (``waits_passively``,
    default: :func:`openmp_waits_passively`) count as one busy thread.
    """
    if not decode_s or decode_s <= 0:
        return None, "no decode interval"
    reasons = []
    switches = host.get("host_nonvoluntary_switches")
    if switches is not None and switches / decode_s > MAX_SWITCHES_PER_S:
        reasons.append(f"{switches / decode_s:.0f} involuntary switches/s")
    steal = host.get("host_steal_ms")
    if steal is not None and steal / (decode_s * 1000.0) > MAX_STEAL_SHARE:
        reasons.append(f"steal {steal / (decode_s * 10.0):.0f}% of a CPU")
    share = host.get("host_process_cpu_share")
    rate = switches / decode_s if switches is not None else 0.0
    if not str(device).startswith("cuda") and share is not None and threads:
        passive = openmp_waits_passively() if waits_passively is None else waits_passively
        busy = 1 if passive else threads
        if share < MIN_CPU_SHARE_OF_THREADS * busy and rate >= MIN_SWITCHES_PER_S_WITH_LOW_SHARE:
            reasons.append(f"CPU share {share:.2f} with {threads} threads"
                           + (" (waiting passively: one busy)" if passive and threads > 1 else ""))
    if switches is None and steal is None and share is None:
        return None, "no host counters"
    return bool(reasons), "; ".join(reasons)


def cpu_threads() -> int:
    """The torch thread count a CPU sweep pins: the cores this process may run on (stable per
    machine, unlike torch's default that follows physical cores and environment variables)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def parse_peak_rss(proc_status: str) -> int | None:
    """``VmHWM`` (peak resident set size) from /proc/<pid>/status, in bytes."""
    for line in proc_status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window (Linux: writing 5 to /proc/self/clear_refs resets VmHWM to the
    current RSS). False where it cannot: the peak then spans the process's life, so callers drop it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int | None:
    """The process's peak RSS since :func:`reset_peak_rss` (CPU runs' "peak memory": weights, cache,
    activations and the interpreter), or None off Linux."""
    status = _read("/proc/self/status")
    return parse_peak_rss(status) if status else None


# RAPL: the CPU package's energy counter, where the kernel exposes it through powercap. This VM (and
# most cloud VMs) has no /sys/class/powercap, so a CPU run's cost is its CPU time (kvlab.reporting);
# the status below is recorded in every sweep's manifest (kvlab.env.snapshot) so a report can say so.
POWERCAP = "/sys/class/powercap"


def rapl_zones(root: str | Path = POWERCAP) -> dict[str, Path]:
    """Top-level RAPL zones (``intel-rapl:0`` ...; not their subzones) by their ``name`` file
    (``package-0``), each as its folder: ``energy_uj`` and ``max_energy_range_uj`` live there."""
    zones: dict[str, Path] = {}
    base = Path(root)
    if not base.is_dir():
        return zones
    for zone in sorted(base.glob("intel-rapl:*")):
        if zone.name.count(":") != 1 or not (zone / "energy_uj").exists():
            continue
        name = _read(str(zone / "name"))
        zones[(name or zone.name).strip()] = zone
    return zones


def read_rapl_uj(root: str | Path = POWERCAP) -> dict[str, int]:
    """Each readable zone's cumulative energy in microjoules (``energy_uj``; root-only on recent
    kernels, so an unprivileged process often reads nothing)."""
    out = {}
    for name, zone in rapl_zones(root).items():
        text = _read(str(zone / "energy_uj"))
        if text is not None and text.strip().isdigit():
            out[name] = int(text)
    return out


def rapl_delta_j(before: dict[str, int], after: dict[str, int], root: str | Path = POWERCAP) -> dict[str, float]:
    """Joules per zone between two :func:`read_rapl_uj` readings; a counter that wrapped adds its
    ``max_energy_range_uj`` (one wrap: readings must be closer than the range, minutes at full load)."""
    zones = rapl_zones(root)
    out = {}
    for name, b in before.items():
        if name not in after:
            continue
        d = after[name] - b
        if d < 0:
            span = _read(str(zones[name] / "max_energy_range_uj")) if name in zones else None
            if span is None or not span.strip().isdigit():
                continue
            d += int(span)
        out[name] = d / 1e6
    return out


def rapl_status(root: str | Path = POWERCAP) -> str:
    """Whether this machine exposes RAPL energy, in words: 'readable: package-0, dram', 'unreadable:
    package-0 (energy_uj needs root)', or 'none: no /sys/class/powercap' (most VMs)."""
    if not Path(root).is_dir():
        return f"none: no {root}"
    zones = rapl_zones(root)
    if not zones:
        return f"none: no intel-rapl zone in {root}"
    readable = read_rapl_uj(root)
    if readable:
        return "readable: " + ", ".join(readable)
    return "unreadable: " + ", ".join(zones) + " (energy_uj needs root)"
