"""The sampler of a machine without NVML energy: host timings only, energies None, reason kept."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from kvlab.energy.window import Window, WindowResult


class NullSampler:
    """Sampler for machines without NVML energy: host timings only, energies None, reason kept."""

    def __init__(self, reason: str, sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.source = reason if reason.startswith("none") else f"none: {reason}"
        self._sync = sync or (lambda: None)
        self._clock = clock
        self.gpu: dict[str, Any] = {}

    @contextmanager
    def window(self, phase: str = "total"):
        self._sync()
        handle = Window(phase, self._clock, self._sync)
        handle.phase_edges.append(self._clock())
        start_unix = time.time()
        try:
            yield handle
        finally:
            self._sync()
            t1 = self._clock()
            handle.result = WindowResult(
                self.source, handle.phase_edges[0], t1, list(handle.phase_names), list(handle.phase_edges),
                phase_j={n: None for n in handle.phase_names}, start_unix=start_unix,
            )

    def measure_idle(self, seconds: float, sub_s: float = 1.0) -> float | None:
        return None

    def close(self) -> None:
        pass
