"""Every confidence interval kvlab prints: a mean's, a ratio of two groups' means, and their text.

The rules, one place for records, reports and benchmarks:

- Fewer than 3 values on a side give no interval: the value is printed with ``n=2`` beside it. A
  bootstrap of 2 values returns their range (every resampled mean is a, b or their midpoint), which
  reads as a 95% interval and is none.
- A mean: Student's t-interval (``t``), or BCa bootstrap (``bca``) for n >= 5 when asked.
- A ratio of means ``mean(x) / mean(b)``: a Welch t-interval on the log of the ratio (``welch-log``:
  delta-method variance ``s_x^2 / (n_x mean_x^2) + s_b^2 / (n_b mean_b^2)``, Welch-Satterthwaite
  degrees of freedom, bounds exponentiated), or BCa bootstrap resampling each group apart (``bca``)
  for n >= 5 a side when asked. The point value is the ratio of the means in both.

Every result names its method (``Interval.method``) so the printed text can say which.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

MIN_T = 3  # the fewest values a side for any interval
MIN_BCA = 5  # the fewest values a side for a bootstrap interval
METHODS = ("auto", "t", "welch-log", "bca")


@dataclass(frozen=True)
class Interval:
    """A value, its bounds (NaN when there is none), the count per side and how the bounds were made
    (``t``, ``welch-log``, ``bca``, ``percentile`` or ``none``)."""

    value: float
    lo: float
    hi: float
    n: tuple[int, ...]
    method: str
    level: float = 0.95

    @property
    def has_bounds(self) -> bool:
        return not (math.isnan(self.lo) or math.isnan(self.hi))

    def as_tuple(self) -> tuple[float, float, float]:
        return self.value, self.lo, self.hi

    def n_text(self) -> str:
        """``n=2`` or ``n=2/5`` (a ratio's sides)."""
        return "n=" + "/".join(str(k) for k in self.n)

    def text(self, digits: int = 3, scale: float = 1.0) -> str:
        """``0.484 [0.441, 0.531] (welch-log, n=5/5)``, or ``0.484 (n=2)`` without bounds."""
        if math.isnan(self.value):
            return "n/a"
        v = f"{self.value * scale:.{digits}f}"
        if not self.has_bounds:
            return f"{v} ({self.n_text()})"
        return f"{v} [{self.lo * scale:.{digits}f}, {self.hi * scale:.{digits}f}] ({self.method}, {self.n_text()})"

    def to_dict(self) -> dict:
        """JSON fields for a benchmark's output: value, lo, hi (None without bounds), n, method."""
        def num(x: float):
            return None if math.isnan(x) else float(x)

        return {"value": num(self.value), "lo": num(self.lo), "hi": num(self.hi), "n": list(self.n),
                "method": self.method, "level": self.level}


def clean(values: Sequence[float] | None) -> np.ndarray:
    """The finite values as a float array (None, NaN and inf dropped)."""
    if values is None:
        return np.zeros(0)
    x = np.asarray([np.nan if v is None else v for v in values], dtype=float)
    return x[np.isfinite(x)]


# ---------------------------------------------------------------- distributions (no scipy)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        step = d * c
        h *= step
        if abs(step - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student's t distribution function."""
    if math.isinf(df):
        return NormalDist().cdf(t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile (bisection on :func:`t_cdf`; df may be fractional, as Welch's is)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), not {p}")
    if math.isinf(df) or df > 1e7:
        return NormalDist().inv_cdf(p)
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# ---------------------------------------------------------------- a mean


def mean_interval(values: Sequence[float], level: float = 0.95, method: str = "auto",
                  n_boot: int = 4000, seed: int = 0) -> Interval:
    """The mean of ``values`` (non-finite dropped) with a t-interval (``auto``, ``t``) or BCa (``bca``,
    n >= 5); no bounds below 3 values (or below 5 for ``bca``)."""
    _check_method(method)
    x = clean(values)
    n = int(x.size)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, (0,), "none", level)
    mean = float(x.mean())
    if method == "bca":
        if n < MIN_BCA:
            return Interval(mean, math.nan, math.nan, (n,), "none", level)
        lo, hi = _bca([x], lambda groups: groups[0].mean(axis=-1), level, n_boot, seed)
        return Interval(mean, lo, hi, (n,), "bca", level)
    if n < MIN_T:
        return Interval(mean, math.nan, math.nan, (n,), "none", level)
    half = t_quantile(0.5 + level / 2, n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, (n,), "t", level)


# ---------------------------------------------------------------- a ratio of two means


def ratio_interval(values: Sequence[float], baseline: Sequence[float], level: float = 0.95,
                   method: str = "auto", n_boot: int = 4000, seed: int = 0) -> Interval:
    """``mean(values) / mean(baseline)`` with a Welch t-interval on its log (``auto``,
    ``welch-log``; n >= 3 a side) or BCa bootstrap (``bca``; n >= 5 a side). NaN when a side is
    empty or a mean is not positive (a log ratio needs positive means)."""
    _check_method(method)
    x, b = clean(values), clean(baseline)
    n = (int(x.size), int(b.size))
    if x.size == 0 or b.size == 0 or b.mean() == 0:
        return Interval(math.nan, math.nan, math.nan, n, "none", level)
    ratio = float(x.mean() / b.mean())
    if method == "bca":
        if min(n) < MIN_BCA or x.mean() <= 0 or b.mean() <= 0:
            return Interval(ratio, math.nan, math.nan, n, "none", level)
        lo, hi = _bca([x, b], lambda g: g[0].mean(axis=-1) / g[1].mean(axis=-1), level, n_boot, seed)
        return Interval(ratio, lo, hi, n, "bca", level)
    if min(n) < MIN_T or x.mean() <= 0 or b.mean() <= 0:
        return Interval(ratio, math.nan, math.nan, n, "none", level)
    lo, hi = welch_log_bounds(x, b, level)
    return Interval(ratio, lo, hi, n, "welch-log", level)


def welch_log_bounds(x: np.ndarray, b: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Bounds of ``mean(x)/mean(b)`` from a Welch t-interval on the log ratio (delta method)."""
    return _log_product_bounds([x, b], [1.0, -1.0], level)


def product_interval(groups: Sequence[Sequence[float]], powers: Sequence[float], level: float = 0.95) -> Interval:
    """``prod(mean(g) ** p)`` over independent groups (a ratio is powers 1, -1; a stack's interaction
    ``s·b / (w·c)`` is 1, 1, -1, -1) with the Welch t-interval on its log (``welch-log``: each log
    mean's delta-method variance, Welch-Satterthwaite degrees of freedom); no bounds below 3 values
    in any group, NaN when a group is empty or its mean is not positive."""
    gs = [clean(g) for g in groups]
    n = tuple(int(g.size) for g in gs)
    if any(g.size == 0 or g.mean() <= 0 for g in gs):
        return Interval(math.nan, math.nan, math.nan, n, "none", level)
    value = float(np.prod([float(g.mean()) ** p for g, p in zip(gs, powers, strict=True)]))
    if min(n) < MIN_T:
        return Interval(value, math.nan, math.nan, n, "none", level)
    lo, hi = _log_product_bounds(gs, powers, level)
    return Interval(value, lo, hi, n, "welch-log", level)


def _log_product_bounds(gs: Sequence[np.ndarray], powers: Sequence[float], level: float) -> tuple[float, float]:
    log_value = sum(p * math.log(float(g.mean())) for g, p in zip(gs, powers, strict=True))
    parts = [p * p * float(g.var(ddof=1)) / (g.size * float(g.mean()) ** 2) for g, p in zip(gs, powers, strict=True)]
    se2 = sum(parts)
    if se2 == 0:
        return math.exp(log_value), math.exp(log_value)
    df = se2 ** 2 / sum(v * v / (g.size - 1) for v, g in zip(parts, gs, strict=True))
    half = t_quantile(0.5 + level / 2, df) * math.sqrt(se2)
    return math.exp(log_value - half), math.exp(log_value + half)


# ---------------------------------------------------------------- a bootstrap done elsewhere


def percentile_interval(value: float, draws: Sequence[float], units: int, level: float = 0.95) -> Interval:
    """``value`` with the percentile bounds of its bootstrap ``draws`` (a statistic recomputed over
    ``units`` resampled units, e.g. a workload's requests resampled together for every method, so
    ratios stay paired); no bounds below :data:`MIN_BCA` units (a bootstrap of 2 units returns their
    range) or with fewer than 2 finite draws."""
    d = clean(draws)
    if units < MIN_BCA or d.size < 2:
        return Interval(value, math.nan, math.nan, (units,), "none", level)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(d, [alpha, 1.0 - alpha])
    return Interval(value, float(lo), float(hi), (units,), "percentile", level)


# ---------------------------------------------------------------- BCa bootstrap


def _bca(groups: list[np.ndarray], stat, level: float, n_boot: int, seed: int) -> tuple[float, float]:
    """BCa bounds of ``stat`` over independent groups (each resampled apart; Efron & Tibshirani
    1993, ch. 14): bias from the share of resampled statistics below the estimate, acceleration from
    each group's jackknife."""
    rng = np.random.default_rng(seed)
    theta = float(stat([g for g in groups]))
    boots = stat([g[rng.integers(0, g.size, size=(n_boot, g.size))] for g in groups])
    below = float(np.mean(boots < theta)) + 0.5 * float(np.mean(boots == theta))
    below = min(max(below, 1.0 / (n_boot + 1)), n_boot / (n_boot + 1))
    normal = NormalDist()
    z0 = normal.inv_cdf(below)
    num, den = 0.0, 0.0
    for k, g in enumerate(groups):
        loo = np.array([stat([np.delete(g, i) if j == k else other for j, other in enumerate(groups)])
                        for i in range(g.size)], dtype=float)
        u = loo.mean() - loo
        num += float((u ** 3).sum()) / g.size ** 3
        den += float((u ** 2).sum()) / g.size ** 2
    accel = num / (6.0 * den ** 1.5) if den > 0 else 0.0
    alpha = (1.0 - level) / 2.0
    qs = []
    for a in (alpha, 1.0 - alpha):
        z = normal.inv_cdf(a)
        qs.append(normal.cdf(z0 + (z0 + z) / (1.0 - accel * (z0 + z))))
    lo, hi = np.quantile(boots, qs)
    return float(lo), float(hi)


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"interval method {method!r} is not one of {', '.join(METHODS)}")
