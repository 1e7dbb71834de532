"""Capacity from measured peaks: where a sequence's memory goes, and how many sequences fit.

Why: peak memory grows linearly with the batch (weights + fixed overhead, plus a per-sequence
slope), so two measured peaks predict the largest batch a card holds. The slope is what a sequence
really costs; its kept cache (``cache_bytes / batch``) is only part of it, the rest being the
prefill's transients (activations, K/V not yet evicted or quantized). On the fast engine with row
groups (``prefill_rows``) the transients of one group are a constant, in the intercept, so the slope
should be the kept cache plus the static store's new-token slots and the transients per sequence
about zero; a small negative from noise is kept as measured, never clipped. Pure functions: the
benchmark (``benchmarks/capacity.py``) measures, these do the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PeakLine:
    """``peak(batch) = intercept + slope x batch`` in bytes, fitted to measured peaks."""

    intercept: float
    slope: float
    points: int

    def peak(self, batch: int) -> float:
        return self.intercept + self.slope * batch


def fit_peaks(points: Sequence[tuple[int, float]]) -> PeakLine:
    """Least-squares line through ``(batch, peak bytes)``; needs two distinct batches."""
    batches = {b for b, _ in points}
    if len(batches) < 2:
        raise ValueError(f"fitting a peak line needs peaks at two batch sizes at least, got batches {sorted(batches)}")
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_p = sum(p for _, p in points) / n
    slope = sum((b - mean_b) * (p - mean_p) for b, p in points) / sum((b - mean_b) ** 2 for b, _ in points)
    return PeakLine(mean_p - slope * mean_b, slope, n)


def max_batch(line: PeakLine, usable_bytes: float) -> int | None:
    """The largest batch whose predicted peak fits in ``usable_bytes`` (None if the slope is not
    positive: the measurement cannot tell, e.g. a CPU's noisy peak RSS)."""
    if line.slope <= 0:
        return None
    return max(0, math.floor((usable_bytes - line.intercept) / line.slope))


def cap_for_batch(line: PeakLine, batch: int) -> float:
    """The memory at which ``line`` predicts ``batch`` as the largest batch: halfway between its
    peaks at ``batch`` and ``batch + 1`` (on a full device the room above the predicted batch's peak
    falls anywhere in ``[0, slope)``; half a sequence is its middle). A confirm run under this cap
    checks the line where the whole device would take too long to fill."""
    if line.slope <= 0 or batch < 1:
        raise ValueError(f"a memory cap needs a positive slope and a batch >= 1, got slope {line.slope}, "
                         f"batch {batch}")
    return line.peak(batch) + line.slope / 2


@dataclass(frozen=True)
class SequenceSplit:
    """Where the memory goes: shared (weights, fixed overhead) and per sequence (kept cache, the
    static store's new-token slots, transients)."""

    weights_bytes: float
    fixed_bytes: float  # intercept - weights: the CUDA context share torch sees, workspaces, buffers
    per_sequence_bytes: float  # the slope
    kept_cache_bytes: float  # per sequence, after prefill
    transient_bytes: float  # per sequence: slope - kept cache - new-token slots (signed: noise stays)
    new_token_slots_bytes: float = 0.0  # per sequence: a static store's room for the generated tokens

    @property
    def transient_share(self) -> float | None:
        """Transients as a share of the slope (None without a positive slope)."""
        return self.transient_bytes / self.per_sequence_bytes if self.per_sequence_bytes > 0 else None

    def as_dict(self) -> dict[str, float | None]:
        return {**asdict(self), "transient_share": self.transient_share}


def split_sequence(line: PeakLine, weights_bytes: float, kept_cache_bytes: float,
                   allocated_cache_bytes: float | None = None) -> SequenceSplit:
    """Split the slope. ``allocated_cache_bytes`` (per sequence; the fast engine's static store,
    kept tokens + new-token slots): its part above the kept cache is counted as slots, not transients.
    The transients are what is left, signed: a slope a little under the kept cache (noise in the
    peaks) gives a small negative, reported as it is."""
    slots = 0.0 if allocated_cache_bytes is None else allocated_cache_bytes - kept_cache_bytes
    return SequenceSplit(weights_bytes, line.intercept - weights_bytes, line.slope, kept_cache_bytes,
                         line.slope - kept_cache_bytes - slots, slots)


def above(batch: int, fraction: float = 0.02) -> int:
    """A batch just above ``batch`` (by ``fraction``, at least one more) that should not fit."""
    return batch + max(1, math.ceil(batch * fraction))


def compression_step_cost(itl_ms: Sequence[float], interval: int) -> dict[str, float | list[float] | None]:
    """What decode-time compression (``decoding``) costs per eviction, from one run's ITLs.

    Decode step ``k x interval`` (0-based, ``itl_ms[k x interval]``) starts with the eviction check
    (:mod:`kvlab.policies.decoding`); returns those steps' ITLs, the median of all other steps and
    the mean extra milliseconds an eviction step took over it (steps where the cache was still
    under its target evict nothing and pull the mean down: read ``at_interval_ms`` too).
    """
    import statistics

    marks = [k for k in range(interval, len(itl_ms), interval)]
    others = [t for i, t in enumerate(itl_ms) if i not in set(marks)]
    if not marks or not others:
        return {"at_interval_ms": [], "other_median_ms": None, "extra_ms": None}
    base = statistics.median(others)
    at = [itl_ms[k] for k in marks]
    return {"at_interval_ms": at, "other_median_ms": base, "extra_ms": statistics.fmean(at) - base}
