"""Provenance: what ran where (weights first), from the records and each sweep's manifest."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from kvlab.reporting.frames import SYNTHETIC_NOTE, contended_mask


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


def distinct_values(records: pd.DataFrame, col: str) -> str | None:
    """A column's distinct values in first-seen order, joined by ", "; None when it has none."""
    if col not in records.columns:
        return None
    def text(v: Any) -> str:  # 2, not 2.0: whole numbers turn float next to rows that lack them
        return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)

    vals = list(dict.fromkeys(text(v) for v in records[col].dropna()))
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


def run_counts(records: pd.DataFrame) -> str:
    """'20 performance runs ok, 10 quality records ok, 0 failed (2 contended)': the counts of the
    report's opening line, split by kind so they add up (a kind with none is left out)."""
    ok = records["status"] == "ok" if "status" in records.columns else pd.Series(True, index=records.index)
    kind = records["kind"] if "kind" in records.columns else pd.Series("perf", index=records.index)
    parts = [f"{n} {what} ok" for what, n in (("performance runs", int((ok & (kind == "perf")).sum())),
                                              ("quality records", int((ok & (kind == "quality")).sum()))) if n]
    text = ", ".join([*parts, f"{int((~ok).sum())} failed"])
    busy = int((contended_mask(records) & ok & (kind == "perf")).sum())
    return text + (f" ({busy} contended)" if busy else "")


def provenance(manifest: dict, records: pd.DataFrame, full: bool = False) -> pd.DataFrame:
    """A ``value`` column indexed by ``item``: what ran where, weights first, then the manifest.

    The weights line always says ``synthetic`` when any record used synthetic weights, because a
    quality number from random weights must never pass for a real one. Without ``full`` the
    manifest part is its top-level facts and the sweep params (the headlines above cover the
    environment); ``full`` lists every entry.
    """
    rows: list[tuple[str, Any]] = []
    weights = distinct_values(records, "weights")
    if weights and "synthetic" in weights:
        weights = f"{weights} ({SYNTHETIC_NOTE})"
    rows.append(("weights", weights or "unknown (no weights column in records)"))
    for col, name in (("model", "model"), ("device", "device"), ("gpu_name", "GPU"), ("dtype", "dtype"),
                      ("attn_implementation", "attention"), ("sdpa_backend", "SDPA backend"),
                      ("energy_source", "energy source"), ("sweep", "sweep")):
        v = distinct_values(records, col)
        if v is not None:
            rows.append((name, v))
    if "status" in records.columns:
        rows.append(("runs", run_counts(records)))
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


