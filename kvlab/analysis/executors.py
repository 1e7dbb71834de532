"""One sweep plan measured by two executors, side by side (``local`` vs ``ray``).

``scripts/device/ray_compare.sh`` runs ``params/ray-compare.yaml`` through ``--executor local`` and
then ``--executor ray`` into ``DIR/local`` and ``DIR/ray``, and appends one line per sweep to
``DIR/walls.jsonl`` (``{"executor", "start", "end", "rc"}``, epoch seconds around the whole
``kvlab sweep`` process; a line for ``ray-cluster`` times the ``ray start --head`` that ran before
the ``ray`` sweep joined that cluster, as a user's sweep joins a running one). Then::

    python -m kvlab.analysis.executors DIR [--base local --other ray] [--target 0.05]

prints what each executor cost and whether it changed the measurements:

- wall time of each sweep process and the other's overhead, in seconds and as a share of the base
  sweep's wall time (against ``--target``, default at most 5%), split into the part before the first record
  (Ray's start, a worker process, its imports and model load) and the part from the first record
  to the last (what each run costs; ``created_at`` has one-second resolution); when the cluster was
  started beforehand, the overhead also counting that start;
- per configuration (method, ctx, batch), ms/step, J/token and TTFT over the repeats: each
  executor's mean with its 95% t-interval, and the ratio other/base with its Welch-log interval
  (:mod:`kvlab.intervals`; none below 3 repeats); a configuration
  agrees when every ratio CI contains 1.

Exit status: 0 when the comparison could be made, 2 when a folder or its records are missing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from kvlab.records import load_records, read_manifest, stored_path
from kvlab.reporting.stats import method_summary, ratio_ci

METRICS = {"itl_mean_ms": "ms/step", "j_per_token": "J/token", "ttft_s": "TTFT s"}
KEYS = ("method", "label", "ctx", "batch")
TARGET = 0.05


def read_walls(path: Path, key: str = "executor") -> dict[str, dict[str, Any]]:
    """``walls.jsonl`` (one line per timed sweep: start, end, rc) as {row[key]: row}; a later line
    for the same sweep wins (a retried start)."""
    walls: dict[str, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                walls[row[key]] = row
    return walls


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def wall_summary(walls: dict[str, dict[str, Any]], records: dict[str, Any], base: str, other: str) -> dict:
    """Wall times and the other executor's overhead over the base's, whole and split at the first
    and last record (``records``: {executor: DataFrame of its ok perf records})."""
    out: dict[str, Any] = {}
    for ex in (base, other):
        w = walls.get(ex, {})
        df = records[ex]
        stamps = sorted(_epoch(s) for s in df["created_at"]) if len(df) else []
        wall = w["end"] - w["start"] if "start" in w and "end" in w else math.nan
        row = {"wall_s": wall, "rc": w.get("rc"), "runs": len(stamps)}
        if stamps and "start" in w:
            row["before_first_s"] = stamps[0] - w["start"]
            row["first_to_last_s"] = stamps[-1] - stamps[0]
            row["after_last_s"] = w["end"] - stamps[-1]
        out[ex] = row
    b, o = out[base], out[other]
    out["overhead_s"] = o["wall_s"] - b["wall_s"]
    out["overhead"] = out["overhead_s"] / b["wall_s"] if b["wall_s"] and not math.isnan(b["wall_s"]) else math.nan
    if "before_first_s" in b and "before_first_s" in o:
        out["startup_overhead_s"] = o["before_first_s"] - b["before_first_s"]
        n = min(b["runs"], o["runs"]) - 1
        if n > 0:
            out["per_run_overhead_s"] = (o["first_to_last_s"] - b["first_to_last_s"]) / n
            per_run = b["first_to_last_s"] / (b["runs"] - 1) if b["runs"] > 1 else 0.0
            out["per_run_overhead"] = out["per_run_overhead_s"] / per_run if per_run else math.nan
    cluster = walls.get(f"{other}-cluster", {})
    if "start" in cluster and "end" in cluster:  # a cluster started (and timed) before the sweep joined it
        out["cluster_start_s"] = cluster["end"] - cluster["start"]
        out["overhead_with_cluster_s"] = out["overhead_s"] + out["cluster_start_s"]
        out["overhead_with_cluster"] = out["overhead_with_cluster_s"] / b["wall_s"] if b["wall_s"] else math.nan
    return out


def config_table(base_df, other_df, metrics=tuple(METRICS), n_boot: int = 2000, seed: int = 0):
    """One row per configuration present in both: n per executor, mean/lo/hi per metric and
    executor, the ratio other/base with its CI, and ``agree`` (every ratio CI contains 1)."""
    metrics = [m for m in metrics if m in base_df.columns and m in other_df.columns]
    keys = [k for k in KEYS if k in base_df.columns and k in other_df.columns]
    sb = method_summary(base_df, metrics, by=keys, n_boot=n_boot, seed=seed)
    so = method_summary(other_df, metrics, by=keys, n_boot=n_boot, seed=seed)
    table = sb.merge(so, on=keys, suffixes=("_base", "_other"))
    rows = []
    for _, row in table.iterrows():
        sel_b = (base_df[keys] == row[keys].values).all(axis=1)
        sel_o = (other_df[keys] == row[keys].values).all(axis=1)
        agree = True
        extra: dict[str, Any] = {}
        for m in metrics:
            vb = pd.to_numeric(base_df.loc[sel_b, m], errors="coerce")
            vo = pd.to_numeric(other_df.loc[sel_o, m], errors="coerce")
            r, lo, hi = ratio_ci(vo, vb, n_boot=n_boot, seed=seed)
            extra.update({f"{m}_ratio": r, f"{m}_ratio_lo": lo, f"{m}_ratio_hi": hi})
            if not math.isnan(r):
                agree &= bool(not math.isnan(lo) and lo <= 1.0 <= hi)
        rows.append({**row.to_dict(), **extra, "agree": agree})
    return pd.DataFrame(rows)


def _num(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}g}"


def _ci(mean: float, lo: float, hi: float) -> str:
    if math.isnan(lo):
        return _num(mean)
    return f"{_num(mean)} [{_num(lo)}, {_num(hi)}]"


def render(table, walls: dict, base: str, other: str, target: float = TARGET, extra_lines=()) -> str:
    lines = []
    b, o = walls[base], walls[other]
    lines.append(f"wall time of the sweep process: {base} {_num(b['wall_s'], 4)} s (rc {b['rc']}, {b['runs']} runs), "
                 f"{other} {_num(o['wall_s'], 4)} s (rc {o['rc']}, {o['runs']} runs)")
    if math.isnan(walls["overhead"]):
        lines.append(f"{other} overhead: unknown (walls.jsonl lacks a wall time)")
    else:
        verdict = "within" if walls["overhead"] <= target else "over"
        lines.append(f"{other} overhead: {walls['overhead_s']:+.1f} s = {100 * walls['overhead']:+.1f}% of {base}'s "
                     f"wall time ({verdict} the {100 * target:.0f}% target)")
    if "cluster_start_s" in walls:
        verdict = "within" if walls["overhead_with_cluster"] <= target else "over"
        lines.append(f"  {other}'s cluster was started before the sweep joined it: {walls['cluster_start_s']:.1f} s; "
                     f"counting that start, {other}'s overhead is {walls['overhead_with_cluster_s']:+.1f} s = "
                     f"{100 * walls['overhead_with_cluster']:+.1f}% ({verdict} the target)")
    if "startup_overhead_s" in walls:
        lines.append(f"  before the first record: {base} {b['before_first_s']:.0f} s, {other} {o['before_first_s']:.0f} s "
                     f"({walls['startup_overhead_s']:+.0f} s: starting {other}, its worker, imports, model load)")
    if "per_run_overhead_s" in walls:
        share = walls["per_run_overhead"]
        share = "" if math.isnan(share) else f" = {100 * share:+.1f}%"
        lines.append(f"  first to last record: {base} {b['first_to_last_s']:.0f} s, {other} {o['first_to_last_s']:.0f} s "
                     f"({walls['per_run_overhead_s']:+.2f} s per run{share}; timestamps to the second)")
    lines.extend(extra_lines)
    lines.extend(table_lines(table, base, other))
    return "\n".join(lines)


def table_lines(table, base: str, other: str, empty: str = "no configuration has ok records in both folders") -> list[str]:
    """Per configuration and metric: each side's mean [CI], the ratio other/base [CI]; then how many agree."""
    if table is None or len(table) == 0:
        return [empty]
    lines = ["", f"per configuration: mean [95% t-interval] over repeats; ratio {other}/{base} [95% Welch-log CI] "
             "(no interval below 3 repeats)"]
    head = f"{'metric':8s} {'label':24s} {'ctx':>6s} {'b':>3s} {'n':>5s}  {base:28s} {other:28s} {'ratio':22s}"
    lines.append(head)
    for _, row in table.iterrows():
        for m, name in METRICS.items():
            if f"{m}_ratio" not in row or (math.isnan(row[f"{m}_base"]) and math.isnan(row[f"{m}_other"])):
                continue  # e.g. J/token on a CPU: no energy counter
            rb = _ci(row[f"{m}_base"], row[f"{m}_lo_base"], row[f"{m}_hi_base"])
            ro = _ci(row[f"{m}_other"], row[f"{m}_lo_other"], row[f"{m}_hi_other"])
            rr = _ci(row[f"{m}_ratio"], row[f"{m}_ratio_lo"], row[f"{m}_ratio_hi"])
            n = f"{row['n_base']}/{row['n_other']}"
            lines.append(f"{name:8s} {str(row.get('label', row['method']))[:24]:24s} {row['ctx']:6d} {row['batch']:3d} "
                         f"{n:>5s}  {rb:28s} {ro:28s} {rr:22s}")
    agree = int(table["agree"].sum())
    lines.append(f"{agree}/{len(table)} configurations agree (every ratio CI contains 1)")
    busy = {ex: int(table[f"n_contended_{side}"].sum()) for ex, side in ((base, "base"), (other, "other"))
            if f"n_contended_{side}" in table.columns}
    if any(busy.values()):
        lines.append("runs flagged contended (other work took the CPU during decode; their times are suspect): "
                     + ", ".join(f"{ex} {n}" for ex, n in busy.items()))
    return lines


def provenance_lines(folder: Path) -> list[str]:
    """The last invocation of a sweep folder: executor, status and its workers (host, GPU UUID)."""
    manifest = read_manifest(folder) or {}
    inv = (manifest.get("invocations") or [{}])[-1]
    lines = [f"{folder.name}: executor {inv.get('executor')}, status {manifest.get('status')}, "
             f"{inv.get('started_at')} .. {inv.get('finished_at')}"]
    for w in inv.get("workers") or []:
        lines.append("  worker " + ", ".join(f"{k} {w.get(k)}" for k in
                                             ("host", "pid", "gpu_uuid", "cuda_visible_devices", "energy_source")))
    return lines


def compare(folder: Path, base: str = "local", other: str = "ray", target: float = TARGET) -> str:
    frames = {}
    for ex in (base, other):
        df = load_records(folder / ex, kind="perf")
        frames[ex] = df[df["status"] == "ok"] if len(df) else df
    walls = wall_summary(read_walls(folder / "walls.jsonl"), frames, base, other)
    table = config_table(frames[base], frames[other]) if len(frames[base]) and len(frames[other]) else None
    prov = provenance_lines(folder / base) + provenance_lines(folder / other)
    return render(table, walls, base, other, target, extra_lines=prov)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlab.analysis.executors", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="holds BASE/ and OTHER/ sweep folders and walls.jsonl")
    ap.add_argument("--base", default="local")
    ap.add_argument("--other", default="ray")
    ap.add_argument("--target", type=float, default=TARGET, help="overhead target, a share of the base wall time")
    args = ap.parse_args(argv)
    missing = [str(args.folder / ex) for ex in (args.base, args.other) if stored_path(args.folder / ex / "records.jsonl") is None]
    if missing:
        print(f"kvlab.analysis.executors: error: no records in {', '.join(missing)}", file=sys.stderr)
        return 2
    print(compare(args.folder, args.base, args.other, args.target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
