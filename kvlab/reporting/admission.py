"""The report at a memory budget: each method single-stream vs at the batch its budget admits.

Why: at batch 1 a smaller cache barely changes a decode step, but in a fixed memory budget it admits
more sequences; throughput can rise while each request gets slower. The section reads the at-budget
records (``budget_gb`` set, see :mod:`kvlab.sweep.admission`) next to the same method's batch-1 records and
states both ratios with Welch-log intervals, plus what the method's freed memory became: its admitted
batch over the baseline's and its throughput over the baseline's at the same budget.
"""

from __future__ import annotations

import math

import pandas as pd

from kvlab.reporting.frames import contended_mask, perf_records
from kvlab.reporting.stats import ratio_ci
from kvlab.reporting.text import ci_text, is_baseline_label

BUDGET_METRICS = {"tokens_per_s": "throughput (tok/s)", "itl_median_ms": "ITL p50 (ms)",
                  "decode_j_per_token": "decode J/token"}


def _ok_perf(records: pd.DataFrame) -> pd.DataFrame:
    perf = perf_records(records)
    return perf[~contended_mask(perf)]


def _values(part: pd.DataFrame, metric: str) -> list[float]:
    if metric not in part.columns:
        return []
    return [float(v) for v in pd.to_numeric(part[metric], errors="coerce").dropna()]


def _ratio(values, base) -> tuple[float, float, float]:
    return ratio_ci(values, base) if len(values) and len(base) else (math.nan, math.nan, math.nan)


def concurrency_verdict(tput: tuple[float, float, float], itl: tuple[float, float, float]) -> str:
    """What the budget did, read from the throughput and ITL ratios' CIs (at budget / single)."""
    if any(math.isnan(x) for x in (*tput, *itl)):
        return "no interval (fewer than 3 runs a side)" if not math.isnan(tput[0]) else "no data"
    rises, slower = tput[1] > 1, itl[1] > 1
    if rises and slower:
        return "throughput rises while each request gets slower"
    if rises:
        return "throughput rises at no clear cost per request"
    return "no clear throughput gain"


def budget_summary(records: pd.DataFrame, baseline: str = "full") -> pd.DataFrame:
    """One row per (budget, ctx, method): its admitted batch and cache, single-stream and at-budget
    means of :data:`BUDGET_METRICS`, the at-budget / single-stream ratios with CIs and a verdict, and
    its admitted batch and throughput over the baseline's at the same budget and context."""
    perf = _ok_perf(records)
    if "budget_gb" not in perf.columns or perf["budget_gb"].isna().all():
        empty = pd.DataFrame()
        measured = "budget_gb" in records.columns and records["budget_gb"].notna().any()
        empty.attrs["why"] = ("Every at-budget run was contended (other work took the CPU) or failed: no finding."
                              if measured else "No sweep ran at a memory budget (budget_gb: GB or gpu).")
        return empty
    at_all = perf[perf["budget_gb"].notna()]
    single_all = perf[perf["budget_gb"].isna() & (perf["batch"] == 1)]
    rows = []
    if "card" not in perf.columns:
        at_all, single_all = at_all.assign(card=""), single_all.assign(card="")
    for (budget, ctx, card), cell in at_all.groupby([at_all["budget_gb"].astype(str), "ctx", "card"], sort=True):
        base_label = next((lab for lab in cell["label"].unique() if lab == baseline or is_baseline_label(lab)), None)
        base_part = cell[cell["label"] == base_label] if base_label is not None else cell.iloc[0:0]
        labels = sorted(cell["label"].unique(), key=lambda lab: (lab != base_label, str(lab)))
        for label in labels:
            part = cell[cell["label"] == label]
            single = single_all[(single_all["label"] == label) & (single_all["ctx"] == ctx)
                                & (single_all["card"] == card)]
            budget_bytes = pd.to_numeric(part.get("budget_bytes"), errors="coerce").max()
            row = {"budget_gb": budget, "budget_bytes": budget_bytes, "ctx": int(ctx), "label": label,
                   "admitted_batch": int(part["batch"].max()), "runs": len(part), "single_runs": len(single),
                   "cache_bytes": pd.to_numeric(part["cache_bytes"], errors="coerce").mean(),
                   "peak_mem_bytes": pd.to_numeric(part["peak_mem_bytes"], errors="coerce").max()}
            if "cache_bytes_allocated" in part.columns:
                row["cache_bytes_allocated"] = pd.to_numeric(part["cache_bytes_allocated"], errors="coerce").mean()
            row["cache_share"] = row["cache_bytes"] / budget_bytes if budget_bytes else math.nan
            if "admission_fitted_batch" in part.columns:
                fitted = pd.to_numeric(part["admission_fitted_batch"], errors="coerce").max()
                row["fitted_batch"] = fitted
                row["capped"] = bool(fitted == fitted and fitted > row["admitted_batch"]
                                     and part["admission_capped"].fillna(False).astype(bool).any())
            for m in BUDGET_METRICS:
                at_v, one_v = _values(part, m), _values(single, m)
                row[f"single_{m}"] = sum(one_v) / len(one_v) if one_v else math.nan
                row[f"budget_{m}"] = sum(at_v) / len(at_v) if at_v else math.nan
                row[f"{m}_ratio"], row[f"{m}_ratio_lo"], row[f"{m}_ratio_hi"] = _ratio(at_v, one_v)
            row["verdict"] = concurrency_verdict(
                tuple(row[f"tokens_per_s_ratio{s}"] for s in ("", "_lo", "_hi")),
                tuple(row[f"itl_median_ms_ratio{s}"] for s in ("", "_lo", "_hi")))
            if base_label is not None and label != base_label:
                row["batch_vs_baseline"] = row["admitted_batch"] / int(base_part["batch"].max())
                (row["tput_vs_baseline"], row["tput_vs_baseline_lo"],
                 row["tput_vs_baseline_hi"]) = _ratio(_values(part, "tokens_per_s"), _values(base_part, "tokens_per_s"))
            rows.append(row)
    return pd.DataFrame(rows)


def budget_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Single-stream vs at-budget side by side, as display strings."""
    if summary.empty:
        return summary
    out = summary[["budget_gb", "ctx", "label", "admitted_batch"]].copy()
    if "fitted_batch" in summary.columns:
        out["fitted batch"] = [int(v) if v == v else "" for v in summary["fitted_batch"]]
    out["cache GB (allocated)"] = (summary["cache_bytes"] / 1e9).round(2)
    out["cache share of budget"] = [f"{v:.0%}" if not math.isnan(v) else "" for v in summary["cache_share"]]
    for m, title in BUDGET_METRICS.items():
        out[f"{title}: single"] = [ci_text(v, None, None) for v in summary[f"single_{m}"]]
        out[f"{title}: at budget"] = [ci_text(v, None, None) for v in summary[f"budget_{m}"]]
        out[f"{title}: ratio"] = [ci_text(r[f"{m}_ratio"], r[f"{m}_ratio_lo"], r[f"{m}_ratio_hi"])
                                  for r in summary.to_dict("records")]
    out["verdict"] = summary["verdict"]
    return out


def _times(r: dict, key: str) -> str:
    """``1.23 [1.1, 1.4]x``, or ``n/a`` without data."""
    text = ci_text(r.get(key), r.get(f"{key}_lo"), r.get(f"{key}_hi"))
    return text if text == "n/a" else text + "x"


def budget_lines(summary: pd.DataFrame, baseline: str = "full") -> list[str]:
    """One sentence per method at a budget: single-stream vs at-budget, with CIs."""
    if summary.empty:
        return [summary.attrs.get("why", "No sweep ran at a memory budget (budget_gb: GB or gpu).")]
    lines = []
    for r in summary.to_dict("records"):
        budget = f"{r['budget_bytes'] / 1e9:.2f} GB" if r["budget_bytes"] == r["budget_bytes"] else r["budget_gb"]
        cap = f" (capped by budget_max_batch; the budget admits {int(r['fitted_batch'])})" if r.get("capped") else ""
        text = (f"{r['label']} at {r['ctx']:,} tokens in {budget}: admits {r['admitted_batch']} sequences{cap} "
                f"(cache {r['cache_bytes'] / 1e9:.2f} GB allocated); throughput {_times(r, 'tokens_per_s_ratio')} "
                f"single-stream, each request's ITL {_times(r, 'itl_median_ms_ratio')}, decode J/token "
                f"{_times(r, 'decode_j_per_token_ratio')}: {r['verdict']}")
        if not math.isnan(r.get("batch_vs_baseline", math.nan)):
            text += (f"; vs {baseline} at the same budget: {r['batch_vs_baseline']:.2f}x the sequences, "
                     f"{_times(r, 'tput_vs_baseline')} the throughput")
        lines.append(text + ".")
    return lines
