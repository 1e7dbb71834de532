"""Text forms of summary values (a CI, a runs count, a context length, the baseline's label).

Apart from :mod:`kvlab.plots` so that the tables, and ``python -m kvlab.analysis.executors`` on a GPU
box without the notebook stack, need pandas only, not plotly.
"""

from __future__ import annotations

import math

import pandas as pd


def is_baseline_label(label: str) -> bool:
    return label == "full" or label.endswith("(full)")


def fmt_ctx(ctx: float) -> str:
    ctx = int(ctx)
    return f"{ctx // 1024}k" if ctx >= 1024 and ctx % 1024 == 0 else f"{ctx:,}"


def runs_text(summary: pd.DataFrame) -> list:
    """A summary's runs column: ``n``, or '3 (2 contended)' where runs were measured while other
    processes took the CPU (``n_contended``)."""
    busy = summary["n_contended"] if "n_contended" in summary.columns else pd.Series(0, index=summary.index)
    if not busy.fillna(0).astype(int).gt(0).any():
        return [int(n) for n in summary["n"]]
    return [f"{int(n)} ({int(c)} contended)" if c else str(int(n))
            for n, c in zip(summary["n"], busy.fillna(0), strict=True)]


def ci_text(v, lo, hi, n=None) -> str:
    """``v [lo, hi]``; without bounds ``v (n=2)`` when the count is known (fewer than 3 runs give no
    interval, :mod:`kvlab.intervals`), else ``v``."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    digits = 3 if abs(v) < 10 else 1
    if lo is None or hi is None or (isinstance(lo, float) and math.isnan(lo)):
        return f"{v:.{digits}f}" + (f" (n={int(n)})" if n is not None and not pd.isna(n) else "")
    return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"
