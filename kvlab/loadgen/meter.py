"""A cumulative counter sampled beside a replay: the local GPU's NVML energy (J) or a server's CPU
time (s, its processes and their children), read at ``interval_s`` so any window chosen after the
run (the steady state) gets its share by interpolation between the readings at its edges."""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable

import psutil

from kvlab.card import card_from_gpu, cpu_card
from kvlab.energy import make_sampler
from kvlab.energy.nvml_sampler import NvmlSampler


class CounterReader:
    """``read()`` gives the counter now; ``unit`` is ``"J"`` (energy) or ``"cpu_s"`` (CPU time);
    ``source`` says what is counted; ``card``: :mod:`kvlab.card`'s fields of what is counted."""

    def __init__(self, read: Callable[[], float], unit: str, source: str, card: dict | None = None):
        self.read, self.unit, self.source = read, unit, source
        self.card = card


def nvml_reader(device: str = "cuda:0", *, nvml=None, uuid: str | None = None) -> CounterReader | None:
    """The local GPU's energy counter, or None where NVML cannot read one (``nvml``, ``uuid``: as
    :func:`kvlab.energy.make_sampler` takes them)."""
    sampler = make_sampler(device, nvml=nvml, uuid=uuid, sync=lambda: None)
    if not isinstance(sampler, NvmlSampler):
        return None
    nvml, handle = sampler.nvml, sampler.handle
    return CounterReader(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0, "J",
                         f"nvml-counter {sampler.gpu.get('gpu_name') or device}", card_from_gpu(sampler.gpu))


def cpu_time_reader(pid: int) -> CounterReader:
    """User + system CPU seconds of process ``pid`` and its living children (a server's workers).
    A child that exits mid-run takes its seconds with it: read only while the server is steady."""
    root = psutil.Process(pid)

    def read() -> float:
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            try:
                t = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total

    return CounterReader(read, "cpu_s", f"cpu-time pid {pid} and children", cpu_card())


class CounterTrace:
    """Readings ``(t, value)`` on ``time.perf_counter``, taken by :meth:`run` until cancelled."""

    def __init__(self, reader: CounterReader, interval_s: float = 0.1):
        self.reader, self.interval_s = reader, interval_s
        self.ts: list[float] = []
        self.values: list[float] = []

    def sample(self) -> None:
        self.ts.append(time.perf_counter())
        self.values.append(self.reader.read())

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def at(self, t: float) -> float | None:
        """The counter at ``t`` by linear interpolation; None outside the readings."""
        i = bisect.bisect_left(self.ts, t)
        if i < len(self.ts) and self.ts[i] == t:
            return self.values[i]
        if i == 0 or i == len(self.ts):
            return None
        t0, t1 = self.ts[i - 1], self.ts[i]
        v0, v1 = self.values[i - 1], self.values[i]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0)

    def delta(self, t0: float, t1: float) -> float | None:
        a, b = self.at(t0), self.at(t1)
        return None if a is None or b is None else b - a
