"""Which card measured each record, and what a folder of several cards cannot compare.

A ratio is formed only between runs on one card (the ``card`` column enters every comparison cell,
:data:`kvlab.reporting.summaries.CELL`). Records name their card by ``gpu_uuid``; records written
before they did get it at read time from their sweep's manifest: the invocation whose start and
finish bracket the record's ``created_at`` names the GPU its environment snapshot saw.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from kvlab.energy.device import norm_uuid

CPU = "cpu"


def card_label(name: Any, uuid: Any) -> str:
    """``NVIDIA H200 4753b853`` (the name and the UUID's first block), ``cpu``, or the name alone."""
    name = None if name is None or pd.isna(name) else str(name)
    if uuid is None or pd.isna(uuid) or not str(uuid):
        return name or "unknown card"
    short = norm_uuid(uuid).split("-")[0]
    return f"{name or 'GPU'} {short}"


def _invocations(manifest: Mapping) -> list[tuple[str, str, str | None, str | None]]:
    """(started_at, finished_at, gpu_uuid, gpu_name) of each invocation that snapshot a GPU."""
    out = []
    for inv in manifest.get("invocations", []) if isinstance(manifest, Mapping) else []:
        if not isinstance(inv, Mapping):
            continue
        gpu = (inv.get("env_start") or {}).get("gpu") or {}
        workers = inv.get("workers") or []
        uuid = gpu.get("gpu_uuid") or next((w.get("gpu_uuid") for w in workers if isinstance(w, Mapping)), None)
        name = gpu.get("gpu_name") or next((w.get("gpu_name") for w in workers if isinstance(w, Mapping)), None)
        end = inv.get("finished_at") or (inv.get("env_end") or {}).get("taken_at")
        if uuid and inv.get("started_at"):
            out.append((str(inv["started_at"]), str(end) if end else "9999", str(uuid), name))
    return out


def manifest_uuid(manifest: Mapping, created_at: Any) -> tuple[str | None, str | None]:
    """The GPU (uuid, name) of the invocation that ran at ``created_at``; (None, None) when none
    brackets it. ISO timestamps of one zone compare as text."""
    if created_at is None or pd.isna(created_at):
        return None, None
    t = str(created_at)
    for start, end, uuid, name in _invocations(manifest):
        if start <= t <= end:
            return uuid, name
    return None, None


def with_cards(records: pd.DataFrame, manifest: Mapping | None = None,
               manifests: Mapping[str, Mapping] | None = None) -> pd.DataFrame:
    """``records`` with ``gpu_uuid`` filled from the manifests where a record lacks it
    (``card_from``: ``record``, ``manifest`` or None) and a ``card`` column (:func:`card_label`;
    ``cpu`` for CPU runs)."""
    if records.empty:
        return records.assign(card=pd.Series(dtype=object))
    df = records.copy()
    uuids = list(df["gpu_uuid"]) if "gpu_uuid" in df.columns else [None] * len(df)
    names = list(df["gpu_name"]) if "gpu_name" in df.columns else [None] * len(df)
    sweeps = list(df["sweep_dir"]) if "sweep_dir" in df.columns else [None] * len(df)
    created = list(df["created_at"]) if "created_at" in df.columns else [None] * len(df)
    devices = list(df["device"]) if "device" in df.columns else [None] * len(df)
    source: list[str | None] = []
    for i in range(len(df)):
        if uuids[i] is not None and not pd.isna(uuids[i]) and str(uuids[i]):
            source.append("record")
            continue
        m = (manifests or {}).get(sweeps[i]) if sweeps[i] is not None else manifest
        uuid, name = manifest_uuid(m or {}, created[i])
        if uuid:
            uuids[i], names[i] = uuid, names[i] if names[i] is not None and not pd.isna(names[i]) else name
            source.append("manifest")
        else:
            source.append(None)
    cards = [CPU if str(d) == "cpu" and (u is None or pd.isna(u)) else card_label(n, u)
             for d, n, u in zip(devices, names, uuids, strict=True)]
    return df.assign(gpu_uuid=uuids, card=cards, card_from=source)


def cards_note(records: pd.DataFrame, baseline: str = "full") -> str | None:
    """A sentence when the records hold more than one card: the cards with their run counts, that
    ratios stay within a card, and each comparison that only another card's baseline could make."""
    if "card" not in records.columns:
        return None
    runs = records[records["kind"] == "perf"] if "kind" in records.columns else records
    if "status" in runs.columns:
        runs = runs[runs["status"] == "ok"]
    counts = runs["card"].value_counts()
    if len(counts) < 2:
        return None
    text = (f"{len(counts)} cards measured these runs ("
            + ", ".join(f"{card}: {n}" for card, n in counts.items())
            + "); every ratio compares runs on one card.")
    crossing = crossing_cells(runs, baseline)
    if crossing:
        text += (f" {len(crossing)} comparisons have their {baseline} baseline only on another card and get no "
                 "ratio: " + "; ".join(crossing[:8]) + ("; ..." if len(crossing) > 8 else "") + ".")
    return text


def _plain(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def crossing_cells(runs: pd.DataFrame, baseline: str = "full") -> list[str]:
    """Labels whose cell (model, engine, weights, ctx, batch) has a baseline run on some card but
    none on the label's own: a ratio there would cross cards."""
    if "method" not in runs.columns or "card" not in runs.columns:
        return []
    keys = [c for c in ("model", "engine", "weights_quant", "ctx", "batch") if c in runs.columns]
    out = []
    label = runs["label"] if "label" in runs.columns else runs["method"]
    for cell_key, cell in runs.assign(_label=label).groupby(keys, sort=True, dropna=False):
        base_cards = set(cell.loc[cell["method"] == baseline, "card"])
        if not base_cards:
            continue
        for (lab, card), _ in cell[cell["method"] != baseline].groupby(["_label", "card"], sort=True):
            if card not in base_cards:
                where = dict(zip(keys, cell_key if isinstance(cell_key, tuple) else (cell_key,), strict=True))
                at = ", ".join(f"{k} {_plain(v)}" for k, v in where.items() if k in ("ctx", "batch", "engine"))
                out.append(f"{lab} ({at}) on {card}, {baseline} on {', '.join(sorted(base_cards))}")
    return out
