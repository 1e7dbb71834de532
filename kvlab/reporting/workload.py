"""The report over a context-length distribution: per method, aggregates over all its draws.

Every draw of a distribution is one equally likely request, so a method's cost over the workload is
its energy over all tokens generated (token-weighted J/token, not a mean of per-run ratios) and its
latency is the pool of every inter-token latency (p50/p90/p99). CIs resample the draws (the same
draws for every method, so a method and the baseline move together: a paired bootstrap); contended
CPU runs are left out, as in the report's other findings.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvlab.intervals import MIN_BCA, percentile_interval
from kvlab.reporting.frames import contended_mask, perf_records
from kvlab.reporting.summaries import pays_verdict
from kvlab.reporting.text import ci_text, is_baseline_label

ITL_QUANTILES = (50, 90, 99)
UNIT_KEYS = ("ctx_sample", "repeat", "prompt_id")  # one request of the workload, shared by every method


def distribution_runs(records: pd.DataFrame) -> pd.DataFrame:
    """Ok, uncontended performance runs drawn from a distribution (and not at-budget runs)."""
    if "ctx_dist" not in records.columns:
        return records.iloc[0:0]
    perf = perf_records(records)
    perf = perf[perf["ctx_dist"].notna() & ~contended_mask(perf)]
    if "budget_gb" in perf.columns:
        perf = perf[perf["budget_gb"].isna()]
    return perf


def _unit_totals(part: pd.DataFrame) -> pd.DataFrame:
    """Per request of the workload: energy, decode energy, tokens, decode tokens and its ITLs."""
    keys = [k for k in UNIT_KEYS if k in part.columns]
    p = part.assign(
        _tokens=part["batch"] * part["new_tokens"], _decode_tokens=part["batch"] * (part["new_tokens"] - 1),
        _energy=pd.to_numeric(part.get("energy_j"), errors="coerce"),
        _decode_j=pd.to_numeric(part.get("decode_j"), errors="coerce"))
    return p.groupby(keys, sort=True).agg(
        energy=("_energy", "sum"), decode_j=("_decode_j", "sum"), tokens=("_tokens", "sum"),
        decode_tokens=("_decode_tokens", "sum"), itl=("itl_ms", lambda s: sum((list(v) for v in s), [])),
        ctx=("ctx", "mean"), has_energy=("_energy", lambda s: s.notna().all()))


def _aggregate(units: pd.DataFrame) -> dict[str, float]:
    itl = np.asarray(sum(units["itl"].tolist(), []), dtype=float)
    energy_ok = bool(units["has_energy"].all())
    out = {
        "j_per_token": units["energy"].sum() / units["tokens"].sum() if energy_ok else math.nan,
        "decode_j_per_token": (units["decode_j"].sum() / units["decode_tokens"].sum()
                               if energy_ok and units["decode_tokens"].sum() > 0 else math.nan),
    }
    for q in ITL_QUANTILES:
        out[f"itl_p{q}_ms"] = float(np.percentile(itl, q)) if itl.size else math.nan
    return out


def _boot(units: dict[str, pd.DataFrame], n_boot: int, level: float, seed: int):
    """Bootstrap draws of each label's aggregates over the units every label has (resampled
    together, so ratios between labels are paired), and a function giving a draw list's percentile
    bounds (:func:`kvlab.intervals.percentile_interval`: none below :data:`kvlab.intervals.MIN_BCA`
    shared units; a bootstrap of 2 units returns their range)."""
    common = sorted(set.intersection(*(set(u.index) for u in units.values())))
    rng = np.random.default_rng(seed)
    draws: dict[str, list[dict[str, float]]] = {label: [] for label in units}
    if len(common) >= MIN_BCA:
        for _ in range(n_boot):
            pick = [common[i] for i in rng.integers(0, len(common), len(common))]
            for label, u in units.items():
                draws[label].append(_aggregate(u.loc[pick]))

    def bounds(values: list[float]) -> tuple[float, float]:
        interval = percentile_interval(math.nan, values, len(common), level)
        return interval.lo, interval.hi

    return draws, bounds


def distribution_summary(records: pd.DataFrame, baseline: str = "full", n_boot: int = 1000,
                         level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """One row per (distribution, batch, method): draws and runs, the mean context, token-weighted
    J/token and decode J/token, pooled ITL p50/p90/p99, each with a CI, and the ratios of J/token and
    ITL p50 to the baseline's over the same draws (paired), with CIs and a verdict."""
    runs = distribution_runs(records)
    rows = []
    if runs.empty:
        empty = pd.DataFrame(rows)
        measured = "ctx_dist" in records.columns and records["ctx_dist"].notna().any()
        empty.attrs["why"] = ("Every run over a distribution was contended (other work took the CPU) or failed: "
                              "no finding." if measured else
                              "No sweep drew its contexts from a distribution (ctx: {dist: ...} or {file: ...}).")
        return empty
    metrics = ["j_per_token", "decode_j_per_token"] + [f"itl_p{q}_ms" for q in ITL_QUANTILES]
    for (dist, batch), cell in runs.groupby(["ctx_dist", "batch"], sort=True):
        parts = {str(label): part for label, part in cell.groupby("label", sort=False)}
        units = {label: _unit_totals(part) for label, part in parts.items()}
        base = next((lab for lab in units if lab == baseline or is_baseline_label(lab)), None)
        draws, bounds = _boot(units, n_boot, level, seed)
        common = sorted(set.intersection(*(set(u.index) for u in units.values())))
        for label, u in units.items():
            agg = _aggregate(u)
            row = {"ctx_dist": dist, "batch": int(batch), "label": label,
                   "draws": int(parts[label]["ctx_sample"].nunique()), "runs": len(parts[label]),
                   "ctx_mean": float(u["ctx"].mean())}
            for m in metrics:
                row[m] = agg[m]
                row[f"{m}_lo"], row[f"{m}_hi"] = bounds([d[m] for d in draws[label]])
            if base is not None and label != base:
                b_agg = _aggregate(units[base].loc[common]) if common else None
                m_agg = _aggregate(u.loc[common]) if common else None
                for m, name in (("j_per_token", "j_ratio"), ("itl_p50_ms", "itl_ratio")):
                    row[name] = m_agg[m] / b_agg[m] if common and b_agg[m] else math.nan
                    row[f"{name}_lo"], row[f"{name}_hi"] = bounds(
                        [d[m] / e[m] if e[m] else math.nan for d, e in zip(draws[label], draws[base], strict=True)])
                row["verdict"] = pays_verdict(row["j_ratio"], row["j_ratio_lo"], row["j_ratio_hi"])
            rows.append(row)
    return pd.DataFrame(rows)


DISTRIBUTION_COLUMNS = {
    "j_per_token": "J/token (token-weighted)", "decode_j_per_token": "decode J/token",
    "itl_p50_ms": "ITL p50 (ms)", "itl_p90_ms": "ITL p90 (ms)", "itl_p99_ms": "ITL p99 (ms)",
    "j_ratio": "J/token vs baseline", "itl_ratio": "ITL p50 vs baseline",
}


def distribution_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary as display strings ``value [lo, hi]``."""
    if summary.empty:
        return summary
    out = summary[["ctx_dist", "batch", "label", "draws", "runs"]].copy()
    out["mean ctx"] = summary["ctx_mean"].round(0).astype(int)
    for col, header in DISTRIBUTION_COLUMNS.items():
        if col in summary.columns:
            out[header] = [ci_text(r[col], r.get(f"{col}_lo"), r.get(f"{col}_hi")) if not _missing(r[col]) else ""
                           for r in summary.to_dict("records")]
    if "verdict" in summary.columns:
        out["verdict"] = summary["verdict"].fillna("baseline")
    return out


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def distribution_lines(summary: pd.DataFrame, baseline: str = "full") -> list[str]:
    """One sentence per method and distribution: its verdict over the workload, with CIs."""
    if summary.empty:
        return [summary.attrs.get("why", "No sweep drew its contexts from a distribution.")]
    lines = []
    for r in summary.to_dict("records"):
        if "j_ratio" not in r or _missing(r.get("j_ratio")) and _missing(r.get("itl_ratio")):
            continue
        energy = (f"token-weighted J/token {ci_text(r['j_ratio'], r['j_ratio_lo'], r['j_ratio_hi'])}x the "
                  f"{baseline} cache's ({r['verdict']})" if not _missing(r["j_ratio"]) else "no energy counter")
        lines.append(f"{r['label']} over {r['ctx_dist']} (batch {r['batch']}, {r['draws']} draws, mean ctx "
                     f"{r['ctx_mean']:,.0f}): {energy}; ITL p50 "
                     f"{ci_text(r['itl_ratio'], r['itl_ratio_lo'], r['itl_ratio_hi'])}x.")
    return lines or [f"No method ran next to the {baseline} cache over the same draws."]

