"""Pure math over sampled power timelines (seconds, watts, joules): integrals and phase splits."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def _value_at(ts: Sequence[float], ps: Sequence[float], t: float) -> float:
    """Linear interpolation inside the samples, held flat beyond the first and last."""
    i = bisect.bisect_right(ts, t)
    if i == 0:
        return ps[0]
    if i >= len(ts):
        return ps[-1]
    t_a, t_b = ts[i - 1], ts[i]
    if t_b == t_a:
        return ps[i]
    return ps[i - 1] + (ps[i] - ps[i - 1]) * (t - t_a) / (t_b - t_a)


def integrate_linear(ts: Sequence[float], ps: Sequence[float], t0: float, t1: float) -> float | None:
    """Integral of the piecewise-linear curve through (ts, ps) over [t0, t1] (exact trapezoid).

    Used for instant power: between polls power is taken to change linearly, and the window edges
    are interpolated rather than snapped to the nearest poll.
    """
    if not ts or t1 < t0:
        return None
    points = [t0] + [t for t in ts if t0 < t < t1] + [t1]
    values = [_value_at(ts, ps, t) for t in points]
    return sum((points[k + 1] - points[k]) * (values[k] + values[k + 1]) / 2 for k in range(len(points) - 1))


def integrate_hold(ts: Sequence[float], ps: Sequence[float], t0: float, t1: float) -> float | None:
    """Integral with each sample held until the next one (what a 10 Hz poller sums as P * 0.1 s).

    Before the first sample the first value is used, so a window shorter than the poll period
    still gets the reading taken just before it.
    """
    if not ts or t1 < t0:
        return None
    points = [t0] + [t for t in ts if t0 < t < t1] + [t1]
    total = 0.0
    for a, b in zip(points[:-1], points[1:], strict=True):
        total += ps[max(bisect.bisect_right(ts, a) - 1, 0)] * (b - a)
    return total


def split_energy(
    total_j: float, ts: Sequence[float], ps: Sequence[float], edges: Sequence[float]
) -> list[float] | None:
    """Apportion a counter total between consecutive phases by each phase's share of integral(P).

    ``edges`` are the phase boundaries ``[t0, t_1, ..., t_end]``; the result has one entry per
    phase and sums to ``total_j``. None when power was not sampled or integrates to zero.
    """
    if len(edges) < 2 or not ts:
        return None
    parts = [integrate_linear(ts, ps, a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    whole = sum(p for p in parts if p is not None)
    if any(p is None for p in parts) or whole <= 0:
        return None
    return [total_j * p / whole for p in parts]
