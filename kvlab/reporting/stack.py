"""The report on stacked quantization: weight formats x cache policies, against bf16 weights x full.

Why: a quantized model on a quantized cache pays two dequantize costs per decode step, and they have
been reported to compound (a threefold slowdown). Each cell's decode J/token and ITL are read
against the float-weights full cache, and the stack against the product of its parts: a stacked
ratio above ``weights alone x cache alone`` (its CI above 1) means the costs compound.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvlab.intervals import product_interval
from kvlab.reporting.frames import contended_mask, perf_records
from kvlab.reporting.stats import ratio_ci
from kvlab.reporting.text import ci_text

STACK_METRICS = {"decode_j_per_token": "decode J/token", "itl_median_ms": "ITL p50 (ms)"}
WEIGHTS_SUFFIX = " · w-"
WEIGHTS_ORDER = {"none": 0, "int8": 1, "int4": 2}


def _values(part: pd.DataFrame, metric: str) -> np.ndarray:
    if metric not in part.columns:
        return np.array([])
    return pd.to_numeric(part[metric], errors="coerce").dropna().to_numpy(dtype=float)


def interaction_ci(stack, weights, cache, base, n_boot: int = 2000, level: float = 0.95,
                   seed: int = 0) -> tuple[float, float, float]:
    """``(stack / base) / ((weights / base) x (cache / base))`` of the groups' means, with the Welch
    t-interval on its log (:func:`kvlab.intervals.product_interval`; none below 3 runs in a group):
    1 when the two costs multiply, above 1 when they compound."""
    return product_interval([stack, base, weights, cache], [1.0, 1.0, -1.0, -1.0], level).as_tuple()


def stack_verdict(value: float, lo: float, hi: float) -> str:
    if math.isnan(value):
        return "no data"
    if math.isnan(lo):
        return "no interval (fewer than 3 runs in a group)"
    if lo > 1:
        return "the costs compound (more than weights x cache)"
    if hi < 1:
        return "the costs overlap (less than weights x cache)"
    return "weights x cache, no clear interaction"


def stack_summary(records: pd.DataFrame, baseline: str = "full", n_boot: int = 2000) -> pd.DataFrame:
    """One row per (ctx, batch, weights format, cache policy) where more than one weights format
    ran: means of :data:`STACK_METRICS`, their ratios to float weights with the ``baseline`` cache,
    and for stacked cells the interaction (stacked ratio over the product of the parts) and verdict."""
    if "weights_quant" not in records.columns:
        return pd.DataFrame()
    perf = perf_records(records)
    if perf.empty:  # a quality pass alone (perf: false)
        return pd.DataFrame()
    perf = perf[~contended_mask(perf)]
    perf = perf.assign(weights_quant=perf["weights_quant"].fillna("none"),
                       cache=perf["label"].astype(str).str.split(WEIGHTS_SUFFIX, regex=False).str[0])
    rows = []
    if "card" not in perf.columns:
        perf = perf.assign(card="")
    for (ctx, batch, _card), cell in perf.groupby(["ctx", "batch", "card"], sort=True):
        if cell["weights_quant"].nunique() < 2 or "budget_gb" in cell.columns and cell["budget_gb"].notna().any():
            continue
        parts = {key: part for key, part in cell.groupby(["weights_quant", "cache"], sort=True)}
        base = parts.get(("none", baseline))
        order = sorted(parts, key=lambda k: (WEIGHTS_ORDER.get(k[0], len(WEIGHTS_ORDER)), k[1] != baseline, k[1]))
        for wq, cache in order:
            part = parts[(wq, cache)]
            row = {"ctx": int(ctx), "batch": int(batch), "weights_quant": wq, "cache": cache, "runs": len(part)}
            for m in STACK_METRICS:
                v = _values(part, m)
                row[m] = float(v.mean()) if v.size else math.nan
                b = _values(base, m) if base is not None else np.array([])
                row[f"{m}_ratio"], row[f"{m}_ratio_lo"], row[f"{m}_ratio_hi"] = (
                    ratio_ci(v, b, n_boot=n_boot) if v.size and b.size else (math.nan,) * 3)
            weights_only, cache_only = parts.get((wq, baseline)), parts.get(("none", cache))
            if wq != "none" and cache != baseline and base is not None and weights_only is not None \
                    and cache_only is not None:
                for m in STACK_METRICS:
                    row[f"{m}_interaction"], row[f"{m}_interaction_lo"], row[f"{m}_interaction_hi"] = interaction_ci(
                        _values(part, m), _values(weights_only, m), _values(cache_only, m), _values(base, m),
                        n_boot=n_boot)
                row["verdict"] = stack_verdict(row["itl_median_ms_interaction"], row["itl_median_ms_interaction_lo"],
                                               row["itl_median_ms_interaction_hi"])
            rows.append(row)
    return pd.DataFrame(rows)


def _times(r: dict, m: str) -> str:
    text = ci_text(r[f"{m}_ratio"], r[f"{m}_ratio_lo"], r[f"{m}_ratio_hi"])
    return text if text == "n/a" else text + "x"


def stack_lines(summary: pd.DataFrame, baseline: str = "full") -> list[str]:
    """One sentence per cell, against float weights with the ``baseline`` cache; stacks with their verdict."""
    if summary.empty:
        return ["No sweep ran more than one weights format (weights_quant: [none, int8, int4])."]
    lines = []
    for r in summary.to_dict("records"):
        if r["weights_quant"] == "none" and r["cache"] == baseline:
            continue
        text = (f"{r['weights_quant']} weights x {r['cache']} at {r['ctx']:,} tokens, batch {r['batch']}: decode "
                f"J/token {_times(r, 'decode_j_per_token')}, ITL {_times(r, 'itl_median_ms')} the float-weights "
                f"{baseline} cache")
        if isinstance(r.get("verdict"), str):
            inter = ci_text(r["itl_median_ms_interaction"], r["itl_median_ms_interaction_lo"],
                            r["itl_median_ms_interaction_hi"])
            text += f"; ITL over weights alone x cache alone: {inter}: {r['verdict']}"
        lines.append(text + ".")
    return lines


def stack_table(summary: pd.DataFrame) -> pd.DataFrame:
    if summary.empty:
        return summary
    out = summary[["ctx", "batch", "weights_quant", "cache", "runs"]].copy()
    for m, title in STACK_METRICS.items():
        out[title] = [ci_text(v, None, None) for v in summary[m]]
        out[f"{title} vs float-weights full"] = [ci_text(r[f"{m}_ratio"], r[f"{m}_ratio_lo"], r[f"{m}_ratio_hi"])
                                             for r in summary.to_dict("records")]
    if "verdict" in summary.columns:
        out["stack"] = summary["verdict"].fillna("")
    return out
