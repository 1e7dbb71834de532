"""Per-GPU energy attribution over a sweep: do a GPU's windows and idle gaps add up to
what its hardware counter counted?

``scripts/device/counters.py`` reads every GPU's cumulative NVML energy counter (by UUID) before
and after a sweep. Over that span a GPU's counter total is the energy of the windows the sweep's
records place on it (measured runs and warm-ups: ``energy_j`` over ``window_s`` seconds, on
``gpu_uuid``) plus whatever it drew between them. What records hold decides what a *gap* can be:

- records give each window's start on the wall clock (``window_start_unix``) and the counter's
  value there (``energy_counter_start_j``); older records lack both, and then only totals can be
  compared (gap seconds = span - window seconds).
- a gap is any time on that GPU outside a window: before its first window (the driver and Ray
  starting, a worker's imports, the model load, the sweep's idle baseline), between windows of one
  group (jitter, records sent, policies set up), between groups (a worker ending, the next one
  starting and loading the model), after its last window (waiting for the other GPUs, shutdown).
  Only in-group gaps are idle with the model resident; the others include model loads. So
  ``idle power x gap seconds`` is an estimate, and the gaps' own energy, read off the counter
  where records carry it, says which kind of gap a miss comes from.

The check: ``|counter - (windows + idle_w x gap seconds)| <= 2%`` of the counter, where idle_w is
the sweep's own idle baseline on that GPU (records' ``idle_w``, model resident) or, for a GPU no
record names, the counters' idle reading (no process on it). Binding checks come with the counter
readings: each window's counter values lie inside its GPU's counter span (a window read from
another GPU's counter would not), and windows on one GPU never overlap (runs share no GPU).

    python -m kvlab.analysis.attribution SWEEP_DIR --start START.json --end END.json [--idle IDLE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.energy import norm_uuid
from kvlab.records import read_jsonl, stored_path

TOLERANCE = 0.02
COUNTER_SLACK_J = 0.001  # the counter counts whole millijoules
OVERLAP_SLACK_S = 0.001
GAP_KINDS = ("before the first window", "inside a group", "between groups", "after the last window")


@dataclass(frozen=True)
class CounterReading:
    """One GPU's cumulative energy counter at one moment (an entry of a counters.py file)."""

    uuid: str
    energy_j: float
    at_unix: float
    index: int | None = None
    name: str | None = None
    idle_w: float | None = None


@dataclass(frozen=True)
class EnergyWindow:
    """One record's energy window: where it ran, how much, when, and where on the counter."""

    gpu_uuid: str
    run_id: str
    kind: str  # perf | warmup
    group: tuple  # (model, ctx, batch): one worker's model load
    energy_j: float
    seconds: float
    start_unix: float | None = None
    counter_start_j: float | None = None

    @property
    def end_unix(self) -> float | None:
        return None if self.start_unix is None else self.start_unix + self.seconds


@dataclass(frozen=True)
class Gap:
    """Time on a GPU outside any window; ``energy_j`` read off the counter when records allow."""

    kind: str
    seconds: float
    energy_j: float | None = None


@dataclass
class GpuAttribution:
    """One GPU over the counter span: counter total against windows plus idle gaps."""

    uuid: str
    index: int | None
    name: str | None
    counter_j: float
    span_s: float
    n_windows: int
    windows_j: float
    windows_s: float
    idle_w: float | None
    idle_source: str
    gaps: list[Gap] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    tolerance: float = TOLERANCE

    @property
    def gap_s(self) -> float:
        return self.span_s - self.windows_s

    @property
    def remainder_j(self) -> float:
        """What the windows leave unattributed: the gaps' energy, whatever drew it."""
        return self.counter_j - self.windows_j

    @property
    def gap_idle_j(self) -> float | None:
        return None if self.idle_w is None else self.idle_w * self.gap_s

    @property
    def residual_j(self) -> float | None:
        return None if self.gap_idle_j is None else self.remainder_j - self.gap_idle_j

    @property
    def residual_share(self) -> float | None:
        if self.residual_j is None or self.counter_j <= 0:
            return None
        return self.residual_j / self.counter_j

    @property
    def agree(self) -> bool:
        share = self.residual_share
        return share is not None and abs(share) <= self.tolerance and not self.problems


@dataclass
class Attribution:
    """Every GPU the counters read, and the windows that could not be laid on one."""

    gpus: list[GpuAttribution]
    unplaced: int = 0  # windows whose record names no GPU
    strangers: dict[str, int] = field(default_factory=dict)  # GPU UUID the counters did not read -> windows
    one_end: list[str] = field(default_factory=list)  # GPUs read before or after the sweep, not both
    outside: int = 0  # windows outside the counter span (an earlier invocation of the folder)
    tolerance: float = TOLERANCE

    @property
    def agree(self) -> bool:
        return (bool(self.gpus) and all(g.agree for g in self.gpus) and not self.unplaced and not self.strangers
                and not self.one_end)


# --------------------------------------------------------------------------------------------
# Reading what the device wrote
# --------------------------------------------------------------------------------------------


def counters_from_json(data: dict[str, Any]) -> dict[str, CounterReading]:
    """A counters.py snapshot as {normalized UUID: reading}."""
    at = float(data["read_at_unix"])
    out = {}
    for gpu in data.get("gpus", []):
        reading = CounterReading(uuid=str(gpu["uuid"]), energy_j=float(gpu["energy_j"]), at_unix=at,
                                 index=gpu.get("index"), name=gpu.get("name"), idle_w=gpu.get("idle_w"))
        out[norm_uuid(reading.uuid)] = reading
    return out


def read_counters(path: str | Path) -> dict[str, CounterReading]:
    return counters_from_json(json.loads(Path(path).read_text()))


def windows_from_records(records: Iterable[dict[str, Any]]) -> tuple[list[EnergyWindow], int]:
    """The energy windows of ok records that measured energy, and how many such records name no GPU."""
    windows, unplaced = [], 0
    for rec in records:
        if rec.get("status") != "ok" or rec.get("energy_j") is None or rec.get("window_s") is None:
            continue
        if not rec.get("gpu_uuid"):
            unplaced += 1
            continue
        windows.append(EnergyWindow(
            gpu_uuid=str(rec["gpu_uuid"]), run_id=str(rec.get("run_id")), kind=str(rec.get("kind")),
            group=(rec.get("model"), rec.get("ctx"), rec.get("batch")),
            energy_j=float(rec["energy_j"]), seconds=float(rec["window_s"]),
            start_unix=rec.get("window_start_unix"), counter_start_j=rec.get("energy_counter_start_j")))
    return windows, unplaced


def idle_by_gpu(records: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Each GPU's idle baseline as the sweep measured it (median of its records' ``idle_w``)."""
    seen: dict[str, list[float]] = {}
    for rec in records:
        if rec.get("gpu_uuid") and rec.get("idle_w") is not None:
            seen.setdefault(norm_uuid(rec["gpu_uuid"]), []).append(float(rec["idle_w"]))
    return {uuid: statistics.median(ws) for uuid, ws in seen.items()}


# --------------------------------------------------------------------------------------------
# Pure attribution
# --------------------------------------------------------------------------------------------


def gaps_between(windows: list[EnergyWindow], start: CounterReading, end: CounterReading) -> list[Gap]:
    """The gaps of one GPU's windows (sorted by start) inside the counter span, by kind; empty when
    a window has no start time. A gap's energy is the counter's rise across it, when both sides have
    a counter reading."""
    if any(w.start_unix is None for w in windows):
        return []
    if not windows:
        return [Gap("no window", end.at_unix - start.at_unix, end.energy_j - start.energy_j)]

    def rise(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    def counter_end(w: EnergyWindow) -> float | None:
        return None if w.counter_start_j is None else w.counter_start_j + w.energy_j

    first, last = windows[0], windows[-1]
    out = [Gap(GAP_KINDS[0], first.start_unix - start.at_unix, rise(start.energy_j, first.counter_start_j))]
    for a, b in zip(windows[:-1], windows[1:], strict=True):
        kind = GAP_KINDS[1] if a.group == b.group else GAP_KINDS[2]
        out.append(Gap(kind, b.start_unix - a.end_unix, rise(counter_end(a), b.counter_start_j)))
    out.append(Gap(GAP_KINDS[3], end.at_unix - last.end_unix, rise(counter_end(last), end.energy_j)))
    return out


def binding_problems(windows: list[EnergyWindow], start: CounterReading, end: CounterReading) -> list[str]:
    """Windows read from a counter other than this GPU's, and windows that overlap on it."""
    problems = []
    foreign = [w for w in windows if w.counter_start_j is not None and not (
        start.energy_j - COUNTER_SLACK_J <= w.counter_start_j
        and w.counter_start_j + w.energy_j <= end.energy_j + COUNTER_SLACK_J)]
    if foreign:
        problems.append(f"{len(foreign)} window(s) read a counter outside this GPU's "
                        f"[{start.energy_j:.0f}, {end.energy_j:.0f}] J (bound to another GPU?), e.g. {foreign[0].run_id}")
    timed = [w for w in windows if w.start_unix is not None]
    overlaps = [(a, b) for a, b in zip(timed[:-1], timed[1:], strict=True)
                if b.start_unix < a.end_unix - OVERLAP_SLACK_S]
    if overlaps:
        a, b = overlaps[0]
        problems.append(f"{len(overlaps)} pair(s) of windows overlap on this GPU (runs shared it), "
                        f"e.g. {a.run_id} and {b.run_id}")
    return problems


def in_span(w: EnergyWindow, start: CounterReading, end: CounterReading) -> bool:
    """Whether a window lies inside the counter span (True when it has no start time to tell)."""
    return w.start_unix is None or (start.at_unix <= w.start_unix and w.end_unix <= end.at_unix)


def attribute_gpu(start: CounterReading, end: CounterReading, windows: list[EnergyWindow],
                  idle_w: float | None, idle_source: str, tolerance: float = TOLERANCE) -> GpuAttribution:
    """One GPU: its windows inside the span against its counter total."""
    windows = sorted(windows, key=lambda w: (w.start_unix is None, w.start_unix or 0.0))
    return GpuAttribution(
        uuid=start.uuid, index=start.index, name=start.name,
        counter_j=end.energy_j - start.energy_j, span_s=end.at_unix - start.at_unix,
        n_windows=len(windows), windows_j=sum(w.energy_j for w in windows),
        windows_s=sum(w.seconds for w in windows), idle_w=idle_w, idle_source=idle_source,
        gaps=gaps_between(windows, start, end), problems=binding_problems(windows, start, end),
        tolerance=tolerance)


def attribute(start: dict[str, CounterReading], end: dict[str, CounterReading],
              records: Iterable[dict[str, Any]], idle: dict[str, CounterReading] | None = None,
              tolerance: float = TOLERANCE) -> Attribution:
    """Every GPU read at both ends of the sweep, attributed; windows no such GPU can take, counted.

    Idle power per GPU: the sweep's baseline on it (records' ``idle_w``), else ``idle``'s reading
    (counters.py --idle-s, no process on the GPU), else unknown (no verdict for that GPU).
    """
    records = list(records)
    windows, unplaced = windows_from_records(records)
    sweep_idle = idle_by_gpu(records)
    idle = idle or {}
    by_gpu: dict[str, list[EnergyWindow]] = {}
    for w in windows:
        by_gpu.setdefault(norm_uuid(w.gpu_uuid), []).append(w)
    gpus, outside = [], 0
    for key, s in sorted(start.items(), key=lambda kv: (kv[1].index is None, kv[1].index or 0, kv[0])):
        e = end.get(key)
        if e is None:
            continue
        mine = [w for w in by_gpu.get(key, []) if in_span(w, s, e)]
        outside += len(by_gpu.get(key, [])) - len(mine)
        if key in sweep_idle:
            watts, source = sweep_idle[key], "the sweep's idle baseline on it, model resident"
        elif key in idle and idle[key].idle_w is not None:
            watts, source = float(idle[key].idle_w), "counters.py idle reading, no process on it"
        else:
            watts, source = None, "unknown"
        gpus.append(attribute_gpu(s, e, mine, watts, source, tolerance))
    read = {k for k in start if k in end}
    strangers = {ws[0].gpu_uuid: len(ws) for key, ws in by_gpu.items() if key not in read}
    one_end = [(start.get(key) or end.get(key)).uuid for key in sorted(set(start) ^ set(end))]
    return Attribution(gpus=gpus, unplaced=unplaced, strangers=strangers, one_end=one_end, outside=outside,
                       tolerance=tolerance)


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


def _kj(joules: float | None) -> str:
    return "-" if joules is None else f"{joules / 1000:.2f} kJ"


def gpu_lines(g: GpuAttribution) -> list[str]:
    name = f"GPU {g.index} {g.uuid}" + (f" ({g.name})" if g.name else "")
    lines = [f"{name}: counter {_kj(g.counter_j)} over {g.span_s:.1f} s = windows {_kj(g.windows_j)} "
             f"({g.n_windows} windows, {g.windows_s:.1f} s) + remainder {_kj(g.remainder_j)} over {g.gap_s:.1f} s of gaps"]
    if g.idle_w is None:
        lines.append("  idle power unknown: no verdict (the remainder is unexplained)")
    else:
        share = g.residual_share
        verdict = ("within" if share is not None and abs(share) <= g.tolerance else "over") + f" {100 * g.tolerance:.0f}%"
        lines.append(f"  idle {g.idle_w:.1f} W ({g.idle_source}) x {g.gap_s:.1f} s = {_kj(g.gap_idle_j)}; "
                     f"residual {g.residual_j / 1000:+.2f} kJ = "
                     f"{'-' if share is None else f'{100 * share:+.1f}%'} of the counter ({verdict})")
    by_kind: dict[str, list[Gap]] = {}
    for gap in g.gaps:
        by_kind.setdefault(gap.kind, []).append(gap)
    parts = []
    for kind, gs in by_kind.items():
        secs = sum(x.seconds for x in gs)
        joules = None if any(x.energy_j is None for x in gs) else sum(x.energy_j for x in gs)
        watts = f", {joules / secs:.0f} W" if joules is not None and secs > 0 else ""
        parts.append(f"{kind} {secs:.1f} s" + (f" {_kj(joules)}{watts}" if joules is not None else ""))
    if parts:
        lines.append("  gaps (counter's rise across them): " + "; ".join(parts))
    elif g.n_windows:
        lines.append("  gaps not split by kind: the records lack window_start_unix")
    lines.extend(f"  problem: {p}" for p in g.problems)
    return lines


def render(att: Attribution) -> str:
    lines = []
    for g in att.gpus:
        lines.extend(gpu_lines(g))
    if att.unplaced:
        lines.append(f"{att.unplaced} window(s) measured energy on a record that names no GPU")
    for uuid, n in att.strangers.items():
        lines.append(f"GPU {uuid}: {n} window(s) but the counters did not read it at both ends")
    for uuid in att.one_end:
        lines.append(f"GPU {uuid}: read before or after the sweep, not both: not attributed")
    if att.outside:
        lines.append(f"{att.outside} window(s) outside the counter span left out (an earlier invocation?)")
    agree = sum(g.agree for g in att.gpus)
    lines.append(f"{agree}/{len(att.gpus)} GPUs agree within {100 * att.tolerance:.0f}% "
                 f"(counter = windows + idle x gaps){'' if att.agree else '; attribution NOT confirmed'}")
    return "\n".join(lines)


def sweep_records(folder: Path) -> list[dict[str, Any]]:
    """A sweep folder's measured runs and warm-ups (both measured energy in a window)."""
    out = []
    for name in ("records.jsonl", "warmup.jsonl"):
        out.extend(read_jsonl(Path(folder) / name))  # [] when absent; an archived .xz twin is read
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlab.analysis.attribution", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a sweep folder (records.jsonl, warmup.jsonl)")
    ap.add_argument("--start", type=Path, required=True, help="counters.py snapshot before the sweep")
    ap.add_argument("--end", type=Path, required=True, help="counters.py snapshot after the sweep")
    ap.add_argument("--idle", type=Path, help="counters.py --idle-s snapshot (idle power of GPUs no record names)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE)
    args = ap.parse_args(argv)
    missing = [str(p) for p in (args.start, args.end, args.idle) if p is not None and not p.is_file()]
    if missing or stored_path(args.folder / "records.jsonl") is None:
        print(f"kvlab.analysis.attribution: error: missing {', '.join(missing) or args.folder / 'records.jsonl'}",
              file=sys.stderr)
        return 2
    att = attribute(read_counters(args.start), read_counters(args.end), sweep_records(args.folder),
                    read_counters(args.idle) if args.idle else None, args.tolerance)
    print(render(att))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
