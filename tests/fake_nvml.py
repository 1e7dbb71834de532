"""A fake NVML module with a known power trace, for testing kvlab.energy without a GPU.

Power is piecewise constant in time since the fake's origin (its creation, or ``history_s``
before it; no power before that); the energy counter is its exact
integral (optionally updated only every ``counter_period_s``, like the ~100 ms hardware counter),
and the averaged channels are 1 s trailing means of the same trace.
"""

from __future__ import annotations

import bisect
import time
from types import SimpleNamespace


class FakeNVMLError(Exception):
    pass


class FakeNvml:
    NVMLError = FakeNVMLError
    NVML_FI_DEV_POWER_AVERAGE = 185
    NVML_FI_DEV_POWER_INSTANT = 186

    def __init__(self, segments=((0.0, 100.0),), uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"),
                 counter_period_s: float = 0.0, init_error: str | None = None,
                 counter_error: str | None = None, fields_supported: bool = True,
                 memory_used: int = 5 * 2**30, history_s: float = 0.0, clock=time.perf_counter):
        self.clock = clock
        self.origin = clock() - history_s  # the trace started history_s ago
        self.starts = [float(s) for s, _ in segments]
        self.watts = [float(w) for _, w in segments]
        self.uuids = list(uuids)
        self.counter_period_s = counter_period_s
        self.init_error = init_error
        self.counter_error = counter_error
        self.fields_supported = fields_supported
        self.memory_used = memory_used
        self.inits = 0
        self.calls: dict[str, int] = {}

    # --- the known trace ------------------------------------------------------------------
    def rel(self, t: float) -> float:
        return t - self.origin

    def power_at(self, t: float) -> float:
        """Watts at host time ``t`` (perf_counter clock)."""
        i = bisect.bisect_right(self.starts, self.rel(t)) - 1
        return self.watts[max(i, 0)]

    def energy_until(self, t: float) -> float:
        """Exact joules from the origin to host time ``t``."""
        r = self.rel(t)
        total = 0.0
        for k, start in enumerate(self.starts):
            end = self.starts[k + 1] if k + 1 < len(self.starts) else float("inf")
            if r <= start:
                break
            total += self.watts[k] * (min(r, end) - max(start, 0.0))
        return total

    def energy_between(self, a: float, b: float) -> float:
        return self.energy_until(b) - self.energy_until(a)

    # --- NVML API --------------------------------------------------------------------------
    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def nvmlInit(self):
        self._count("init")
        if self.init_error:
            raise FakeNVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self):
        self._count("shutdown")
        self.inits -= 1

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetUUID(self, handle):
        return self.uuids[handle[1]]

    def nvmlDeviceGetName(self, handle):
        return "Fake H200"

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 700_000

    def nvmlSystemGetDriverVersion(self):
        return "580.95.05"

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):
        return {1: 1980, 2: 3201}[clock]

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self._count("counter")
        if self.counter_error:
            raise FakeNVMLError(self.counter_error)
        t = self.clock()
        if self.counter_period_s:
            r = self.rel(t)
            t = self.origin + (r // self.counter_period_s) * self.counter_period_s
        return int(round(self.energy_until(t) * 1000))

    def _average(self, t):
        return self.energy_between(t - 1.0, t) / 1.0

    def nvmlDeviceGetPowerUsage(self, handle):
        self._count("power_usage")
        return int(round(self._average(self.clock()) * 1000))

    def nvmlDeviceGetFieldValues(self, handle, field_ids):
        self._count("fields")
        t = self.clock()
        out = []
        for fid in field_ids:
            fid = fid[0] if isinstance(fid, tuple) else fid
            watts = self.power_at(t) if fid == 186 else self._average(t)
            out.append(SimpleNamespace(
                fieldId=fid, nvmlReturn=0 if self.fields_supported else 3, valueType=1,
                timestamp=int(t * 1e6), value=SimpleNamespace(uiVal=int(round(watts * 1000))),
            ))
        return out

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=self.memory_used, total=141 * 2**30, free=0)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 41
