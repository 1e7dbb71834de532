"""Anatomy tables saved in a records folder (the stdout of ``kvlab anatomy --json``) and the
sentences that say why a method's decode step differs from the full cache's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from kvlab.anatomy import category_table

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
    if table is None or table.empty or not {"label", "category", "ms", "wall_ms", "busy_ms"} <= set(table.columns):
        return pd.DataFrame()
    return category_table(table)


def anatomy_lines(table: pd.DataFrame, baseline: str = "full", top: int = 3, hint: bool = True) -> list[str]:
    """Why a method's decode step is slower or faster than the full cache's, in ms per step: the
    wall-time difference and the ``top`` categories that differ most (e.g. dequantize for int4)."""
    if table is None or table.empty or not {"label", "category", "ms"} <= set(table.columns):
        return [ANATOMY_HINT] if hint else []  # hint=False: the figure's note says it
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

