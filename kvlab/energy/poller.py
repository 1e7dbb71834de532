"""The power-polling thread of one NVML window: instant and averaged power, the counter, memory."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvlab.energy.window import Timeline

THREAD_NAME = "kvlab-energy-sampler"

FI_POWER_AVERAGE = 185  # NVML_FI_DEV_POWER_AVERAGE (mW, 1 s average)
FI_POWER_INSTANT = 186  # NVML_FI_DEV_POWER_INSTANT (mW)
POWER_SCOPE_GPU = 0  # NVML_POWER_SCOPE_GPU

# nvmlValueType_t -> the member of the nvmlValue_t union that holds the number
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _field_value(fv) -> float:
    """The number inside an ``nvmlFieldValue_t`` whatever its value type."""
    member = _VALUE_MEMBERS.get(int(fv.valueType), "ullVal")
    return float(getattr(fv.value, member))


class PowerPoller:
    """The background thread of one window: polls the power ``fields`` (NVML field ids), the
    counter and (when ``memory``) used memory every ``interval_s``, and ``nvmlDeviceGetPowerUsage``
    every ``study_interval_s``; stops (and joins) on ``stop()``."""

    def __init__(self, nvml, handle, *, fields: list[int], memory: bool, interval_s: float,
                 study_interval_s: float, clock: Callable[[], float]):
        self.nvml = nvml
        self.handle = handle
        self.field_ids = fields
        self.fields = [(f, POWER_SCOPE_GPU) for f in fields]
        self.memory = memory
        self.interval_s = interval_s
        self.study_interval_s = study_interval_s
        self.clock = clock
        self.timeline = Timeline()
        self.mem_max = 0
        self.n_polls = 0
        self._last_ts: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._next_study = 0.0

    def start(self) -> None:
        self.safe_poll(study=True)  # a sample before t0, so the window's first edge interpolates
        self._next_study = self.clock() + self.study_interval_s
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.safe_poll(study=True)  # and one after t1

    def safe_poll(self, study: bool) -> None:
        try:
            self.poll(study=study)
        except Exception:  # a failing NVML read must never kill the measured run
            pass

    def _run(self) -> None:
        interval = self.interval_s
        next_t = self.clock() + interval
        while not self._stop.wait(max(0.0, next_t - self.clock())):
            now = self.clock()
            study = now >= self._next_study
            if study:
                self._next_study = max(self._next_study + self.study_interval_s, now)
            self.safe_poll(study=study)
            next_t = max(next_t + interval, self.clock())

    def poll(self, study: bool) -> None:
        nv, tl = self.nvml, self.timeline
        if self.fields:
            values = nv.nvmlDeviceGetFieldValues(self.handle, self.fields)
            now = self.clock()
            for fid, fv in zip(self.field_ids, values, strict=False):
                if int(fv.nvmlReturn) != 0:
                    continue
                watts = _field_value(fv) / 1000.0
                series = tl.instant if fid == FI_POWER_INSTANT else tl.average
                series[0].append(now)
                series[1].append(watts)
                if fid == FI_POWER_INSTANT and int(fv.timestamp) != self._last_ts:
                    self._last_ts = int(fv.timestamp)
                    tl.instant_updates += 1
        joules = nv.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0
        now = self.clock()
        if not tl.counter[1] or tl.counter[1][-1] != joules:
            tl.counter[0].append(now)
            tl.counter[1].append(joules)
        if study:
            watts = nv.nvmlDeviceGetPowerUsage(self.handle) / 1000.0
            tl.power_usage[0].append(self.clock())
            tl.power_usage[1].append(watts)
        if self.memory:
            self.mem_max = max(self.mem_max, int(nv.nvmlDeviceGetMemoryInfo(self.handle).used))
        self.n_polls += 1
