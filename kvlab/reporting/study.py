"""A records folder as the report sees it (:class:`Study`), loading it, and the report's opening
lines."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvlab.records import load_records
from kvlab.reporting import ReportError
from kvlab.reporting.anatomy_files import load_anatomy
from kvlab.reporting.cards import cards_note, with_cards
from kvlab.reporting.frames import (
    SYNTHETIC_NOTE,
    contended_mask,
    failed_records,
    memory_note,
    perf_records,
    quality_records,
)
from kvlab.reporting.provenance import distinct_values, provenance, provenance_by_sweep
from kvlab.reporting.summaries import cpu_cost_note


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
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"records folder {folder} does not exist: run `kvlab sweep PARAMS.yaml -o {folder}`")
    records = load_records(folder)
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifests = sweep_manifests(folder)
    if manifests and "folder" in records.columns:
        records = records.assign(sweep_dir=[_sweep_dir(f, folder, list(manifests)) for f in records["folder"]])
    records = with_cards(records, manifest, manifests)
    return Study(folder, records, manifest, manifests, load_anatomy(folder))



def summary_markdown(study: Study) -> str:
    """The report's opening lines: what ran, where, and a loud note when weights were synthetic."""
    rec = study.records
    perf, quality = study.perf, study.quality
    lines = [f"**Sweep folder:** `{study.folder.name or study.folder.resolve().name}` · "
             f"{len(perf)} performance runs, {len(quality)} quality records, "
             f"{len(failed_records(rec))} failed"]
    busy = int(contended_mask(perf).sum())
    note = cost_note(study)
    if busy:
        kept = ("their wall times are left out of *where compression pays*, their CPU time is not"
                if note else "they are left out of *where compression pays*")
        lines.append(f"**contended:** {busy} of {len(perf)} performance runs were measured while other "
                     f"processes took the CPU (involuntary switches, CPU share or steal: "
                     f"`kvlab.hostload.contention`); {kept}")
    if note:
        lines.append(f"**cost on CPU:** {note}")
    for col, name in (("model", "model"), ("device", "device"), ("gpu_name", "GPU"), ("dtype", "dtype"),
                      ("threads", "torch threads"), ("energy_source", "energy source")):
        v = distinct_values(rec, col)
        if v:
            lines.append(f"**{name}:** {v}")
    note = memory_note(perf)
    if note:
        lines.append(f"**peak memory:** {note}")
    note = cards_note(perf)
    if note:
        lines.append(f"**cards:** {note}")
    if study.manifests:
        counts = rec["sweep_dir"].value_counts() if "sweep_dir" in rec.columns else pd.Series(dtype=int)
        lines.append("**sweeps:** " + ", ".join(f"`{name}` ({int(counts.get(name, 0))} records)"
                                                  for name in study.manifests))
    weights = distinct_values(rec, "weights") or "unknown"
    lines.append(f"**weights: {weights}**")
    if study.synthetic:
        lines.append(f"> weights: synthetic ({SYNTHETIC_NOTE}).")
    return "\n\n".join(lines)



def rapl_recorded(study: Study) -> str | None:
    """The RAPL status the sweeps' manifests recorded at their start (:func:`kvlab.hostload.rapl_status`)."""
    manifests = list(study.manifests.values()) if study.manifests else [study.manifest]
    found = [m.get("env_start", {}).get("rapl") for m in manifests if isinstance(m, dict)]
    found = [f for f in found if f]
    return "; ".join(dict.fromkeys(found)) or None


def cost_note(study: Study) -> str | None:
    """:func:`kvlab.reporting.summaries.cpu_cost_note` for a study (None unless every run was on CPU)."""
    return cpu_cost_note(study.records, rapl_recorded(study))


def study_provenance(study: Study, full: bool = False) -> pd.DataFrame:
    """The provenance table of a study: one ``value`` column for a sweep folder, one column per
    sweep for a folder of sweeps."""
    if study.manifests:
        return provenance_by_sweep(study.manifests, study.records, full=full)
    return provenance(study.manifest, study.records, full=full)

