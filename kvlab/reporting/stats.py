"""Statistics of the report: the one bootstrap CI (:func:`kvlab.metrics.bootstrap_ci`), a ratio
of means with its CI, and per-group summaries formatted as ``mean [lo, hi]``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from kvlab.metrics import bootstrap_ci
from kvlab.reporting.frames import contended_mask
from kvlab.reporting.text import ci_text, is_baseline_label, runs_text


def ratio_ci(values: Sequence[float], baseline: Sequence[float], n_boot: int = 2000,
             level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of means (values / baseline) with a bootstrap CI resampling both groups independently;
    no CI (NaN bounds) when either group has one value: resampling one run says nothing of its
    spread, and the CI would read far narrower than it is (such as "0.39 [0.39, 0.39]")."""
    x = np.asarray(values, dtype=float)
    b = np.asarray(baseline, dtype=float)
    x, b = x[~np.isnan(x)], b[~np.isnan(b)]
    if x.size == 0 or b.size == 0 or b.mean() == 0:
        return math.nan, math.nan, math.nan
    ratio = float(x.mean() / b.mean())
    if x.size < 2 or b.size < 2:
        return ratio, math.nan, math.nan
    rng = np.random.default_rng(seed)
    xm = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    bm = b[rng.integers(0, b.size, size=(n_boot, b.size))].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(xm / bm, [alpha, 1 - alpha])
    return ratio, float(lo), float(hi)


def method_summary(records: pd.DataFrame, metrics: Sequence[str], by: Sequence[str] = ("label",),
                   n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """One row per group: ``n`` runs and, per metric, the mean with ``_lo``/``_hi`` bootstrap bounds;
    ``n_contended`` counts runs flagged contended when the records say (their times are suspect)."""
    by = list(by)
    metrics = [m for m in metrics if m in records.columns]
    busy = contended_mask(records) if "contended" in records.columns else None
    rows = []
    for keys, part in records.groupby(by, sort=False, dropna=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        row: dict[str, Any] = dict(zip(by, keys, strict=True))
        row["n"] = len(part)
        if busy is not None:
            row["n_contended"] = int(busy[part.index].sum())
        for m in metrics:
            row[m], row[f"{m}_lo"], row[f"{m}_hi"] = bootstrap_ci(
                pd.to_numeric(part[m], errors="coerce"), n_boot, level, seed)
        rows.append(row)
    cols = by + ["n"] + (["n_contended"] if busy is not None else []) + [
        f"{m}{s}" for m in metrics for s in ("", "_lo", "_hi")]
    return reading_order(pd.DataFrame(rows, columns=cols))


def reading_order(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in reading order: the full cache first, then labels alphabetically, then ctx, batch."""
    keys = [c for c in ("model", "task") if c in df.columns]
    if "label" in df.columns:
        df = df.assign(_base=~df["label"].astype(str).map(is_baseline_label), _label=df["label"].astype(str))
        keys += ["_base", "_label"]
    elif "method" in df.columns:
        df = df.assign(_base=df["method"] != "full")
        keys += ["_base", "method"]
    keys += [c for c in ("keep", "ctx", "batch") if c in df.columns]
    if not keys or df.empty:
        return df.drop(columns=["_base", "_label"], errors="ignore")
    return (df.sort_values(keys, kind="stable").drop(columns=["_base", "_label"], errors="ignore")
            .reset_index(drop=True))



def format_ci(summary: pd.DataFrame, columns: dict[str, str], key: str | None = "label",
              keys: Sequence[str] = ()) -> pd.DataFrame:
    """The summary as display strings ``mean [lo, hi]`` under readable headers; ``keys`` (e.g. ctx,
    batch) follow the method (no method column with ``key=None``). A row with no ok run and a
    ``status`` (``failed: OOM``) shows it in every metric cell: a failed configuration stays visible."""
    out = pd.DataFrame({"method": summary[key].astype(str)} if key else {}, index=summary.index)
    for k in keys:
        if k in summary.columns:
            out[k] = summary[k].to_numpy()
    out["runs"] = runs_text(summary)
    records = summary.to_dict("records")
    failed = [r["n"] == 0 and str(r.get("status", "")).startswith("failed") for r in records]
    if "status" in summary.columns and any(str(v) != "ok" for v in summary["status"]):
        out["status"] = summary["status"].to_numpy()
    for col, header in columns.items():
        if col in summary.columns:
            out[header] = [r["status"] if f else ci_text(r[col], r.get(f"{col}_lo"), r.get(f"{col}_hi"))
                           for r, f in zip(records, failed, strict=True)]
    return out.reset_index(drop=True)

