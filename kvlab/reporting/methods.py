"""The methods table: per method label, one row that puts together what the other sections show
apart. Parity (mean Jaccard of kept positions against NVIDIA kvpress, from a ``parity.json`` written
by ``benchmarks/kvpress_parity.py``), KV bytes freed, decode J/token, TTFT and prefill energy against
the full cache (from performance records), and quality (needle score, continuation KL and top-1
agreement, from quality records).

The parts may come from different sweeps, models and devices (e.g. an H200 perf sweep on synthetic
weights and a CPU quality pass on real ones), so each row says where its numbers were measured
(``perf_at``, ``quality_at``). A method is matched across them by its policy parameters without
``keep`` and ``bits`` (:func:`method_key`): parity is a property of the method, measured at the
keeps the parity file holds, not only at the row's keep.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from kvlab.reporting import ReportError
from kvlab.reporting.fidelity import COLLAPSE_KL, FOUND
from kvlab.reporting.frames import contended_mask, fill_labels
from kvlab.reporting.stats import ratio_ci, reading_order
from kvlab.reporting.text import fmt_ctx

PARITY_FILE = "parity.json"
PERF_CELL = ("model", "weights_quant", "engine", "ctx", "batch", "card")  # never a ratio across cards
# policy parameters that place a method on its axis, not what the method is
AXIS_PARAMS = ("keep", "bits")
PERF_RATIOS = {"decode_j_per_token": "decode_j_vs_full", "ttft_s": "ttft_vs_full", "prefill_j": "prefill_j_vs_full"}
COLUMNS = ["label", "method", "key", "parity_jaccard", "parity_min", "parity_cases", "perf_at", "perf_runs",
           "kv_freed", "peak_freed_gb", *[c for r in PERF_RATIOS.values() for c in (r, f"{r}_lo", f"{r}_hi")],
           "ttft_s", "prefill_j", "quality_at", "needle", "needle_items", "kl", "top1_agree", "fidelity_items",
           "kv_freed_quality"]


def method_key(params: Any) -> str | None:
    """A method's identity across records and the parity file: its policy parameters (a record's
    ``policy_params``) without ``keep``/``bits`` and without unset (None) values, as sorted JSON."""
    if isinstance(params, str):
        try:
            params = json.loads(params)
        except json.JSONDecodeError:
            return None
    if not isinstance(params, dict) or "method" not in params:
        return None
    kept = {k: v for k, v in params.items() if k not in AXIS_PARAMS and v is not None}
    return json.dumps(kept, sort_keys=True, default=str)


def find_parity(folder: str | Path) -> Path | None:
    """The parity file of a records folder: ``folder/parity.json``, else the first one below it."""
    folder = Path(folder)
    if (folder / PARITY_FILE).is_file():
        return folder / PARITY_FILE
    return next(iter(sorted(folder.rglob(PARITY_FILE))), None) if folder.is_dir() else None


def load_parity(path: str | Path | None) -> pd.DataFrame:
    """The rows of a parity file (tokens, keep, method, mean_jaccard, min_jaccard, kvlab_params, ...)
    with their method ``key``; empty for None. Rows written before ``kvlab_params`` existed have no
    key and match no method."""
    if path is None:
        return pd.DataFrame(columns=["tokens", "keep", "method", "mean_jaccard", "min_jaccard", "key"])
    path = Path(path)
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ReportError(f"parity file {path} is not readable as benchmarks/kvpress_parity.py's output "
                          f"({type(err).__name__}: {err}); pass the parity.json it wrote") from err
    df = pd.DataFrame(rows)
    df["key"] = [method_key(p) for p in df.get("kvlab_params", pd.Series(None, index=df.index))]
    return df


def parity_summary(parity: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Per method key: the lowest mean Jaccard over the parity rows, the lowest single head, and
    which (tokens, keep) cases they cover."""
    out: dict[str, dict[str, Any]] = {}
    if parity.empty or "key" not in parity.columns:
        return out
    for key, rows in parity.dropna(subset=["key"]).groupby("key"):
        lengths = ", ".join(fmt_ctx(t) for t in sorted(set(rows["tokens"])))
        keeps = ", ".join(f"{k:.0%}" for k in sorted(set(rows["keep"]), reverse=True))
        out[key] = {"parity_jaccard": float(rows["mean_jaccard"].min()), "parity_min": float(rows["min_jaccard"].min()),
                    "parity_cases": f"{len(rows)}: {lengths} · keep {keeps}"}
    return out


def _keyed(df: pd.DataFrame) -> pd.DataFrame:
    """Ok records with a filled label and their method key."""
    if "status" in df.columns:
        df = df[df["status"] == "ok"]
    if df.empty or "method" not in df.columns:
        return df.iloc[0:0].assign(label=pd.Series(dtype=object), key=pd.Series(dtype=object))
    params = df["policy_params"] if "policy_params" in df.columns else pd.Series(None, index=df.index)
    return df.assign(label=fill_labels(df), key=[method_key(p) for p in params])


def _where(part: pd.DataFrame, cols: Iterable[str]) -> str:
    bits = []
    for col in cols:
        if col in part.columns:
            values = [v for v in dict.fromkeys(part[col].dropna()) if v != "none"]
            if col == "ctx":
                values = [fmt_ctx(v) for v in values]
            elif col == "batch":
                values = [f"batch {int(v)}" for v in values]
            elif col == "length":
                values = [fmt_ctx(v) for v in sorted(values)]
            if values:
                bits.append(", ".join(map(str, values)))
    return " · ".join(bits)


def _num(df: pd.DataFrame, col: str) -> pd.Series:
    return pd.to_numeric(df[col], errors="coerce") if col in df.columns else pd.Series(math.nan, index=df.index)


def perf_part(records: pd.DataFrame, baseline: str = "full", n_boot: int = 2000, seed: int = 0
              ) -> dict[str, dict[str, Any]]:
    """Per label, its performance against the baseline in one cell (model, weights, engine, ctx,
    batch) where both ran ok and uncontended: the largest context, then the largest batch.
    KV freed is ``1 - cache_bytes / baseline's`` (the cache after the prefill), peak freed the
    baseline's peak minus the method's (GB); the ratios are of means, with an interval from 3 runs
    a side (:mod:`kvlab.intervals`)."""
    perf = records[records["kind"] == "perf"] if "kind" in records.columns else records
    perf = _keyed(perf)
    if perf.empty:
        return {}
    perf = perf[~contended_mask(perf)]
    for col in PERF_CELL:
        if col not in perf.columns:
            perf = perf.assign(**{col: "none"})
    perf = perf.assign(weights_quant=perf["weights_quant"].fillna("none"), engine=perf["engine"].fillna("hf"))
    out: dict[str, dict[str, Any]] = {}
    cells = sorted(perf.groupby(list(PERF_CELL), sort=False), key=lambda kv: (kv[0][3], kv[0][4]), reverse=True)
    for _cell, part in cells:
        base = part[(part["method"] == baseline) | (part["label"] == baseline)]
        if base.empty:
            continue
        for label, runs in part.groupby("label", sort=False):
            if label in out:
                continue
            row: dict[str, Any] = {"method": runs["method"].iloc[0], "key": runs["key"].iloc[0],
                                   "perf_at": _where(runs, PERF_CELL), "perf_runs": len(runs)}
            row["kv_freed"] = 1 - _num(runs, "cache_bytes").mean() / _num(base, "cache_bytes").mean()
            row["peak_freed_gb"] = (_num(base, "peak_mem_bytes").mean() - _num(runs, "peak_mem_bytes").mean()) / 1e9
            for metric, name in PERF_RATIOS.items():
                ratio = ratio_ci(_num(runs, metric), _num(base, metric), n_boot=n_boot, seed=seed)
                row.update(zip((name, f"{name}_lo", f"{name}_hi"), ratio, strict=True))
            row["ttft_s"], row["prefill_j"] = _num(runs, "ttft_s").mean(), _num(runs, "prefill_j").mean()
            out[label] = row
    return out


def quality_part(records: pd.DataFrame, baseline: str = "full") -> dict[str, dict[str, Any]]:
    """Per label, from ok quality records: the needle score (mean over ``niah*`` items whose cell has
    signal), continuation KL(full || method) and top-1 agreement (means over continuation items),
    and KV freed against the baseline's cache on the same items."""
    quality = records[records["kind"] == "quality"] if "kind" in records.columns else records.iloc[0:0]
    quality = _keyed(quality)
    if quality.empty:
        return {}
    item = [c for c in ("model", "task", "length", "depth", "sample") if c in quality.columns]
    base = quality[quality["method"] == baseline]
    base_bytes = (base.groupby(item, dropna=False)["cache_bytes"].mean()
                  if "cache_bytes" in base.columns and not base.empty else pd.Series(dtype=float))
    out: dict[str, dict[str, Any]] = {}
    for label, rows in quality.groupby("label", sort=False):
        task = rows["task"].astype(str) if "task" in rows.columns else pd.Series("", index=rows.index)
        signal = ~rows["no_signal"].fillna(False).astype(bool) if "no_signal" in rows.columns else True
        needle = rows[task.str.startswith("niah") & signal]
        fidelity = rows[task == "continuation"]
        row = {"method": rows["method"].iloc[0], "key": rows["key"].iloc[0],
               "quality_at": _where(rows, ("model", "device", "length")),
               "needle": _num(needle, "score").mean(), "needle_items": len(needle),
               "kl": _num(fidelity, "kl").mean(), "top1_agree": _num(fidelity, "top1_agree").mean(),
               "fidelity_items": len(fidelity)}
        if not base_bytes.empty and "cache_bytes" in rows.columns:
            paired = rows.set_index(item)["cache_bytes"].astype(float)
            ref = base_bytes.reindex(paired.index).to_numpy(dtype=float)
            row["kv_freed_quality"] = float(pd.Series(1 - paired.to_numpy() / ref).mean())
        out[label] = row
    return out


def methods_table(records: pd.DataFrame, parity: pd.DataFrame | None = None, baseline: str = "full",
                  n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """One row per method label found in perf or quality records (numbers, NaN where not measured):
    the columns of :data:`COLUMNS`. ``parity`` is :func:`load_parity`'s frame (or None)."""
    perf = perf_part(records, baseline, n_boot, seed)
    quality = quality_part(records, baseline)
    parity_rows = parity_summary(parity if parity is not None else pd.DataFrame())
    rows = []
    for label in dict.fromkeys([*perf, *quality]):
        row: dict[str, Any] = {"label": label}
        row.update(quality.get(label, {}))
        row.update(perf.get(label, {}))  # method and key agree; perf's win where both exist
        row.update(parity_rows.get(row.get("key"), {}))
        rows.append(row)
    table = pd.DataFrame(rows, columns=COLUMNS)
    if table.empty:
        return table
    return reading_order(table)


def _fmt(v: Any, spec: str, suffix: str = "") -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}{suffix}"


def _ratio_text(r: float, lo: float, hi: float) -> str:
    if r is None or math.isnan(r):
        return ""
    return f"{r:.2f}x" + ("" if math.isnan(lo) else f" [{lo:.2f}, {hi:.2f}]")


def methods_display(table: pd.DataFrame) -> pd.DataFrame:
    """The table as text for the report: empty cells where a part was not measured."""
    out = pd.DataFrame({"method": table["label"]})
    out["kvpress Jaccard (min head)"] = [
        "" if math.isnan(j) else f"{j:.3f} ({m:.3f})"
        for j, m in zip(table["parity_jaccard"].astype(float), table["parity_min"].astype(float), strict=True)]
    out["parity cases"] = table["parity_cases"].fillna("")
    out["KV freed"] = table["kv_freed"].map(lambda v: _fmt(v, ".0%"))
    out["peak freed GB"] = table["peak_freed_gb"].map(lambda v: _fmt(v, ".1f"))
    for name, header in (("decode_j_vs_full", "decode J/token vs full"), ("ttft_vs_full", "TTFT vs full"),
                         ("prefill_j_vs_full", "prefill J vs full")):
        out[header] = [_ratio_text(*v) for v in zip(*(table[f"{name}{s}"].astype(float) for s in ("", "_lo", "_hi")),
                                                     strict=True)]
    out["perf at"] = table["perf_at"].fillna("")
    out["needle"] = [_fmt(v, ".2f", f" ({n})") for v, n in zip(table["needle"].astype(float),
                                                               table["needle_items"].fillna(0).astype(int), strict=True)]
    out["continuation KL"] = table["kl"].map(lambda v: _fmt(v, ".3f"))
    out["top-1 agree"] = table["top1_agree"].map(lambda v: _fmt(v, ".2f"))
    out["KV freed (quality items)"] = table["kv_freed_quality"].map(lambda v: _fmt(v, ".0%"))
    out["quality at"] = table["quality_at"].fillna("")
    out["fidelity"] = [fidelity_flag(kl, needle) for kl, needle in zip(table["kl"].astype(float),
                                                                       table["needle"].astype(float), strict=True)]
    return out


def fidelity_flag(kl: float, needle: float) -> str:
    """A collapse flag for the methods table: continuation KL above :data:`COLLAPSE_KL`, or the needle
    found on fewer than half the items."""
    if not math.isnan(kl) and kl > COLLAPSE_KL:
        return f"COLLAPSES (KL {kl:.2f} > {COLLAPSE_KL:g})"
    if not math.isnan(needle) and needle < FOUND:
        return f"COLLAPSES (needle {needle:.2f})"
    return ""


def methods_lines(table: pd.DataFrame, parity_path: str | Path | None = None,
                  records: pd.DataFrame | None = None) -> list[str]:
    """What the table's parts read and where they are missing, one sentence each (with ``records``,
    also how many perf runs were left out as contended)."""
    busy = 0
    if records is not None and "kind" in records.columns:
        perf = records[(records["kind"] == "perf") & (records["status"] == "ok" if "status" in records.columns
                                                      else True)]
        busy = int(contended_mask(perf).sum())
    contended = (f"{busy} perf runs measured while other processes took the CPU (contended) are left out of the "
                 f"perf columns." if busy else "")
    if table.empty:
        return ["No performance or quality records: no methods table.", contended]
    lines = [f"Parity from {parity_path}." if parity_path else
             "No parity file given or found in the folder (`kvlab report --parity PATH`, written by "
             "`benchmarks/kvpress_parity.py`): the parity column is empty."]
    perf = table.dropna(subset=["perf_at"])
    if not perf.empty:
        lines.append("Perf columns compare each method with the full cache in the same cell (model, engine, "
                     "context, batch; the largest context, then batch, where both ran): " +
                     "; ".join(sorted(set(perf["perf_at"]))) + ".")
    lines.append(contended)
    quality = table.dropna(subset=["quality_at"])
    if not quality.empty:
        lines.append("Needle: mean score of the needle items (number of items in brackets); continuation KL and "
                     "top-1: means over continuation items, against the full cache on the same items.")
    return lines
