"""Study summaries (per-method tables with bootstrap CIs, ratios to the full cache, provenance) and
report rendering (papermill + nbconvert to one offline HTML file, plus a folder index).

Summaries are pure functions of the records DataFrame, so the report notebook stays a few lines
per cell and the numbers are tested here. Rendering is the side-effect edge: it executes
``notebooks/report.ipynb`` against a records folder and exports HTML with code hidden and
plotly.js embedded (see :mod:`kvlab.viz`), with every CDN script of nbconvert's template removed,
so the file draws with no network.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvlab.plots import ci_text, fmt_ctx, is_baseline_label

GB = 1e9
DEFAULT_CTX = 16384
REPO_ROOT = Path(__file__).resolve().parents[1]
REPORT_NOTEBOOK = REPO_ROOT / "notebooks" / "report.ipynb"

# The study table: derived column -> header. Derived columns are added by `with_derived`.
STUDY_METRICS = {
    "peak_mem_gb": "peak memory (GB)",
    "cache_gb": "KV cache (GB)",
    "j_per_token": "J/token",
    "itl_median_ms": "time between tokens (ms, median)",
    "tokens_per_s": "tokens/s",
}

SYNTHETIC_NOTE = "synthetic: seeded random weights; speed, memory and energy are faithful, quality is meaningless"


class ReportError(ValueError):
    """A records folder or notebook the report cannot use; the message names the fix."""


# ---------------------------------------------------------------------------------------------
# selecting and deriving


def perf_records(records: pd.DataFrame) -> pd.DataFrame:
    """Successful performance records with the derived columns the report plots."""
    df = records
    if "kind" in df.columns:
        df = df[df["kind"] == "perf"]
    if "status" in df.columns:
        df = df[df["status"] == "ok"]
    return with_derived(df)


def quality_records(records: pd.DataFrame) -> pd.DataFrame:
    df = records[records["kind"] == "quality"] if "kind" in records.columns else records.iloc[0:0]
    if "status" in df.columns:
        df = df[df["status"] == "ok"]
    return with_derived(df)


def failed_records(records: pd.DataFrame) -> pd.DataFrame:
    """Failed runs (OOM, unsupported method): the report lists them instead of hiding them."""
    if "status" not in records.columns:
        return records.iloc[0:0]
    failed = records[records["status"] != "ok"]
    if "method" in failed.columns and not failed.empty:
        failed = failed.assign(label=fill_labels(records)[failed.index])
    cols = [c for c in ("sweep_dir", "method", "label", "ctx", "batch", "repeat", "error") if c in failed.columns]
    return _int_columns(failed[cols].copy())


def with_derived(df: pd.DataFrame) -> pd.DataFrame:
    """Add GB columns, fill ``tokens_per_s`` where missing and a ``label`` (see :func:`fill_labels`;
    prefixed by the model when several models are present) without touching the input."""
    df = df.copy()
    if "label" not in df.columns and "method" not in df.columns:
        df["label"] = "?"
    else:
        df["label"] = fill_labels(df)
    if "model" in df.columns and df["model"].nunique() > 1:  # a sweep over models: keep them apart
        prefix = df["model"].astype(str) + " · "
        labels = df["label"].astype(str)
        df["label"] = [lab if lab.startswith(p) else p + lab for p, lab in zip(prefix, labels, strict=True)]
    for src, dst in (("peak_mem_bytes", "peak_mem_gb"), ("cache_bytes", "cache_gb")):
        if src in df.columns:
            df[dst] = pd.to_numeric(df[src], errors="coerce") / GB
    if any(c in df.columns for c in ("tokens_per_s", "decode_s")):
        df["tokens_per_s"] = decode_throughput(df)
    return _int_columns(df)


def _int_columns(df: pd.DataFrame, cols: Sequence[str] = ("ctx", "batch", "new_tokens", "repeat")) -> pd.DataFrame:
    """Whole-number columns as ints (they turn float next to quality rows that lack them), so
    tables and sentences say batch 4, not 4.0."""
    for col in cols:
        if col in df.columns and len(df):
            values = pd.to_numeric(df[col], errors="coerce")
            if values.notna().all() and (values % 1 == 0).all():
                df[col] = values.astype("int64")
    return df


def decode_throughput(df: pd.DataFrame) -> pd.Series:
    """Generated tokens per second across the batch while decoding: ``tokens_per_s`` as measured,
    else ``batch * (new_tokens - 1) / decode_s`` (the first token comes from the prefill, and
    ``decode_s`` times the other ``new_tokens - 1`` steps: the formula kvlab.measure records)."""
    def col(name: str, default: float = math.nan) -> pd.Series:
        if name not in df.columns:
            return pd.Series(default, index=df.index, dtype=float)
        return pd.to_numeric(df[name], errors="coerce")

    steps = col("batch", 1.0) * (col("new_tokens") - 1)
    decode_s = col("decode_s")
    computed = (steps / decode_s).where((decode_s > 0) & (steps > 0))
    return col("tokens_per_s").fillna(computed)


def _plain(v: Any) -> Any:
    """A record value as a comparable key: None for missing, float for numbers."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, (int, float, np.number)) and not isinstance(v, bool):
        return float(v)
    return v


def method_label(method: Any, keep: Any = None, bits: Any = None, quant: Any = None) -> str:
    """The label kvlab.policies gives a method ("snapkv 10%", "quanto int4", "fp8") for a run that
    failed before its policy existed: the policy is rebuilt from the record's identity fields and
    asked, so the report never spells labels itself. An unknown method keeps its name."""
    from kvlab.params import method_axis
    from kvlab.policies import make_policy

    method, keep, bits = str(method), _plain(keep), _plain(bits)
    kwargs: dict[str, Any] = {}
    axis = method_axis(method)
    if axis == "keep" and keep is not None:
        kwargs["keep"] = keep
    elif axis == "bits" and bits is not None:
        kwargs["nbits"] = int(bits)
    if axis == "keep" and isinstance(quant, dict):
        kwargs["quant"] = quant
    try:
        return make_policy(method, **kwargs).label
    except ValueError:
        return method


def fill_labels(df: pd.DataFrame) -> pd.Series:
    """``label`` with the gaps filled: a failed run recorded before its policy was built (e.g. an
    OOM in warm-up) has no label, and must still land on the same row as its method's ok runs.

    A gap takes the one label that labelled rows of the same model and method carry with the same
    ``bits`` and ``keep`` (where the gap's row has them), else :func:`method_label`.
    """
    labels = df["label"] if "label" in df.columns else pd.Series(None, index=df.index, dtype=object)
    missing = labels.isna()
    if not missing.any() or "method" not in df.columns:
        return labels
    known = df.loc[~missing]
    out = labels.copy().astype(object)
    for idx in df.index[missing]:
        row = df.loc[idx]
        cand = known[known["method"] == row["method"]]
        for col in ("model", "bits", "keep"):
            value = _plain(row.get(col))
            if col in cand.columns and value is not None:
                cand = cand[cand[col].map(_plain) == value]
        found = list(dict.fromkeys(cand["label"]))
        params = row.get("policy_params")
        quant = params.get("quant") if isinstance(params, dict) else None
        out[idx] = found[0] if len(found) == 1 else method_label(row["method"], row.get("keep"),
                                                                 row.get("bits"), quant)
    return out


def pick_ctx(records: pd.DataFrame, ctx: int = DEFAULT_CTX) -> tuple[int | None, str]:
    """The context to tabulate: ``ctx`` if measured, else the nearest measured one (and a note)."""
    if records.empty or "ctx" not in records.columns:
        return None, "no records"
    available = sorted(int(c) for c in records["ctx"].dropna().unique())
    if ctx in available:
        return ctx, f"ctx {ctx}"
    nearest = min(available, key=lambda c: (abs(math.log(c / ctx)), -c))
    return nearest, f"ctx {nearest} ({ctx} was not measured; measured: {', '.join(map(str, available))})"


# ---------------------------------------------------------------------------------------------
# statistics


def bootstrap_ci(values: Sequence[float], n_boot: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float, float]:
    """Mean and percentile-bootstrap CI of the mean; NaN bounds with fewer than two values."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    if x.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if x.size < 2:
        return mean, math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return mean, float(lo), float(hi)


def ratio_ci(values: Sequence[float], baseline: Sequence[float], n_boot: int = 2000,
             level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of means (values / baseline) with a bootstrap CI resampling both groups independently."""
    x = np.asarray(values, dtype=float)
    b = np.asarray(baseline, dtype=float)
    x, b = x[~np.isnan(x)], b[~np.isnan(b)]
    if x.size == 0 or b.size == 0 or b.mean() == 0:
        return math.nan, math.nan, math.nan
    ratio = float(x.mean() / b.mean())
    if x.size < 2 and b.size < 2:
        return ratio, math.nan, math.nan
    rng = np.random.default_rng(seed)
    xm = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    bm = b[rng.integers(0, b.size, size=(n_boot, b.size))].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(xm / bm, [alpha, 1 - alpha])
    return ratio, float(lo), float(hi)


def method_summary(records: pd.DataFrame, metrics: Sequence[str], by: Sequence[str] = ("label",),
                   n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """One row per group: ``n`` runs and, per metric, the mean with ``_lo``/``_hi`` bootstrap bounds."""
    by = list(by)
    metrics = [m for m in metrics if m in records.columns]
    rows = []
    for keys, part in records.groupby(by, sort=False, dropna=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        row: dict[str, Any] = dict(zip(by, keys, strict=True))
        row["n"] = len(part)
        for m in metrics:
            row[m], row[f"{m}_lo"], row[f"{m}_hi"] = bootstrap_ci(
                pd.to_numeric(part[m], errors="coerce"), n_boot, level, seed)
        rows.append(row)
    cols = by + ["n"] + [f"{m}{s}" for m in metrics for s in ("", "_lo", "_hi")]
    return _ordered(pd.DataFrame(rows, columns=cols))


def _ordered(df: pd.DataFrame) -> pd.DataFrame:
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


def relative_to_baseline(records: pd.DataFrame, metric: str = "j_per_token", baseline: str = "full",
                         ctx: int | None = None, within: Sequence[str] = ("model", "ctx", "batch"),
                         n_boot: int = 2000,
                         level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Each label's mean ``metric`` over the baseline method's, within the same model, ctx and
    batch (only at ``ctx`` when given).

    ``change_pct`` is the headline number: +35 means 35% more J/token than the full cache.
    """
    within = [w for w in within if w in records.columns]
    cols = ["label", *within, "ratio", "ratio_lo", "ratio_hi", "change_pct"]
    if ctx is not None and "ctx" in records.columns:
        records = records[records["ctx"] == ctx]
    if records.empty or metric not in records.columns or "method" not in records.columns:
        return pd.DataFrame(columns=cols)
    rows = []
    groups = records.groupby(within, sort=True) if within else [((), records)]
    for keys, part in groups:
        keys = keys if isinstance(keys, tuple) else (keys,)
        base = pd.to_numeric(part.loc[part["method"] == baseline, metric], errors="coerce")
        if base.notna().sum() == 0:
            continue
        for label, g in part[part["method"] != baseline].groupby("label", sort=False):
            r, lo, hi = ratio_ci(pd.to_numeric(g[metric], errors="coerce"), base, n_boot, level, seed)
            rows.append({"label": label, **dict(zip(within, keys, strict=True)), "ratio": r,
                         "ratio_lo": lo, "ratio_hi": hi, "change_pct": (r - 1) * 100})
    return _ordered(pd.DataFrame(rows, columns=cols))


def headline(rel: pd.DataFrame, metric_title: str = "J/token", baseline: str = "full") -> list[str]:
    """One sentence per method: '+35% J/token vs full at ctx 16384 (95% CI +30% to +41%)'; the batch
    is named too when ``rel`` holds several (a folder of sweeps), so no two lines read the same."""
    lines = []
    several_batches = "batch" in rel.columns and rel["batch"].nunique() > 1
    for r in rel.dropna(subset=["ratio"]).to_dict("records"):
        where = f" at ctx {int(r['ctx'])}" if "ctx" in r else ""
        if several_batches:
            where += f", batch {int(r['batch'])}"
        ci = ""
        if not math.isnan(r["ratio_lo"]):
            ci = f" (95% CI {(r['ratio_lo'] - 1) * 100:+.0f}% to {(r['ratio_hi'] - 1) * 100:+.0f}%)"
        lines.append(f"{r['label']}: {r['change_pct']:+.0f}% {metric_title} vs {baseline}{where}{ci}")
    return lines


def format_ci(summary: pd.DataFrame, columns: dict[str, str], key: str | None = "label",
              keys: Sequence[str] = ()) -> pd.DataFrame:
    """The summary as display strings ``mean [lo, hi]`` under readable headers; ``keys`` (e.g. ctx,
    batch) follow the method (no method column with ``key=None``). A row with no ok run and a
    ``status`` (``failed: OOM``) shows it in every metric cell: a failed configuration stays visible."""
    out = pd.DataFrame({"method": summary[key].astype(str)} if key else {}, index=summary.index)
    for k in keys:
        if k in summary.columns:
            out[k] = summary[k].to_numpy()
    out["runs"] = summary["n"].to_numpy()
    records = summary.to_dict("records")
    failed = [r["n"] == 0 and str(r.get("status", "")).startswith("failed") for r in records]
    if "status" in summary.columns and any(str(v) != "ok" for v in summary["status"]):
        out["status"] = summary["status"].to_numpy()
    for col, header in columns.items():
        if col in summary.columns:
            out[header] = [r["status"] if f else ci_text(r[col], r.get(f"{col}_lo"), r.get(f"{col}_hi"))
                           for r, f in zip(records, failed, strict=True)]
    return out.reset_index(drop=True)


def study_summary(records: pd.DataFrame, ctx: int = DEFAULT_CTX, metrics: dict[str, str] | None = None,
                  **boot) -> tuple[pd.DataFrame, int | None, str]:
    """The study table at one context (nearest measured if absent, smallest batch measured there):
    the summary frame, the context used and a caption saying which."""
    perf = perf_records(records)
    chosen, caption = pick_ctx(perf, ctx)
    if chosen is None:
        return method_summary(perf, []), None, caption
    at = perf[perf["ctx"] == chosen]
    if "batch" in at.columns and at["batch"].nunique() > 1:
        b = int(at["batch"].min())
        at = at[at["batch"] == b]
        caption += f", batch {b}"
    return method_summary(at, list(metrics or STUDY_METRICS), **boot), chosen, caption


def quality_summary(quality: pd.DataFrame, metric: str = "score", **boot) -> pd.DataFrame:
    """Mean task score per (task, method, keep) with CIs; the full cache counts as keep 1.0."""
    if quality.empty or metric not in quality.columns:
        return pd.DataFrame(columns=["task", "method", "keep", "n", metric, f"{metric}_lo", f"{metric}_hi"])
    q = quality.copy()
    q["keep"] = pd.to_numeric(q["keep"], errors="coerce").fillna(1.0) if "keep" in q.columns else 1.0
    by = [c for c in ("task", "method", "keep") if c in q.columns]
    return method_summary(q, [metric], by=by, **boot)


def sweep_summary(records: pd.DataFrame, **boot) -> pd.DataFrame:
    """The end-of-sweep table: per method, context and batch, the headline metrics as text."""
    perf = perf_records(records)
    metrics = {"itl_median_ms": "ms/token (median)", "tokens_per_s": "tokens/s", "peak_mem_gb": "peak GB",
               "j_per_token": "J/token"}
    summary = method_summary(perf, list(metrics), by=[c for c in ("label", "ctx", "batch") if c in perf.columns],
                             **boot)
    table = format_ci(summary, metrics)
    for col in ("ctx", "batch"):
        if col in summary.columns:
            table.insert(1, col, summary[col].to_numpy())
    return table


# ---------------------------------------------------------------------------------------------
# a folder of sweeps: contexts, batches, where compression pays, the int4 answer


CONTEXT_METRICS = {
    "peak_mem_gb": "peak memory (GB)",
    "j_per_token": "J/token",
    "itl_median_ms": "time between tokens (ms, median)",
}
BATCH_METRICS = {
    "tokens_per_s": "decode tokens/s (whole batch)",
    "j_per_token": "J/token",
    "decode_j_per_token": "decode J/token",
    "itl_median_ms": "time between tokens (ms, median)",
    "peak_mem_gb": "peak memory (GB)",
}
PAYS_METRICS = {
    "j_per_token": "J/token",
    "itl_median_ms": "time between tokens",
    "tokens_per_s": "tokens/s",
}
# The verdicts of `pays_verdict`, in words for the int4 sentences.
VERDICT_WORDS = {
    "pays": "less energy than the full cache",
    "costs": "more energy than the full cache",
    "no clear difference": "no clear difference from the full cache",
}


def failure_text(errors: Sequence[Any]) -> str:
    """``failed: OOM`` when a run ran out of GPU memory, else ``failed:`` and the first error, short:
    what a table cell says instead of a number."""
    texts = [str(e) for e in errors if e is not None and not (isinstance(e, float) and math.isnan(e))]
    if any("out of memory" in t.lower() or "outofmemory" in t.lower() for t in texts):
        return "failed: OOM"
    if not texts:
        return "failed"
    first = texts[0].splitlines()[0]
    return f"failed: {first[:77] + '...' if len(first) > 80 else first}"


def all_perf_records(records: pd.DataFrame) -> pd.DataFrame:
    """Performance records, ok and failed, with the derived columns (failed runs keep a label)."""
    df = records
    if "kind" in df.columns:
        df = df[df["kind"] == "perf"]
    return with_derived(df)


def _ok(df: pd.DataFrame) -> pd.Series:
    return df["status"] == "ok" if "status" in df.columns else pd.Series(True, index=df.index)


def smallest_batch(records: pd.DataFrame) -> int | None:
    if records.empty or "batch" not in records.columns or records["batch"].isna().all():
        return None
    return int(records["batch"].min())


def context_summary(records: pd.DataFrame, metrics: Sequence[str] | None = None, batch: int | None = None,
                    **boot) -> tuple[pd.DataFrame, str]:
    """Per method and context at one batch (the smallest measured unless given), with CIs: contexts
    compare like with like only at the same batch, and a folder of sweeps mixes batches at 16k."""
    perf = perf_records(records)
    metrics = list(metrics or CONTEXT_METRICS)
    batch = smallest_batch(perf) if batch is None else batch
    if perf.empty or "ctx" not in perf.columns or batch is None:
        return pd.DataFrame(columns=["label", "ctx", "n"]), "no performance records"
    at = perf[perf["batch"] == batch]
    ctxs = sorted(int(c) for c in at["ctx"].dropna().unique())
    caption = f"batch {batch}, ctx {', '.join(map(str, ctxs))}" if ctxs else f"no runs at batch {batch}"
    return method_summary(at, metrics, by=["label", "ctx"], **boot), caption


def pick_batch_ctx(records: pd.DataFrame, ctx: int = DEFAULT_CTX) -> tuple[int | None, str]:
    """The context of the batch section: ``ctx`` if several batches ran there, else the context
    with the most batch sizes (nearest to ``ctx`` on ties); None and why when no context has two."""
    if records.empty or not {"ctx", "batch"} <= set(records.columns):
        return None, "no performance records"
    counts = records.dropna(subset=["ctx", "batch"]).groupby("ctx")["batch"].nunique()
    several = {int(c): int(n) for c, n in counts.items() if n > 1}
    if not several:
        batches = sorted(int(b) for b in records["batch"].dropna().unique())
        return None, (f"one batch size per context (batch {', '.join(map(str, batches))}): "
                      f"no batch scaling in this folder")
    if ctx in several:
        return ctx, f"ctx {ctx}"
    best = min(several, key=lambda c: (-several[c], abs(math.log(c / ctx)), -c))
    return best, f"ctx {best} (the context with the most batch sizes; {ctx} has fewer than two)"


def batch_summary(records: pd.DataFrame, ctx: int = DEFAULT_CTX, metrics: Sequence[str] | None = None,
                  **boot) -> tuple[pd.DataFrame, int | None, str]:
    """Per (method, batch) at one context (:func:`pick_batch_ctx`), mean and CI per metric, with
    a ``status``: methods measured at one batch only are left out, and a (method, batch) whose runs
    all failed stays as a row with ``n`` 0 and ``status`` ``failed: OOM``."""
    metrics = list(metrics or BATCH_METRICS)
    perf = all_perf_records(records)
    chosen, caption = pick_batch_ctx(perf, ctx)
    if chosen is None:
        present = [m for m in metrics if m in perf.columns]
        empty = pd.DataFrame(columns=["label", "batch", "n", *[f"{m}{s}" for m in present for s in ("", "_lo", "_hi")],
                                      "status"])
        return empty, None, caption
    at = perf[perf["ctx"] == chosen]
    scaled = at.groupby("label")["batch"].nunique()
    at = at[at["label"].isin(scaled[scaled > 1].index)]
    ok = _ok(at)
    summary = method_summary(at[ok], metrics, by=["label", "batch"], **boot)
    summary["status"] = "ok"
    fails = {key: failure_text(g["error"] if "error" in g.columns else [])
             for key, g in at[~ok].groupby(["label", "batch"])}
    extra = []
    for (label, batch), text in fails.items():
        hit = (summary["label"] == label) & (summary["batch"] == batch)
        if hit.any():
            n_failed = int(((at["label"] == label) & (at["batch"] == batch) & ~ok).sum())
            summary.loc[hit, "status"] = f"ok ({n_failed} {text})"
        else:
            extra.append({"label": label, "batch": batch, "n": 0, "status": text})
    if extra:
        summary = pd.concat([summary, pd.DataFrame(extra)], ignore_index=True)
    caption = f"Batch sizes at {caption}: mean [95% CI]"
    if "new_tokens" in at.columns and at["new_tokens"].nunique() > 1:
        per_batch = at.groupby("batch")["new_tokens"].agg(lambda v: "/".join(map(str, sorted(set(v.dropna())))))
        caption += ("; new tokens per sequence differ (" + ", ".join(f"batch {b}: {t}" for b, t in per_batch.items())
                    + "): J/token includes the prefill, so compare decode J/token across batches")
    return _ordered(summary), chosen, caption


def rows_or_none(table: pd.DataFrame) -> pd.DataFrame | None:
    """The table, or None when it has no rows: a notebook cell then shows nothing under the
    sentence that already said why, instead of an empty header."""
    return None if table is None or table.empty else table


def pays_verdict(ratio: float, lo: float, hi: float) -> str:
    """Does compression pay in energy? On the J/token ratio to the full cache and its 95% CI."""
    if ratio is None or math.isnan(ratio):
        return "no J/token data"
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return "no CI (one run each)"
    if hi < 1:
        return "pays"
    if lo > 1:
        return "costs"
    return "no clear difference"


def compression_pays(records: pd.DataFrame, baseline: str = "full", metrics: Sequence[str] | None = None,
                     n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """For every measured (ctx, batch) cell, each method's metrics over the full cache's in the same
    cell: ratio of means with a bootstrap CI (``{metric}_ratio``, ``_lo``, ``_hi``) and a
    ``verdict`` on J/token (:func:`pays_verdict`). A method that failed in a cell, or ran where the
    full cache failed (that is where compression pays in capacity), gets a row saying so."""
    metrics = list(metrics or PAYS_METRICS)
    perf = all_perf_records(records)
    within = [c for c in ("model", "ctx", "batch") if c in perf.columns]
    ratio_cols = [f"{m}_ratio{s}" for m in metrics for s in ("", "_lo", "_hi")]
    if perf.empty or "method" not in perf.columns or not {"ctx", "batch"} <= set(within):
        return pd.DataFrame(columns=["label", "ctx", "batch", "n", "n_base", *ratio_cols, "verdict"])
    cols = ["label", *within, "n", "n_base", *ratio_cols, "verdict"]
    rows = []
    for keys, cell in perf.groupby(within, sort=True):
        where = dict(zip(within, keys if isinstance(keys, tuple) else (keys,), strict=True))
        ok = _ok(cell)
        is_base = cell["method"] == baseline
        base = cell[is_base & ok]
        base_failed = cell[is_base & ~ok]
        for label, g in cell[~is_base].groupby("label", sort=False):
            g_ok = g[_ok(g)]
            row: dict[str, Any] = {"label": label, **where, "n": len(g_ok), "n_base": len(base)}
            row.update(dict.fromkeys(ratio_cols, math.nan))
            if g_ok.empty:
                row["verdict"] = failure_text(g["error"] if "error" in g.columns else [])
            elif base.empty:
                row["verdict"] = (f"ran where {baseline} " + failure_text(base_failed.get("error", []))
                                  if not base_failed.empty else f"no {baseline} run in this cell")
            else:
                for m in metrics:
                    if m in cell.columns:
                        r = ratio_ci(pd.to_numeric(g_ok[m], errors="coerce"),
                                     pd.to_numeric(base[m], errors="coerce"), n_boot, level, seed)
                        row[f"{m}_ratio"], row[f"{m}_ratio_lo"], row[f"{m}_ratio_hi"] = r
                row["verdict"] = pays_verdict(row.get("j_per_token_ratio", math.nan),
                                              row.get("j_per_token_ratio_lo", math.nan),
                                              row.get("j_per_token_ratio_hi", math.nan))
            rows.append(row)
    return _ordered(pd.DataFrame(rows, columns=cols))


def pays_table(pays: pd.DataFrame, metrics: dict[str, str] | None = None) -> pd.DataFrame:
    """:func:`compression_pays` as display text: ``ratio [lo, hi]`` per metric, 1.0 = the full cache."""
    metrics = metrics or PAYS_METRICS
    out = pd.DataFrame({"ctx": pays["ctx"].to_numpy(), "batch": pays["batch"].to_numpy(),
                        "method": pays["label"].astype(str).to_numpy(),
                        "runs (method/full)": [f"{int(a)}/{int(b)}" for a, b in zip(pays["n"], pays["n_base"],
                                                                                     strict=True)]})
    if "model" in pays.columns and pays["model"].nunique() > 1:
        out.insert(0, "model", pays["model"].to_numpy())
    for m, title in metrics.items():
        if f"{m}_ratio" in pays.columns:
            out[f"{title} / full"] = [ci_text(r[f"{m}_ratio"], r[f"{m}_ratio_lo"], r[f"{m}_ratio_hi"])
                                      for r in pays.to_dict("records")]
    out["verdict (J/token)"] = pays["verdict"].to_numpy()
    return out.sort_values(["ctx", "batch"], kind="stable").reset_index(drop=True)


def energy_answer(pays: pd.DataFrame, pattern: str = "int4", baseline: str = "full") -> list[str]:
    """The int4-vs-bf16 question in sentences, one per (ctx, batch) cell, from
    :func:`compression_pays`: 'quanto int4 used +35% J/token vs full at 16k, batch 1 (95% CI +30%
    to +41%, 3 vs 3 runs): more energy than the full cache'. ``pattern`` picks the labels."""
    rows = pays[pays["label"].astype(str).str.contains(pattern, regex=False)] if not pays.empty else pays
    if rows.empty:
        return [f"no '{pattern}' runs in this folder"]
    lines = []
    for r in rows.sort_values(["ctx", "batch"], kind="stable").to_dict("records"):
        where = f"at {fmt_ctx(r['ctx'])}, batch {int(r['batch'])}"
        ratio, lo, hi = r["j_per_token_ratio"], r["j_per_token_ratio_lo"], r["j_per_token_ratio_hi"]
        if ratio is None or math.isnan(ratio):
            reason = r["verdict"] if r["verdict"] != "no J/token data" else "no J/token (no energy counter?)"
            lines.append(f"{r['label']} {where}: {reason}")
            continue
        runs = f"{int(r['n'])} vs {int(r['n_base'])} runs"
        ci = (f"95% CI {(lo - 1) * 100:+.0f}% to {(hi - 1) * 100:+.0f}%, {runs}" if not math.isnan(lo)
              else f"{runs}, no CI")
        tail = f": {VERDICT_WORDS[r['verdict']]}" if r["verdict"] in VERDICT_WORDS else ""
        lines.append(f"{r['label']} used {(ratio - 1) * 100:+.0f}% J/token vs {baseline} {where} ({ci}){tail}")
    return lines


def tenhz_gap(records: pd.DataFrame, **boot) -> tuple[pd.DataFrame, str]:
    """How far the study's 10 Hz power integration is from the energy counter: per (ctx, batch),
    ``gap_pct`` = (10 Hz energy / counter energy - 1) x 100 with a CI over runs, and the energy
    window's length (the gap scales with 1 / window); plus one sentence over all runs."""
    perf = perf_records(records)
    cols = ["ctx", "batch", "n", "gap_pct", "gap_pct_lo", "gap_pct_hi", "window_s", "window_s_lo", "window_s_hi"]
    if not {"energy_j", "energy_10hz_j"} <= set(perf.columns):
        return pd.DataFrame(columns=cols), "no energy measurements (energy_source none on this device)"
    counter = pd.to_numeric(perf["energy_j"], errors="coerce")
    sampled = pd.to_numeric(perf["energy_10hz_j"], errors="coerce")
    d = perf[(counter > 0) & sampled.notna()].copy()
    if d.empty:
        return pd.DataFrame(columns=cols), "no energy measurements (energy_source none on this device)"
    d["gap_pct"] = (sampled[d.index] / counter[d.index] - 1) * 100
    if "window_s" in d.columns and d["window_s"].notna().any():
        d["window_s"] = pd.to_numeric(d["window_s"], errors="coerce")
    elif {"prefill_s", "decode_s"} <= set(d.columns):
        d["window_s"] = pd.to_numeric(d["prefill_s"], errors="coerce") + pd.to_numeric(d["decode_s"], errors="coerce")
    else:
        d["window_s"] = math.nan
    summary = method_summary(d, ["gap_pct", "window_s"], by=["ctx", "batch"], **boot)
    mean, lo, hi = bootstrap_ci(d["gap_pct"], **boot)
    ci = f" (95% CI {lo:+.1f}% to {hi:+.1f}%)" if not math.isnan(lo) else ""
    w = d["window_s"].dropna()
    span = f", energy windows {w.min():.1f} to {w.max():.1f} s" if not w.empty else ""
    sentence = (f"Over {len(d)} runs the 10 Hz power integration read {mean:+.1f}% of the counter's "
                f"energy{ci}{span}.")
    return summary, sentence


# ---------------------------------------------------------------------------------------------
# anatomy files (the stdout of `kvlab anatomy --json`) saved in the folder


ANATOMY_HINT = ("no anatomy in this folder: save `kvlab anatomy --json ... > anatomy/anatomy_16k.json` "
                "next to the sweeps")


def anatomy_files(folder: str | Path) -> list[Path]:
    """``anatomy*.json`` anywhere under the folder and any ``.json`` in an ``anatomy`` folder."""
    folder = Path(folder)
    found = set(folder.rglob("anatomy*.json")) | set(folder.rglob("anatomy/*.json"))
    return sorted(p for p in found if p.is_file())


def read_anatomy(path: str | Path) -> pd.DataFrame:
    """One anatomy file as the long table (label, method, category, ms, wall_ms, ...); stray lines
    printed before the JSON are skipped, and a file without a JSON table gives an empty frame."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    candidates = [text] + [line for line in reversed(text.splitlines()) if line.lstrip().startswith("[")]
    for chunk in candidates:
        try:
            data = json.loads(chunk)
        except json.JSONDecodeError:
            continue
        if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
            table = pd.DataFrame(data)
            if {"label", "category", "ms"} <= set(table.columns):
                return table
    return pd.DataFrame()


def load_anatomy(folder: str | Path) -> pd.DataFrame:
    """Every anatomy file under the folder as one table with a ``source`` column (the file name);
    with several files the labels are prefixed by it, so the plots keep them apart."""
    folder = Path(folder)
    parts = []
    for path in anatomy_files(folder):
        table = read_anatomy(path)
        if not table.empty:
            parts.append(table.assign(source=path.stem))
    if not parts:
        return pd.DataFrame(columns=["label", "method", "category", "ms", "wall_ms", "busy_ms", "source"])
    table = pd.concat(parts, ignore_index=True)
    if table["source"].nunique() > 1:
        table["label"] = table["source"] + " · " + table["label"].astype(str)
    return table


def anatomy_categories(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`kvlab.anatomy.category_table` (ms per step by category, per method), or an empty
    frame when the folder has no anatomy."""
    from kvlab.anatomy import category_table

    if table is None or table.empty or not {"label", "category", "ms", "wall_ms", "busy_ms"} <= set(table.columns):
        return pd.DataFrame()
    return category_table(table)


def anatomy_lines(table: pd.DataFrame, baseline: str = "full", top: int = 3) -> list[str]:
    """Why a method's decode step is slower or faster than the full cache's, in ms per step: the
    wall-time difference and the ``top`` categories that differ most (e.g. dequantize for int4)."""
    if table is None or table.empty or not {"label", "category", "ms"} <= set(table.columns):
        return [ANATOMY_HINT]
    groups = table.groupby("source", sort=False) if "source" in table.columns else [(None, table)]
    lines = []
    for _, part in groups:
        is_base = (part["method"] == baseline) if "method" in part.columns else part["label"] == baseline
        if not is_base.any():
            lines.append(f"no {baseline} method in the anatomy: nothing to compare with")
            continue
        base = part[is_base].groupby("category")["ms"].sum()
        base_label = str(part.loc[is_base, "label"].iloc[0])
        base_wall = float(part.loc[is_base, "wall_ms"].iloc[0]) if "wall_ms" in part.columns else math.nan
        for label, g in part[~is_base].groupby("label", sort=False):
            diff = g.groupby("category")["ms"].sum().sub(base, fill_value=0.0)
            diff = diff[diff.abs() >= 0.005].sort_values(key=lambda v: -v.abs()).head(top)
            where = ", ".join(f"{c} {v:+.2f} ms" for c, v in diff.items()) or "no category differs"
            if "wall_ms" in g.columns:
                wall = float(g["wall_ms"].iloc[0])
                head = (f"{label}: {wall:.2f} ms per decode step vs {base_wall:.2f} ms for {base_label} "
                        f"({wall - base_wall:+.2f} ms)")
            else:
                head = f"{label} vs {base_label}"
            lines.append(f"{head}; largest differences: {where}")
    return lines


def summary_markdown(study: Study) -> str:
    """The report's opening lines: what ran, where, and a loud note when weights were synthetic."""
    rec = study.records
    perf, quality = study.perf, study.quality
    lines = [f"**Sweep folder:** `{study.folder.name or study.folder.resolve().name}` · "
             f"{len(perf)} performance runs, {len(quality)} quality records, "
             f"{len(failed_records(rec))} failed"]
    for col, name in (("model", "model"), ("device", "device"), ("gpu_name", "GPU"),
                      ("energy_source", "energy source")):
        v = _unique(rec, col)
        if v:
            lines.append(f"**{name}:** {v}")
    if study.manifests:
        counts = rec["sweep_dir"].value_counts() if "sweep_dir" in rec.columns else pd.Series(dtype=int)
        lines.append("**sweeps:** " + ", ".join(f"`{name}` ({int(counts.get(name, 0))} records)"
                                                  for name in study.manifests))
    weights = _unique(rec, "weights") or "unknown"
    lines.append(f"**weights: {weights}**")
    if study.synthetic:
        lines.append(f"> weights: synthetic ({SYNTHETIC_NOTE}).")
    return "\n\n".join(lines)


# ---------------------------------------------------------------------------------------------
# provenance


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                out.update(_flatten(x, f"{key}[{i}]."))
        else:
            out[key] = v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v)
    return out


def _unique(records: pd.DataFrame, col: str) -> str | None:
    if col not in records.columns:
        return None
    vals = [str(v) for v in dict.fromkeys(records[col].dropna())]
    return ", ".join(vals) if vals else None


# Manifest entries shown first (matched by key suffix anywhere in manifest.json; first match wins).
MANIFEST_HEADLINES = (
    ("gpu_name", "GPU (NVML)"), ("driver", "driver"), ("cuda_driver_version", "CUDA driver"),
    ("torch_cuda", "torch CUDA"), ("packages.torch", "torch"), ("packages.transformers", "transformers"),
    ("packages.optimum-quanto", "optimum-quanto"), ("packages.kvlab", "kvlab"), ("git_sha", "git commit"),
    ("git_dirty", "uncommitted changes"), ("python", "python"), ("platform", "platform"),
    ("energy_source", "energy source (manifest)"),
)


def _compact_key(key: str) -> bool:
    return key.startswith("params.") or ("." not in key and "[" not in key and key != "run_ids")


def provenance(manifest: dict, records: pd.DataFrame, full: bool = False) -> pd.DataFrame:
    """A ``value`` column indexed by ``item``: what ran where, weights first, then the manifest.

    The weights line always says ``synthetic`` when any record used synthetic weights, because a
    quality number from random weights must never pass for a real one. Without ``full`` the
    manifest part is its top-level facts and the sweep params (the headlines above cover the
    environment); ``full`` lists every entry.
    """
    rows: list[tuple[str, Any]] = []
    weights = _unique(records, "weights")
    if weights and "synthetic" in weights:
        weights = f"{weights} ({SYNTHETIC_NOTE})"
    rows.append(("weights", weights or "unknown (no weights column in records)"))
    for col, name in (("model", "model"), ("device", "device"), ("gpu_name", "GPU"), ("dtype", "dtype"),
                      ("attn_implementation", "attention"), ("sdpa_backend", "SDPA backend"),
                      ("energy_source", "energy source"), ("sweep", "sweep")):
        v = _unique(records, col)
        if v is not None:
            rows.append((name, v))
    if "status" in records.columns:
        rows.append(("runs", f"{int((records['status'] == 'ok').sum())} ok, "
                             f"{int((records['status'] != 'ok').sum())} failed"))
    flat = _flatten(manifest)
    if not flat:
        rows.append(("manifest", "manifest.json missing: driver and versions unknown"))
    for suffix, name in MANIFEST_HEADLINES:
        value = next((v for k, v in flat.items() if k == suffix or k.endswith("." + suffix)), None)
        if value is not None:
            rows.append((name, value))
    rows.extend((f"manifest: {k}", v) for k, v in flat.items() if full or _compact_key(k))
    return pd.DataFrame(rows, columns=["item", "value"]).set_index("item")


def provenance_by_sweep(manifests: dict[str, dict], records: pd.DataFrame, full: bool = False,
                        key: str = "sweep_dir") -> pd.DataFrame:
    """:func:`provenance` side by side, one column per sweep of a folder of sweeps (each from its
    own manifest and records, ``records[key] == name``); items in first-seen order, blank where a
    sweep lacks one (a quality pass has no sweep params)."""
    columns = {}
    for name, manifest in manifests.items():
        own = records[records[key] == name] if key in records.columns else records.iloc[0:0]
        columns[name] = provenance(manifest, own, full=full)["value"]
    if not columns:
        return pd.DataFrame(columns=["item"]).set_index("item")
    items = list(dict.fromkeys(i for col in columns.values() for i in col.index))
    out = pd.DataFrame({name: col.reindex(items) for name, col in columns.items()}, index=items)
    out.index.name = "item"
    return out.fillna("")


def study_provenance(study: Study, full: bool = False) -> pd.DataFrame:
    """The provenance table of a study: one ``value`` column for a sweep folder, one column per
    sweep for a folder of sweeps."""
    if study.manifests:
        return provenance_by_sweep(study.manifests, study.records, full=full)
    return provenance(study.manifest, study.records, full=full)


# ---------------------------------------------------------------------------------------------
# loading


@dataclass
class Study:
    """A records folder as the report sees it: one sweep (``manifest``) or a folder of sweeps
    (``manifests``: subfolder -> manifest; records then carry ``sweep_dir``), plus any anatomy
    tables saved in it."""

    folder: Path
    records: pd.DataFrame
    manifest: dict = field(default_factory=dict)
    manifests: dict[str, dict] = field(default_factory=dict)
    anatomy: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def perf(self) -> pd.DataFrame:
        return perf_records(self.records)

    @property
    def quality(self) -> pd.DataFrame:
        return quality_records(self.records)

    @property
    def synthetic(self) -> bool:
        return "weights" in self.records.columns and (self.records["weights"] == "synthetic").any()


def sweep_manifests(folder: str | Path) -> dict[str, dict]:
    """A folder of sweeps: subfolder (relative path) -> its manifest.json; empty when ``folder``
    itself is a sweep (has a manifest.json) or holds none."""
    folder = Path(folder)
    if (folder / "manifest.json").is_file():
        return {}
    out = {}
    for path in sorted(folder.rglob("manifest.json")):
        try:
            out[path.parent.relative_to(folder).as_posix()] = json.loads(path.read_text())
        except json.JSONDecodeError:
            out[path.parent.relative_to(folder).as_posix()] = {"error": "manifest.json is not valid JSON"}
    return out


def _sweep_dir(record_folder: Any, root: Path, names: Sequence[str]) -> str | None:
    """The sweep a record came from: the deepest manifest folder containing its records file."""
    try:
        rel = Path(str(record_folder)).relative_to(root).as_posix()
    except ValueError:
        return None
    found = [n for n in names if rel == n or rel.startswith(n + "/")]
    return max(found, key=len) if found else None


def load_study(folder: str | Path) -> Study:
    """Records (via kvlab.records.load_records), manifest(s) and anatomy tables of a sweep folder or
    of a folder of sweeps (subfolders with their own manifest.json, e.g. one GPU campaign)."""
    from kvlab.records import load_records

    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"records folder {folder} does not exist: run `kvlab sweep PARAMS.yaml -o {folder}`")
    records = load_records(folder)
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifests = sweep_manifests(folder)
    if manifests and "folder" in records.columns:
        records = records.assign(sweep_dir=[_sweep_dir(f, folder, list(manifests)) for f in records["folder"]])
    return Study(folder, records, manifest, manifests, load_anatomy(folder))


# ---------------------------------------------------------------------------------------------
# notebook glue


def project_root(start: str | Path | None = None) -> Path:
    """The kvlab checkout around ``start`` (default: cwd): the nearest folder up with a
    pyproject.toml and a notebooks/ folder; cwd when there is none (an installed kvlab)."""
    start = Path(start or Path.cwd()).resolve()
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "notebooks").is_dir():
            return folder
    return start


def project_path(path: str | Path) -> Path:
    """A notebook path parameter: absolute as given; relative to cwd if it exists there, else to
    the project root, so one value works from JupyterLab (cwd notebooks/), from papermill run at
    the root, and as ``"."`` when ``kvlab report`` runs the notebook inside the records folder."""
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    return project_root() / path


def notebook_sweep_params(params_file: str | Path | None = None, namespace: dict | None = None, **values):
    """Sweep params for the sweep notebook: the YAML file as the base, then every sweep key that is
    not None in ``namespace`` (the notebook's ``globals()``: its parameters, including what
    papermill ``-p``/``-f`` injected) and in ``values``.

    Validated by kvlab.params (a scalar ``ctx`` becomes a one-element list there).
    """
    import yaml

    from kvlab.params import SweepParams, parse_params

    data: dict[str, Any] = {}
    if params_file:
        path = project_path(params_file)
        if not path.is_file():
            raise ReportError(f"params file {path} not found: pass params_file='params/smoke.yaml' or None")
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        data.setdefault("name", path.stem)
    merged = {k: v for k, v in (namespace or {}).items() if k in SweepParams.model_fields}
    merged.update(values)
    data.update({k: v for k, v in merged.items() if v is not None})
    return parse_params(data)


# ---------------------------------------------------------------------------------------------
# rendering


# nbconvert's lab template, minus every script it would fetch from a CDN (require.js, MathJax,
# mermaid, the widget manager: widgets do not render in static HTML anyway). Report markdown
# uses no LaTeX; plotly.js is embedded by kvlab.viz.
OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
"""


def execute_notebook(notebook: str | Path, output: str | Path, parameters: dict | None = None,
                     cwd: str | Path | None = None, kernel_name: str = "python3",
                     timeout: int | None = 1800, log_output: bool = False):
    """Run a notebook with papermill; returns the executed notebook node.

    Absolute paths papermill records in the notebook metadata are cut to file names, so a
    published notebook leaks nothing about the machine.
    """
    import nbformat
    import papermill as pm

    notebook, output = Path(notebook), Path(output)
    if not notebook.is_file():
        raise ReportError(f"notebook {notebook} not found: run from a kvlab checkout or pass --notebook")
    output.parent.mkdir(parents=True, exist_ok=True)
    pm.execute_notebook(str(notebook), str(output), parameters=parameters or {}, cwd=str(cwd) if cwd else None,
                        kernel_name=kernel_name, execution_timeout=timeout, log_output=log_output,
                        progress_bar=False)
    nb = nbformat.read(output, as_version=4)
    meta = nb.metadata.get("papermill", {})
    for key in ("input_path", "output_path"):
        if meta.get(key):
            meta[key] = Path(meta[key]).name
    nbformat.write(nb, output)
    return nb


def export_html(nb, html_path: str | Path, title: str | None = None) -> Path:
    """Notebook node -> one self-contained HTML file: code hidden, prompts hidden, no CDN scripts."""
    from nbconvert import HTMLExporter

    html_path = Path(html_path)
    if title:
        nb.metadata["title"] = title
    exporter = HTMLExporter(template_name="lab", exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    exporter.raw_template = OFFLINE_TEMPLATE
    body, _ = exporter.from_notebook_node(nb)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(body, encoding="utf-8")
    return html_path


def render_notebook(notebook: str | Path, html_path: str | Path, parameters: dict | None = None,
                    cwd: str | Path | None = None, title: str | None = None, **execute_kwargs) -> Path:
    """Execute a notebook and export it; the executed ``.ipynb`` is kept next to the HTML."""
    html_path = Path(html_path)
    executed = html_path.with_suffix(".ipynb")
    nb = execute_notebook(notebook, executed, parameters, cwd=cwd, **execute_kwargs)
    return export_html(nb, html_path, title=title)


def render_report(records_dir: str | Path, out: str | Path | None = None, notebook: str | Path | None = None,
                  index: bool = True, parameters: dict | None = None, **execute_kwargs) -> Path:
    """``kvlab report``: the report notebook over one records folder -> HTML (+ the folder index).

    The notebook runs with the records folder as its working directory and ``records_dir="."``,
    so no absolute path enters the published notebook. Default output: ``DIR/report.html``; the
    index goes in the folder above the report's folder (where sweep folders sit side by side).
    """
    records_dir = Path(records_dir).resolve()
    if not records_dir.is_dir():
        raise ReportError(f"records folder {records_dir} does not exist: run `kvlab sweep PARAMS.yaml -o DIR` first")
    out = Path(out) if out else records_dir / "report.html"
    if out.suffix != ".html":
        raise ReportError(f"output {out} must end in .html")
    params = {"records_dir": ".", **(parameters or {})}
    html_path = render_notebook(notebook or REPORT_NOTEBOOK, out, params, cwd=records_dir,
                                title=f"kvlab report: {records_dir.name}", **execute_kwargs)
    if index:
        write_index(index_folder(html_path))
    return html_path


def index_folder(html_path: str | Path) -> Path:
    """Where ``kvlab report`` writes index.html: above ``DIR/report.html``, else next to the file."""
    html_path = Path(html_path).resolve()
    return html_path.parent.parent if html_path.name == "report.html" else html_path.parent


def find_reports(folder: str | Path) -> list[Path]:
    """HTML reports in a folder: ``*.html`` and ``*/report.html`` (never index.html)."""
    folder = Path(folder)
    found = [p for p in folder.glob("*.html") if p.name != "index.html"]
    found += list(folder.glob("*/*.html"))
    return sorted({p for p in found if p.name != "index.html"})


def _html_title(path: Path) -> str:
    with path.open(encoding="utf-8", errors="replace") as f:
        head = f.read(4096)
    start, end = head.find("<title>"), head.find("</title>")
    return html.unescape(head[start + 7:end]).strip() if 0 <= start < end else path.stem


def write_index(folder: str | Path) -> Path:
    """``index.html`` listing the reports in a folder, newest first, with relative links."""
    folder = Path(folder)
    reports = sorted(find_reports(folder), key=lambda p: p.stat().st_mtime, reverse=True)
    items = []
    for p in reports:
        rel = p.relative_to(folder).as_posix()
        when = datetime.fromtimestamp(p.stat().st_mtime, UTC).strftime("%Y-%m-%d %H:%M UTC")
        items.append(f'<li><a href="{html.escape(rel)}">{html.escape(_html_title(p))}</a> '
                     f'<span class="meta">{html.escape(rel)} · {when} · {p.stat().st_size / 1e6:.1f} MB</span></li>')
    body = "\n".join(items) or "<li>no reports yet: run <code>kvlab report DIR</code></li>"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kvlab reports</title>
<style>body{{font-family:system-ui,sans-serif;max-width:50em;margin:2em auto}}
li{{margin:.4em 0}} .meta{{color:#777;font-size:.85em;margin-left:.6em}}</style></head>
<body><h1>kvlab reports</h1><ul>
{body}
</ul></body></html>
"""
    path = folder / "index.html"
    path.write_text(page, encoding="utf-8")
    return path
