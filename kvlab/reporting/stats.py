"""Statistics of the report: per-group means and ratios of means with the intervals of
:mod:`kvlab.intervals` (t-intervals; none below 3 runs), formatted as ``mean [lo, hi]`` or ``mean (n=2)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from kvlab.intervals import mean_interval, ratio_interval
from kvlab.reporting.frames import contended_mask
from kvlab.reporting.text import ci_text, is_baseline_label, runs_text


def ratio_ci(values: Sequence[float], baseline: Sequence[float], n_boot: int = 2000,
             level: float = 0.95, seed: int = 0, method: str = "auto") -> tuple[float, float, float]:
    """``(ratio, lo, hi)`` of :func:`kvlab.intervals.ratio_interval` (Welch t on the log ratio; no
    bounds below 3 runs a side), for tables that keep three columns."""
    return ratio_interval(values, baseline, level, method, n_boot, seed).as_tuple()


def method_summary(records: pd.DataFrame, metrics: Sequence[str], by: Sequence[str] = ("label",),
                   n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """One row per group: ``n`` runs and, per metric, the mean with ``_lo``/``_hi`` t-interval bounds;
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
            row[m], row[f"{m}_lo"], row[f"{m}_hi"] = mean_interval(
                pd.to_numeric(part[m], errors="coerce"), level, n_boot=n_boot, seed=seed).as_tuple()
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
            out[header] = [r["status"] if f else ci_text(r[col], r.get(f"{col}_lo"), r.get(f"{col}_hi"), r.get("n"))
                           for r, f in zip(records, failed, strict=True)]
    return out.reset_index(drop=True)

