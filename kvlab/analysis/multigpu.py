"""The multi-GPU verdicts on one folder written by ``scripts/device/ray_multigpu.sh``: one plan through
``--executor ray`` on a Ray cluster of two GPUs, then on a cluster of one.

Layout of ``DIR``: ``gpu2/`` and ``gpu1/`` (the two sweep folders), ``walls.jsonl`` (one line per
sweep: ``{"sweep", "gpus", "start", "end", "rc", "cluster_start_s"}``, epoch seconds around the
``kvlab sweep`` process; the Ray cluster was started before it) and ``counters/`` (counters.py
snapshots: ``idle.json``, then ``SWEEP-start.json`` and ``SWEEP-end.json`` around each sweep).

    python -m kvlab.analysis.multigpu DIR [--target 0.55] [--tolerance 0.02]

prints:

- the wall-time ratio, two GPUs over one (against ``--target``, default at most 0.55);
- whether every record names the GPU it ran on, and which groups ran where;
- per sweep, per GPU, the energy attribution (:mod:`kvlab.analysis.attribution`);
- per configuration (:func:`kvlab.analysis.executors.config_table`): a (model, ctx, batch) group runs
  on one GPU of the two-GPU sweep, so each configuration is compared across GPUs through the
  one-GPU sweep: for the configurations the two-GPU sweep ran on the *other* GPU, the two GPUs'
  numbers side by side (their agreement); for those it ran on the *same* GPU, the control
  (same GPU, alone vs beside another task: what concurrency on one host changes).

Exit status: 0 when the report could be made, 2 when a sweep folder is missing.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from kvlab.analysis.attribution import TOLERANCE, attribute, read_counters, render, sweep_records
from kvlab.analysis.executors import config_table, provenance_lines, read_walls, table_lines
from kvlab.energy import norm_uuid
from kvlab.records import load_records, stored_path

TARGET = 0.55
MANY, ONE = "gpu2", "gpu1"


def wall_s(row: dict[str, Any] | None) -> float:
    return row["end"] - row["start"] if row and "start" in row and "end" in row else math.nan


def wall_lines(walls: dict[str, dict[str, Any]], runs: dict[str, int], target: float = TARGET) -> list[str]:
    """The two sweeps' wall times and their ratio against the target, with and without Ray's start."""
    many, one = wall_s(walls.get(MANY)), wall_s(walls.get(ONE))
    if math.isnan(many) or math.isnan(one) or one <= 0:
        return ["wall time: unknown (walls.jsonl lacks a sweep)"]
    ratio = many / one
    rc = {k: walls[k].get("rc") for k in (MANY, ONE)}
    lines = [f"wall time of the sweep process: 2 GPUs {many:.1f} s (rc {rc[MANY]}, {runs.get(MANY, 0)} runs), "
             f"1 GPU {one:.1f} s (rc {rc[ONE]}, {runs.get(ONE, 0)} runs): ratio {ratio:.3f} "
             f"(target <= {target}: {'met' if ratio <= target else 'NOT met'})"]
    starts = [walls[k].get("cluster_start_s") for k in (MANY, ONE)]
    if all(s is not None for s in starts):
        lines.append(f"  Ray cluster start before each (not in those walls): {starts[0]:.1f} s, {starts[1]:.1f} s; "
                     f"with it the ratio is {(many + starts[0]) / (one + starts[1]):.3f}")
    if runs.get(MANY) != runs.get(ONE) or rc[ONE] not in (0, 3):
        lines.append("  the sweeps did not measure the same runs (a budget stop?): the ratio compares unequal work")
    return lines


def gpu_lines(name: str, records: list[dict[str, Any]], index: dict[str, int]) -> list[str]:
    """Whether every ok record names its GPU, and the groups and runs each GPU took."""
    ok = [r for r in records if r.get("status") == "ok"]
    nameless = [r for r in ok if not r.get("gpu_uuid")]
    per_gpu: dict[str, dict[str, Any]] = {}
    for r in ok:
        if r.get("gpu_uuid"):
            g = per_gpu.setdefault(str(r["gpu_uuid"]), {"runs": 0, "warmups": 0, "ctx": set()})
            g["runs" if r.get("kind") == "perf" else "warmups"] += 1
            g["ctx"].add((r.get("ctx"), r.get("batch")))
    failed = len(records) - len(ok)
    head = (f"{name}: {sum(r.get('kind') == 'perf' for r in ok)} runs and {sum(r.get('kind') == 'warmup' for r in ok)} "
            f"warm-ups ok{f' ({failed} failed)' if failed else ''}; "
            + ("every one names its GPU" if not nameless else f"{len(nameless)} name NO GPU"))
    lines = [head]
    for uuid, g in sorted(per_gpu.items(), key=lambda kv: index.get(norm_uuid(kv[0]), 99)):
        shapes = ", ".join(f"{c}x{b}" for c, b in sorted(g["ctx"], key=lambda cb: (cb[0] or 0, cb[1] or 0)))
        lines.append(f"  GPU {index.get(norm_uuid(uuid), '?')} {uuid}: {g['runs']} runs, {g['warmups']} warm-ups, "
                     f"groups (ctx x batch) {shapes}")
    return lines


def gpu_tables(one_df, many_df, index: dict[str, int]) -> list[str]:
    """Per configuration, the one-GPU sweep's numbers against the two-GPU sweep's on each GPU."""
    lines: list[str] = []
    alone = sorted({str(u) for u in one_df.get("gpu_uuid", []) if u})
    label = lambda u: f"GPU{index.get(norm_uuid(u), '?')}"  # noqa: E731
    base = f"1gpu:{label(alone[0])}" if len(alone) == 1 else "1gpu"
    if len(alone) > 1:
        lines.append(f"the one-GPU sweep ran on {len(alone)} GPUs ({', '.join(alone)}): it was not restricted to one")
    uuids = sorted({str(u) for u in many_df.get("gpu_uuid", []) if u}, key=lambda u: index.get(norm_uuid(u), 99))
    if not uuids:
        lines.append("no run of the 2-GPU sweep names a GPU: no per-GPU comparison")
    for uuid in uuids:
        same = len(alone) == 1 and norm_uuid(uuid) == norm_uuid(alone[0])
        what = ("the control, the same GPU alone and beside the other task" if same
                else "the two GPUs side by side, their agreement")
        lines.append("")
        lines.append(f"configurations the 2-GPU sweep ran on {label(uuid)}: {what}")
        table = config_table(one_df, many_df[many_df["gpu_uuid"] == uuid])
        lines.extend(table_lines(table, base, f"2gpu:{label(uuid)}", empty="  none in both sweeps"))
    return lines


def gpu_index(counter_files: list[Path]) -> dict[str, int]:
    """{normalized UUID: NVML index} from whichever counters files exist."""
    index: dict[str, int] = {}
    for path in counter_files:
        if path.is_file():
            for key, reading in read_counters(path).items():
                if reading.index is not None:
                    index.setdefault(key, int(reading.index))
    return index


def attribution_lines(folder: Path, sweep: str, tolerance: float) -> list[str]:
    counters = folder / "counters"
    start, end, idle = (counters / f"{sweep}-start.json", counters / f"{sweep}-end.json", counters / "idle.json")
    if not (start.is_file() and end.is_file()):
        return [f"energy attribution, {sweep}: no counters ({start.name}, {end.name})"]
    att = attribute(read_counters(start), read_counters(end), sweep_records(folder / sweep),
                    read_counters(idle) if idle.is_file() else None, tolerance)
    return [f"energy attribution, {sweep} (counters {start.name} -> {end.name}):", render(att)]


def report(folder: Path, target: float = TARGET, tolerance: float = TOLERANCE) -> str:
    frames, records = {}, {}
    for sweep in (MANY, ONE):
        df = load_records(folder / sweep, kind="perf")
        frames[sweep] = df[df["status"] == "ok"] if len(df) else df
        records[sweep] = sweep_records(folder / sweep)
    index = gpu_index(sorted((folder / "counters").glob("*.json")))
    lines = wall_lines(read_walls(folder / "walls.jsonl", key="sweep"), {k: len(v) for k, v in frames.items()}, target)
    lines.append("")
    for sweep in (MANY, ONE):
        lines.extend(gpu_lines(sweep, records[sweep], index))
    for sweep in (MANY, ONE):
        lines.append("")
        lines.extend(attribution_lines(folder, sweep, tolerance))
    if len(frames[MANY]) and len(frames[ONE]):
        lines.extend(gpu_tables(frames[ONE], frames[MANY], index))
    else:
        lines.append("no ok runs in one of the sweeps: no per-configuration comparison")
    lines.append("")
    for sweep in (MANY, ONE):
        lines.extend(provenance_lines(folder / sweep))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlab.analysis.multigpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help=f"holds {MANY}/, {ONE}/, walls.jsonl and counters/")
    ap.add_argument("--target", type=float, default=TARGET, help="wall-time ratio 2 GPUs / 1 GPU to meet")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="energy attribution tolerance (share)")
    args = ap.parse_args(argv)
    missing = [str(args.folder / s) for s in (MANY, ONE) if stored_path(args.folder / s / "records.jsonl") is None]
    if missing:
        print(f"kvlab.analysis.multigpu: error: no records in {', '.join(missing)}", file=sys.stderr)
        return 2
    print(report(args.folder, args.target, args.tolerance))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
