"""Selecting and deriving: which records a report section reads (ok/failed, perf/quality) and the
columns it adds (GB, throughput, labels rebuilt for failed runs), so every section counts alike."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from kvlab.sweep.params import method_axis

GB = 1e9
DEFAULT_CTX = 16384

SYNTHETIC_NOTE = "synthetic: seeded random weights; speed, memory and energy are faithful, quality is meaningless"


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
    cols = [c for c in ("sweep_dir", "method", "label", "engine", "ctx", "batch", "repeat", "error")
            if c in failed.columns]
    return _int_columns(failed[cols].copy())


def with_derived(df: pd.DataFrame) -> pd.DataFrame:
    """Add GB columns, fill ``tokens_per_s`` where missing and a ``label`` (see :func:`fill_labels`;
    prefixed by the model when several models are present) without touching the input."""
    df = df.copy()
    if "label" not in df.columns and "method" not in df.columns:
        df["label"] = "?"
    else:
        df["label"] = fill_labels(df)
    if "engine" in df.columns:
        df["engine"] = df["engine"].fillna("hf")  # records from before the engine column
    if "weights_quant" in df.columns:
        df["weights_quant"] = df["weights_quant"].fillna("none")  # records from before weight quantization
    if "engine" in df.columns and df["engine"].nunique() > 1:  # hf and fast: a method on each is two rows
        tags = df[[c for c in ("engine", "kv_format", "fast_attention") if c in df.columns]].to_dict("records")
        df["label"] = [f"{lab} · {engine_tag(row)}" for lab, row in zip(df["label"].astype(str), tags, strict=True)]
    if "model" in df.columns and df["model"].nunique() > 1:  # a sweep over models: keep them apart
        prefix = df["model"].astype(str) + " · "
        labels = df["label"].astype(str)
        df["label"] = [lab if lab.startswith(p) else p + lab for p, lab in zip(prefix, labels, strict=True)]
    for src, dst in (("peak_mem_bytes", "peak_mem_gb"), ("cache_bytes", "cache_gb")):
        if src in df.columns:
            df[dst] = pd.to_numeric(df[src], errors="coerce") / GB
    if any(c in df.columns for c in ("tokens_per_s", "decode_s")):
        df["tokens_per_s"] = decode_throughput(df)
    df = df.assign(**cpu_time_per_token(df))
    return _int_columns(df)


def cpu_time_per_token(df: pd.DataFrame) -> dict[str, pd.Series]:
    """The process's CPU time (user + system, all threads) per generated token, split as energy is:
    ``cpu_ms_per_token`` over the prefill and decode (the tokens of the whole batch, like
    ``j_per_token``) and ``decode_cpu_ms_per_token`` over the decode steps (``batch * (new_tokens - 1)``,
    like ``decode_j_per_token``). Empty where the records carry no host counters (kvlab.hostload)."""
    if "decode_host_process_cpu_ms" not in df.columns or "new_tokens" not in df.columns:
        return {}
    def num(col: str) -> pd.Series:
        if col not in df.columns:
            return pd.Series(math.nan, index=df.index, dtype=float)
        return pd.to_numeric(df[col], errors="coerce")

    batch = num("batch").fillna(1.0)
    new = num("new_tokens")
    decode = num("decode_host_process_cpu_ms")
    steps = batch * (new - 1)
    out = {"decode_cpu_ms_per_token": (decode / steps).where(steps > 0)}
    total = decode + num("prefill_host_process_cpu_ms")
    out["cpu_ms_per_token"] = (total / (batch * new)).where(new > 0)
    return out


def cpu_only(df: pd.DataFrame) -> bool:
    """True when every record ran on a CPU (``device`` not CUDA): its cost is CPU time, not energy."""
    if "device" not in df.columns or df.empty:
        return False
    return not df["device"].astype(str).str.startswith("cuda").any()


def engine_tag(record: dict) -> str:
    """``hf``, ``fast``, or for a quantized store on ``fast`` what it really ran (e.g. ``fast int4-g64
    fused``: quanto's method label, kvlab's format and kernel)."""
    engine = record.get("engine") or "hf"
    fmt = record.get("kv_format")
    if engine == "fast" and isinstance(fmt, str) and fmt != "model dtype":
        return f"fast {fmt} {record.get('fast_attention') or ''}".strip()
    return engine


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
        return store_labels(df, labels)
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
    return store_labels(df, out)


# Names whose rows on the fast engine ran kvlab's own store: records from before their label said so
# (:meth:`kvlab.policies.base.Policy.engine_label`) carry the name; their kv_format says what ran.
RECORDED_ALIASES = ("quanto", "fp8")


def store_labels(df: pd.DataFrame, labels: pd.Series) -> pd.Series:
    """``labels`` with each fast-engine row recorded under a name whose store did not run relabelled by
    the store that did, as new records are: 'kvq int4-g64 (asked: quanto int4)', 'snapkv 10% + kvq
    fp8 (asked: snapkv 10% + fp8)'. Rows without ``kv_format``, or labelled so already, keep theirs."""
    if not {"engine", "kv_format", "method"} <= set(df.columns):
        return labels
    out = labels.copy().astype(object)
    for idx in df.index[(df["engine"] == "fast") & df["kv_format"].notna()]:
        row, label, fmt = df.loc[idx], str(labels[idx]), str(df.at[idx, "kv_format"])
        if "(asked: " in label:
            continue
        params = row.get("policy_params")
        quant = params.get("quant") if isinstance(params, dict) else None
        if row["method"] in RECORDED_ALIASES:
            ran = f"kvq {fmt}"
        elif isinstance(quant, dict) and quant.get("backend") in RECORDED_ALIASES and " + " in label:
            ran = f"{label.split(' + ')[0]} + kvq {fmt}"
        else:
            continue
        out[idx] = f"{ran} (asked: {label})"
    return out


def pick_ctx(records: pd.DataFrame, ctx: int | None = None) -> tuple[int | None, str]:
    """The context to tabulate: ``ctx`` if measured, else the nearest measured one (and a note).
    Unasked (None): the study's 16k if measured, else the nearest measured, and the caption names
    only what was measured."""
    if records.empty or "ctx" not in records.columns:
        return None, "no records"
    available = sorted(int(c) for c in records["ctx"].dropna().unique())
    target = DEFAULT_CTX if ctx is None else ctx
    if target in available:
        return target, f"ctx {target}"
    nearest = min(available, key=lambda c: (abs(math.log(c / target)), -c))
    if ctx is None:
        return nearest, f"ctx {nearest}"
    return nearest, f"ctx {nearest} ({ctx} was not measured; measured: {', '.join(map(str, available))})"



def all_perf_records(records: pd.DataFrame) -> pd.DataFrame:
    """Performance records, ok and failed, with the derived columns (failed runs keep a label)."""
    df = records
    if "kind" in df.columns:
        df = df[df["kind"] == "perf"]
    return with_derived(df)


def ok_mask(df: pd.DataFrame) -> pd.Series:
    """True for runs recorded ok (every row where the records carry no ``status``)."""
    return df["status"] == "ok" if "status" in df.columns else pd.Series(True, index=df.index)


def energy_missing(records: pd.DataFrame) -> str | None:
    """Why a folder has no energy numbers, from what its runs recorded (``energy_source``: e.g.
    "none: device 'cpu' has no NVML energy counter"); None when some run has J/token."""
    if "j_per_token" in records.columns and pd.to_numeric(records["j_per_token"], errors="coerce").notna().any():
        return None
    sources = [str(s) for s in dict.fromkeys(records.get("energy_source", pd.Series(dtype=object)).dropna())]
    reasons = [s.split(":", 1)[1].strip() for s in sources if s.startswith("none:")]
    if reasons:
        return "no energy measured: " + "; ".join(reasons)
    return "no energy measured: these records have no energy_source" if not sources else "no J/token recorded"


def memory_note(records: pd.DataFrame) -> str | None:
    """What "peak memory" means in these records when it is not the CUDA allocator's peak."""
    sources = set(records["peak_mem_source"].dropna()) if "peak_mem_source" in records.columns else set()
    if any("RSS" in str(s) for s in sources):
        return ("peak memory on CPU is the process's peak resident set size over each run: the weights, "
                "the cache, activations and the Python process itself")
    return None


def contended_mask(df: pd.DataFrame) -> pd.Series:
    """True for runs flagged ``contended`` (other work took the CPU while they decoded: their
    times say more about the neighbours than about the method); False where unflagged or unknown."""
    if "contended" not in df.columns:
        return pd.Series(False, index=df.index)
    return df["contended"].map(lambda v: v is True or v == 1.0 or v is np.True_).astype(bool)


def smallest_batch(records: pd.DataFrame) -> int | None:
    if records.empty or "batch" not in records.columns or records["batch"].isna().all():
        return None
    return int(records["batch"].min())

