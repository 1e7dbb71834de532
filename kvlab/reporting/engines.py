"""Method cost vs implementation cost: the same method measured on both decode engines.

On ``hf`` (transformers' forward per step) a method's cost includes the stack's Python and launch
overhead; on ``fast`` (static buffers, one graph replay per step) it is closer to what the method's
bytes and kernels cost. The table puts, per method and (ctx, batch) cell: the metric on each engine,
each engine's ratio to its own full cache, and fast over hf for the same method.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from kvlab.reporting.frames import contended_mask, fill_labels
from kvlab.reporting.stats import ratio_ci
from kvlab.reporting.text import fmt_ctx

ENGINE_COLUMNS = ("hf", "fast")


def engine_comparison(records: pd.DataFrame, metric: str = "decode_j_per_token", baseline: str = "full",
                      n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """One row per (model, ctx, batch, method label) measured on both engines; ok, uncontended perf
    runs only. Columns: ``n_hf``/``n_fast``, the metric's mean per engine, ``vs_full_hf`` and
    ``vs_full_fast`` (ratio to that engine's full cache, with ``_lo``/``_hi``), ``fast_over_hf``."""
    cols = ["model", "ctx", "batch", "label", "method", "n_hf", "n_fast", "hf", "fast",
            *[f"{c}{s}" for c in ("vs_full_hf", "vs_full_fast", "fast_over_hf") for s in ("", "_lo", "_hi")]]
    need = {"engine", "method", "ctx", "batch", metric}
    df = records
    if "kind" in df.columns:
        df = df[df["kind"] == "perf"]
    if "status" in df.columns:
        df = df[df["status"] == "ok"]
    if df.empty or not need <= set(df.columns) or set(df["engine"].dropna()) < set(ENGINE_COLUMNS):
        return pd.DataFrame(columns=cols)
    df = df[~contended_mask(df)].assign(label=fill_labels(df))
    df = df.assign(_value=pd.to_numeric(df[metric], errors="coerce"))
    if "model" not in df.columns:
        df = df.assign(model="")
    if "weights_quant" not in df.columns:
        df = df.assign(weights_quant="none")
    df = df.assign(weights_quant=df["weights_quant"].fillna("none"))
    if "card" not in df.columns:
        df = df.assign(card="")
    rows: list[dict[str, Any]] = []
    # the baseline is the full cache on the same weights (a weight-quantized run is not compared
    # with the float-weights full cache here: that is the stack section's comparison)
    # and on the same card: no ratio crosses cards
    for (model, _weights, _card, ctx, batch), cell in df.groupby(["model", "weights_quant", "card", "ctx", "batch"],
                                                                 sort=True):
        def values(label=None, engine=None, method=None, c=cell):
            sel = c["engine"] == engine
            sel &= (c["label"] == label) if label is not None else (c["method"] == method)
            return c.loc[sel, "_value"].dropna()

        for label, g in cell.groupby("label", sort=False):
            hf, fast = values(label, "hf"), values(label, "fast")
            if hf.empty or fast.empty:
                continue
            method = g["method"].iloc[0]
            row = {"model": model, "ctx": int(ctx), "batch": int(batch), "label": label, "method": method,
                   "n_hf": len(hf), "n_fast": len(fast), "hf": hf.mean(), "fast": fast.mean()}
            for engine, vals in (("hf", hf), ("fast", fast)):
                base = values(engine=engine, method=baseline)
                r = ratio_ci(vals, base, n_boot, level, seed) if method != baseline else (math.nan,) * 3
                row.update(zip((f"vs_full_{engine}", f"vs_full_{engine}_lo", f"vs_full_{engine}_hi"), r,
                               strict=True))
            row.update(zip(("fast_over_hf", "fast_over_hf_lo", "fast_over_hf_hi"),
                           ratio_ci(fast, hf, n_boot, level, seed), strict=True))
            rows.append(row)
    return pd.DataFrame(rows, columns=cols)


def _ratio(r: float, lo: float, hi: float) -> str:
    if r is None or math.isnan(r):
        return "n/a"
    ci = f" (95% Welch-log CI {lo:.2f}-{hi:.2f})" if not (math.isnan(lo) or math.isnan(hi)) else " (no interval: fewer than 3 runs a side)"
    return f"{r:.2f}x{ci}"


def engine_lines(table: pd.DataFrame, metric_title: str = "decode J/token") -> list[str]:
    """One sentence per row: what the method costs relative to the full cache on each engine, and
    what the implementation costs (fast over hf for the same method)."""
    lines = []
    for r in table.itertuples():
        where = f"{fmt_ctx(r.ctx)}, batch {r.batch}"
        impl = _ratio(r.fast_over_hf, r.fast_over_hf_lo, r.fast_over_hf_hi)
        if r.method == "full":
            lines.append(f"- {r.label} at {where}: the fast engine spends {impl} of hf's {metric_title}.")
            continue
        lines.append(f"- {r.label} at {where}: {_ratio(r.vs_full_hf, r.vs_full_hf_lo, r.vs_full_hf_hi)} the "
                     f"full cache's {metric_title} on hf, {_ratio(r.vs_full_fast, r.vs_full_fast_lo, r.vs_full_fast_hi)}"
                     f" on fast; fast over hf for this method: {impl}.")
    return lines


def engine_table(table: pd.DataFrame, metric_title: str = "decode J/token") -> pd.DataFrame:
    """The comparison as text columns for the report."""
    def fmt(r, lo, hi):
        return "" if r is None or math.isnan(r) else (f"{r:.2f}" if math.isnan(lo) else f"{r:.2f} [{lo:.2f}, {hi:.2f}]")

    out = pd.DataFrame({
        "method": table["label"], "ctx": table["ctx"].map(fmt_ctx), "batch": table["batch"],
        f"hf {metric_title}": table["hf"].map(lambda v: f"{v:.3g}"),
        f"fast {metric_title}": table["fast"].map(lambda v: f"{v:.3g}"),
        "vs full, hf": [fmt(a, b, c) for a, b, c in zip(table.vs_full_hf, table.vs_full_hf_lo, table.vs_full_hf_hi,
                                                         strict=True)],
        "vs full, fast": [fmt(a, b, c) for a, b, c in zip(table.vs_full_fast, table.vs_full_fast_lo,
                                                           table.vs_full_fast_hi, strict=True)],
        "fast / hf": [fmt(a, b, c) for a, b, c in zip(table.fast_over_hf, table.fast_over_hf_lo,
                                                       table.fast_over_hf_hi, strict=True)],
        "runs (hf, fast)": [f"{a}, {b}" for a, b in zip(table.n_hf, table.n_fast, strict=True)],
    })
    return out
