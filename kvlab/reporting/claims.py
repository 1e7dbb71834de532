"""Claims are data: every number README.md, reports/RESULTS.md and ARCHITECTURE.md state is
recomputed from committed files by one function here, named in ``reports/claims.yaml``.

A claim entry names the text files that print it, the exact text they print (``printed``), the
committed data (``data``: folders or files under the repository), a function of this module
(``compute``) with its ``args``, and ``format``: a ``str.format`` template over the function's
result that must reproduce ``printed`` exactly, so text and data agree at the printed precision.
``tests/test_claims.py`` checks every entry, and that every measurement-like number in those texts
(:func:`measured_numbers`) lies inside some entry's printed text.

Every interval goes through :func:`interval`, the one place this module meets kvlab's statistics.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from kvlab.records import load_records, read_json
from kvlab.reporting.frames import contended_mask, ok_mask
from kvlab.reporting.stats import ratio_ci
from kvlab.reporting.summaries import compression_pays

MIN_RUNS_FOR_INTERVAL = 3  # fewer runs on a side: a value and its n, never an interval


def interval(values: Sequence[float], baseline: Sequence[float]) -> tuple[float, float, float]:
    """Ratio of means with its 95% interval (the report's own :func:`kvlab.reporting.stats.ratio_ci`);
    NaN bounds when either side has fewer than :data:`MIN_RUNS_FOR_INTERVAL` runs."""
    ratio, lo, hi = ratio_ci(list(values), list(baseline))
    if min(len(values), len(baseline)) < MIN_RUNS_FOR_INTERVAL:
        return ratio, math.nan, math.nan
    return ratio, lo, hi


def ratio_fields(ratio: float, lo: float, hi: float, n: int, n_base: int) -> dict[str, Any]:
    """A ratio as every form a text prints: ``ratio``, ``pct`` (+40 for 1.40), their bounds
    (None without an interval, so a template that prints one fails) and the runs per side."""
    has = not (math.isnan(lo) or math.isnan(hi))
    return {"ratio": ratio, "pct": (ratio - 1) * 100, "saving_pct": (1 - ratio) * 100,
            "lo": lo if has else None, "hi": hi if has else None,
            "lo_pct": (lo - 1) * 100 if has else None, "hi_pct": (hi - 1) * 100 if has else None,
            "n": n, "n_base": n_base, "runs": f"n={n}" if n == n_base else f"n={n} vs {n_base}"}


def _rows(root: Path, data: Sequence[str], where: Mapping[str, Any], kind: str = "perf") -> pd.DataFrame:
    """Ok records of ``kind`` (``perf`` or ``quality``) under ``data`` (paths relative to ``root``)
    whose columns equal ``where`` (uncontended runs only: a report's ratios leave contended runs out)."""
    df = pd.concat([load_records(root / d, kind=kind) for d in data], ignore_index=True)
    df = df[ok_mask(df) & ~contended_mask(df)]  # the records' own labels, not the report's
    for key, want in where.items():
        if key not in df.columns:
            raise KeyError(f"no column {key!r} in {list(data)}")
        df = df[df[key] == want]
    return df


def _cards(rows: pd.DataFrame) -> set[str]:
    """The cards the rows ran on: GPU uuids where records carry them, else GPU names."""
    for col in ("gpu_uuid", "gpu_name"):
        if col in rows.columns and rows[col].notna().any():
            return {str(v) for v in rows[col].dropna()}
    return set()


def records_ratio(root: Path, data: Sequence[str], metric: str, where: Mapping[str, Any],
                  base: Mapping[str, Any]) -> dict[str, Any]:
    """Mean ``metric`` of the records matching ``where`` over those matching ``where`` updated with
    ``base`` (the baseline's columns), with :func:`interval`; refused when the runs cross cards."""
    rows, base_rows = _rows(root, data, where), _rows(root, data, {**where, **base})
    if rows.empty or base_rows.empty:
        raise ValueError(f"no runs for {dict(where)} or its baseline {dict(base)} in {list(data)}")
    cards = _cards(pd.concat([rows, base_rows]))
    if len(cards) > 1:
        raise ValueError(f"{dict(where)} over {dict(base)} in {list(data)} would cross cards: {sorted(cards)}")
    x, b = rows[metric].astype(float), base_rows[metric].astype(float)
    return ratio_fields(*interval(x.tolist(), b.tolist()), len(x), len(b))


def records_mean(root: Path, data: Sequence[str], metric: str, where: Mapping[str, Any],
                 scale: float = 1.0, kind: str = "perf") -> dict[str, Any]:
    """Mean of ``metric`` (times ``scale``: 1e-9 for GB) over the matching records of ``kind``, and their n."""
    x = _rows(root, data, where, kind)[metric].astype(float) * scale
    if x.empty:
        raise ValueError(f"no runs for {dict(where)} in {list(data)}")
    return {"value": float(x.mean()), "n": len(x), "min": float(x.min()), "max": float(x.max())}


def verdict(root: Path, data: Sequence[str], label: str, ctx: int, batch: int = 1) -> dict[str, Any]:
    """The report's own answer for one method in one (ctx, batch) cell (:func:`compression_pays`:
    CPU ms/token on a CPU, J/token on a GPU), as ratio fields plus ``verdict``."""
    records = pd.concat([load_records(root / d) for d in data], ignore_index=True)
    pays = compression_pays(records)
    row = pays[(pays["label"] == label) & (pays["ctx"] == ctx) & (pays["batch"] == batch)]
    if len(row) != 1:
        raise ValueError(f"{len(row)} cells for {label} at ctx {ctx}, batch {batch} in {list(data)}")
    r = row.iloc[0]
    cost = r["cost"]
    lo, hi = r[f"{cost}_ratio_lo"], r[f"{cost}_ratio_hi"]
    if min(int(r["n"]), int(r["n_base"])) < MIN_RUNS_FOR_INTERVAL:
        lo = hi = math.nan
    return {**ratio_fields(float(r[f"{cost}_ratio"]), float(lo), float(hi), int(r["n"]), int(r["n_base"])),
            "verdict": r["verdict"]}


def json_value(root: Path, data: Sequence[str], path: Sequence[Any], scale: float = 1.0) -> dict[str, Any]:
    """One number of a committed JSON file (``data[0]``, plain or .xz), reached by ``path`` (keys
    and list indexes, or ``{key: value}`` to pick the list item whose key equals value)."""
    node: Any = read_json(root / data[0])
    for step in path:
        if isinstance(step, Mapping):
            node = next(item for item in node if all(item.get(k) == v for k, v in step.items()))
        else:
            node = node[step]
    return {"value": float(node) * scale}


COMPUTE = {"records_ratio": records_ratio, "records_mean": records_mean, "verdict": verdict,
           "json_value": json_value}


def recompute(root: Path, claim: Mapping[str, Any]) -> str:
    """The text a claim's data gives: its function's result through its ``format``."""
    fn = COMPUTE[claim["compute"]]
    result = fn(root, claim["data"], **claim.get("args", {}))
    return flat(claim["format"].format(**result))


# A measurement as prose prints one: a number with a unit or a ratio/percent sign, an interval, or
# any number with a decimal point (0.86). Bare integers are counts and settings (3 runs, batch 16).
_NUMBER = r"(?<![\w.])[+\-−]?\d[\d,]*(?:\.\d+)?"
MEASURED = re.compile(
    rf"\[{_NUMBER}%?, {_NUMBER}%?\]"  # an interval [0.49, 0.51]
    rf"|{_NUMBER}(?:-{_NUMBER})?(?:%|x\b| ?(?:ms|s|J|GB|MB|TB/s|GB/s|W|tokens/s|nats|CPU s)\b)"
    r"|(?<![\w.\-])\d+\.\d+(?![\w.])")
# What is not prose: code, inline code, link targets, and a keep ratio (a setting: "keep 0.1").
_SKIPPED = re.compile(r"```.*?```|`[^`\n]*`|\]\([^)]*\)|\bkeep(?:ing)? \d\.\d+(?: and \d\.\d+)?", re.S)


def flat(text: str) -> str:
    """Text with every run of whitespace as one space: a printed claim may wrap anywhere."""
    return " ".join(text.split())


def measured_numbers(text: str) -> list[tuple[int, str]]:
    """(offset, text) of every measurement-like number in prose (code and link targets skipped)."""
    masked = _SKIPPED.sub(lambda m: " " * len(m.group()), text)
    return [(m.start(), m.group()) for m in MEASURED.finditer(masked)]


def uncovered_numbers(text: str, printed: Sequence[str], exempt: Sequence[str] = ()) -> list[str]:
    """The measurement-like numbers of ``text`` outside every occurrence of a ``printed`` claim text
    or an ``exempt`` text (all compared with whitespace flattened)."""
    text = flat(text)
    spans = [(m.start(), m.end()) for p in [*printed, *exempt] if p
             for m in re.finditer(re.escape(flat(p)), text)]
    return [num for at, num in measured_numbers(text)
            if not any(a <= at and at + len(num) <= b for a, b in spans)]
