"""Energy windows on one NVML device: counter totals at the edges, phase splits from the poller."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from kvlab.energy.idle import idle_power
from kvlab.energy.integrate import integrate_hold, integrate_linear, split_energy
from kvlab.energy.poller import FI_POWER_AVERAGE, FI_POWER_INSTANT, POWER_SCOPE_GPU, PowerPoller
from kvlab.energy.window import Window, WindowResult

SOURCE_COUNTER = "nvml-counter"


class NvmlSampler:
    """Energy windows on one NVML device (see :mod:`kvlab.energy` for the channels)."""

    source = SOURCE_COUNTER

    def __init__(self, nvml, handle, *, sync: Callable[[], None], interval_s: float = 0.015,
                 study_interval_s: float = 0.1, clock: Callable[[], float] = time.perf_counter,
                 gpu: dict[str, Any] | None = None):
        if not 0.001 <= interval_s <= 1.0:
            raise ValueError(f"interval_s={interval_s}: poll every 0.01-0.02 s (allowed 0.001-1)")
        self.nvml = nvml
        self.handle = handle
        self._sync = sync
        self._clock = clock
        self.interval_s = interval_s
        self.study_interval_s = study_interval_s
        self.gpu = gpu or {}
        self.field_ids = self._probe_fields()
        self.memory = self._probe(lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used)
        self.temperature = self._probe(lambda: nvml.nvmlDeviceGetTemperature(handle, 0))

    def _probe(self, read) -> bool:
        try:
            read()
            return True
        except Exception:
            return False

    def _probe_fields(self) -> list[int]:
        """The power fields this device answers at GPU scope (instant first; either may be absent)."""
        wanted = [FI_POWER_INSTANT, FI_POWER_AVERAGE]
        try:
            values = self.nvml.nvmlDeviceGetFieldValues(self.handle, [(f, POWER_SCOPE_GPU) for f in wanted])
        except Exception:
            return []
        return [f for f, v in zip(wanted, values, strict=False) if int(v.nvmlReturn) == 0]

    def _counter_j(self) -> float:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0

    def _temperature(self) -> float | None:
        if not self.temperature:
            return None
        try:
            return float(self.nvml.nvmlDeviceGetTemperature(self.handle, 0))
        except Exception:
            return None

    @contextmanager
    def window(self, phase: str = "total"):
        """Measure the block: sync, counter read and t0 on entry; sync, counter read, t1 on exit.

        The polling thread runs only while the window is open and is joined on exit, also when
        the block raises.
        """
        poller = PowerPoller(self.nvml, self.handle, fields=self.field_ids, memory=self.memory,
                             interval_s=self.interval_s, study_interval_s=self.study_interval_s, clock=self._clock)
        temp0 = self._temperature()
        poller.start()
        handle = Window(phase, self._clock, self._sync)
        try:
            self._sync()
            t0 = self._clock()
            start_unix = time.time()
            c0 = self._counter_j()
            handle.phase_edges.append(t0)
            try:
                yield handle
            finally:
                self._sync()
                c1 = self._counter_j()
                t1 = self._clock()
        finally:
            poller.stop()
        handle.result = self._result(handle, t0, t1, c0, c1, poller, temp0, start_unix)

    def _result(self, handle: Window, t0: float, t1: float, c0: float, c1: float, poller: PowerPoller,
                temp0: float | None, start_unix: float) -> WindowResult:
        joules = c1 - c0
        tl = poller.timeline
        inst_t, inst_p = tl.instant
        avg_t, avg_p = tl.average
        pu_t, pu_p = tl.power_usage
        edges = handle.phase_edges + [t1]
        parts = split_energy(joules, inst_t, inst_p, edges)
        names = list(handle.phase_names)
        return WindowResult(
            source=self.source, t0=t0, t1=t1, phase_names=names, phase_edges=list(handle.phase_edges),
            energy_j=joules,
            energy_instant_j=integrate_linear(inst_t, inst_p, t0, t1),
            energy_average_j=integrate_linear(avg_t, avg_p, t0, t1),
            energy_10hz_j=integrate_hold(pu_t, pu_p, t0, t1),
            phase_j=dict(zip(names, parts, strict=True)) if parts else {n: None for n in names},
            peak_mem_nvml_bytes=poller.mem_max if self.memory else None,
            temp_start_c=temp0, temp_end_c=self._temperature(),
            n_samples=poller.n_polls, timeline=tl, start_unix=start_unix, counter_start_j=c0,
        )

    def measure_idle(self, seconds: float, sub_s: float = 1.0) -> float | None:
        """Idle power (W) from this device's counter (:func:`kvlab.energy.idle.idle_power`)."""
        return idle_power(self._counter_j, seconds, sub_s, sync=self._sync, clock=self._clock)

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass
