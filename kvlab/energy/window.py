"""What a measured window is: its phases, its raw samples and its result, whatever the sampler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timeline:
    """Raw samples of one window, on the host ``perf_counter`` clock (seconds, watts, joules)."""

    instant: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    average: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    counter: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    power_usage: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    instant_updates: int = 0

    def relative_to(self, t0: float) -> dict[str, Any]:
        """JSON-safe copy with times relative to ``t0`` (for a timeline sidecar file)."""

        def rel(pair):
            return {"t": [round(t - t0, 6) for t in pair[0]], "v": [round(v, 3) for v in pair[1]]}

        return {
            "instant_w": rel(self.instant),
            "average_w": rel(self.average),
            "counter_j": rel(self.counter),
            "power_usage_w": rel(self.power_usage),
            "instant_updates": self.instant_updates,
        }


@dataclass
class WindowResult:
    """One measured window: host times always, energies when NVML gave them (else None)."""

    source: str
    t0: float
    t1: float
    phase_names: list[str]
    phase_edges: list[float]
    energy_j: float | None = None
    energy_instant_j: float | None = None
    energy_average_j: float | None = None
    energy_10hz_j: float | None = None
    phase_j: dict[str, float | None] = field(default_factory=dict)
    peak_mem_nvml_bytes: int | None = None
    temp_start_c: float | None = None
    temp_end_c: float | None = None
    n_samples: int = 0
    timeline: Timeline | None = None
    # where the window sits on the wall clock and on the GPU's cumulative counter, so a sweep's
    # windows can be laid against per-GPU counter readings (kvlab.analysis.attribution)
    start_unix: float | None = None
    counter_start_j: float | None = None

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0

    def phase_s(self) -> dict[str, float]:
        edges = self.phase_edges + [self.t1]
        return {n: edges[k + 1] - edges[k] for k, n in enumerate(self.phase_names)}


class WindowError(ValueError):
    """A window was misused (marked after it closed, or a phase name repeated)."""


class Window:
    """Handle for an open window: ``mark(name)`` starts the next phase; ``result`` after close."""

    def __init__(self, first_phase: str, clock: Callable[[], float], sync: Callable[[], None]):
        self._clock = clock
        self._sync = sync
        self.phase_names = [first_phase]
        self.phase_edges: list[float] = []
        self.result: WindowResult | None = None

    def mark(self, name: str) -> float:
        """Synchronize, then start phase ``name`` now; returns the host time of the boundary."""
        if self.result is not None:
            raise WindowError(f"window already closed; mark {name!r} inside the `with` block")
        if name in self.phase_names:
            raise WindowError(f"phase {name!r} already marked; phases: {self.phase_names}")
        self._sync()
        t = self._clock()
        self.phase_names.append(name)
        self.phase_edges.append(t)
        return t
