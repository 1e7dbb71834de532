"""A method's quality beside its cost: what the report's verdicts read before calling a method a saving.

A verdict that a method "pays" (less J/token than the full cache) is only a saving if the method
still answers: per (model, label) the quality records give the continuation KL against the full
cache and the needle items the full cache found that the method lost. A method whose fidelity
collapses (:data:`COLLAPSE_KL`, or the needle lost on most items where the full cache finds it) is
flagged; a verdict without quality measured on the same model says so; a synthetic-weight run cites
the method's quality on a real model of the records and names it as a different model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from kvlab.reporting.frames import quality_records

COLLAPSE_KL = 1.0  # nats per token: continuation KL above this is a different model's distribution
FOUND = 0.5  # a needle item's score at or above this counts as found


@dataclass(frozen=True)
class Fidelity:
    """One method's quality on one model, from its quality records."""

    model: str
    kl: float  # mean continuation KL(full || method), NaN when not measured
    top1: float
    kl_items: int
    full_found: int  # needle items the full cache found
    lost: int  # of those, items the method did not find

    def collapse(self) -> str | None:
        """Why the fidelity collapsed, or None."""
        if self.kl_items and self.kl > COLLAPSE_KL:
            return f"continuation KL {self.kl:.2f} > {COLLAPSE_KL:g}"
        if self.full_found and self.lost * 2 > self.full_found:
            return f"needle lost on {self.lost} of {self.full_found} items the full cache finds"
        return None

    def text(self) -> str:
        parts = []
        if self.full_found:
            parts.append(f"needle {self.full_found - self.lost}/{self.full_found} where full finds it")
        if self.kl_items:
            parts.append(f"continuation KL {self.kl:.3f} (top-1 {self.top1:.2f}, {self.kl_items} items)")
        return ", ".join(parts) if parts else "no needle or continuation items"


def fidelity_table(records: pd.DataFrame, baseline: str = "full") -> dict[tuple[str, str], Fidelity]:
    """(model, label) -> :class:`Fidelity`, from the ok quality records of ``records``."""
    q = quality_records(records)
    if q.empty or not {"model", "label", "task"} <= set(q.columns):
        return {}
    q = q.assign(task=q["task"].astype(str))
    item = [c for c in ("task", "length", "depth", "sample") if c in q.columns]
    out = {}
    for model, rows in q.groupby("model", sort=False):
        needle = rows[rows["task"].str.startswith("niah")]
        base = needle[needle["method"] == baseline]
        found = base[pd.to_numeric(base["score"], errors="coerce") >= FOUND][item].drop_duplicates()
        for label, g in rows.groupby("label", sort=False):
            cont = g[g["task"] == "continuation"]
            mine = needle[needle["label"] == label].merge(found, on=item)
            lost = int((pd.to_numeric(mine["score"], errors="coerce") < FOUND).sum()) if not mine.empty else 0
            out[(str(model), str(label))] = Fidelity(
                str(model), float(pd.to_numeric(cont.get("kl"), errors="coerce").mean()) if not cont.empty else math.nan,
                float(pd.to_numeric(cont.get("top1_agree"), errors="coerce").mean()) if not cont.empty else math.nan,
                len(cont), len(mine), lost)
    return out


def fidelity_for(table: dict[tuple[str, str], Fidelity], model: str, label: str,
                 real_models: set[str]) -> tuple[Fidelity | None, bool]:
    """The method's fidelity on ``model``; else, for a model without quality (synthetic weights), on a
    real model of ``real_models`` (the one with most items): (fidelity, whether it is another model)."""
    same = table.get((model, label))
    if same is not None:
        return same, False
    others = [f for (m, lab), f in table.items() if lab == label and m in real_models and m != model]
    if not others:
        return None, False
    return max(others, key=lambda f: (f.kl_items + f.full_found, f.model)), True


def quality_text(fid: Fidelity | None, other_model: bool) -> str:
    """The quality a verdict stands beside, in words."""
    if fid is None:
        return "quality not measured"
    where = f"on {fid.model}, a different model" if other_model else "same model"
    flag = fid.collapse()
    return (f"FIDELITY COLLAPSES ({flag}; {where})" if flag else f"{fid.text()} ({where})")


def qualified_verdict(verdict: str, fid: Fidelity | None, other_model: bool) -> str:
    """The cost verdict with quality beside it: a collapse is flagged whatever the cost says, and
    "pays" is not called a saving without quality measured on some real model."""
    if fid is not None and fid.collapse():
        return f"{verdict}; not a saving: {quality_text(fid, other_model)}"
    if verdict == "pays" and fid is None:
        return "pays in cost, but no quality measured: not called a saving"
    return verdict


def add_quality(pays: pd.DataFrame, records: pd.DataFrame, baseline: str = "full") -> pd.DataFrame:
    """:func:`~kvlab.reporting.summaries.compression_pays`'s rows with ``quality`` (text), ``collapse``
    (the reason, or "") and the verdict qualified by :func:`qualified_verdict`."""
    if pays.empty:
        return pays.assign(quality=pd.Series(dtype=object), collapse=pd.Series(dtype=object))
    table = fidelity_table(records, baseline)
    real = set()
    if {"model", "weights"} <= set(records.columns):
        real = set(records.loc[records["weights"].astype(str) == "real", "model"].astype(str))
    texts, flags, verdicts = [], [], []
    for r in pays.to_dict("records"):
        fid, other = fidelity_for(table, str(r.get("model", "")), str(r["label"]), real)
        texts.append(quality_text(fid, other))
        flags.append((fid.collapse() if fid is not None else None) or "")
        verdicts.append(qualified_verdict(r["verdict"], fid, other))
    return pays.assign(quality=texts, collapse=flags, verdict=verdicts)
