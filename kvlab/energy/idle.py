"""Idle power from the energy counter: the baseline a run's net energy subtracts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def median_power(ts: Sequence[float], joules: Sequence[float]) -> float | None:
    """Median of dE/dt over consecutive (time, cumulative energy) readings: a robust idle power."""
    rates = [(joules[k + 1] - joules[k]) / (ts[k + 1] - ts[k]) for k in range(len(ts) - 1) if ts[k + 1] > ts[k]]
    return statistics.median(rates) if rates else None


def idle_power(read_counter_j: Callable[[], float], seconds: float, sub_s: float = 1.0, *,
               sync: Callable[[], None], clock: Callable[[], float]) -> float | None:
    """Idle power (W) with whatever is resident now and no kernels: median dE/dt over ``sub_s``
    sub-windows of the counter (a single window when ``seconds < 2 * sub_s``)."""
    if seconds <= 0:
        return None
    sync()
    n = max(1, int(seconds // sub_s)) if seconds >= 2 * sub_s else 1
    step = seconds / n
    ts, js = [clock()], [read_counter_j()]
    for _ in range(n):
        time.sleep(max(0.0, ts[0] + step * len(ts) - clock()))
        ts.append(clock())
        js.append(read_counter_j())
    return median_power(ts, js)
