"""Capacity per method at long context: per-sequence peak split, the predicted largest batch, confirmed.

For the H200 (issue #14), after ``. scripts/device/setup.sh``. On transformers' path (``hf``):

    python benchmarks/capacity.py --ctx 16384 --out $OUT/capacity-16k.json --expandable-batch 32
    python benchmarks/capacity.py --ctx 32768 --chunks none 2048 --confirm snapkv10@2048 --out $OUT/capacity-32k.json

On the fast engine with row-grouped prefill, 16k and 32k in one device call, one command after the
other whatever the first's status (about 6.5 minutes; at most 8.8 with setup.sh on a fresh machine
and both ``timeout`` s: see "The H200 call"):

    timeout 260 python benchmarks/capacity.py --engine fast --prefill-rows 4 --ctx 16384 \
        --methods full snapkv10 --chunks none 2048 --confirm full@once snapkv10@2048 \
        --confirm-max-batch 64 --time-budget-s 240 --out $OUT/capacity-fast-16k.json 2>&1 \
        | tee $OUT/capacity-fast-16k.log
    timeout 240 python benchmarks/capacity.py --engine fast --prefill-rows 2 --ctx 32768 \
        --methods full snapkv10 --chunks 2048 --confirm all \
        --confirm-max-batch 32 --time-budget-s 215 --out $OUT/capacity-fast-32k.json 2>&1 \
        | tee $OUT/capacity-fast-32k.log

Per context (Llama-3.1-8B shape, synthetic bf16 weights, the ``hf`` engine unless ``--engine fast``):
every config (method x prefill chunk x engine; ``snapkv10@2048 hf`` = SnapKV keep 10%, 2048-token
chunks, transformers' path; ``full@once fast rows4`` = the full cache, one-shot prefill, the fast
engine prefilling 4 sequences at a time) is measured at the ``--batches`` (default 1 and 8,
``--new-tokens`` 4): torch's peak allocated bytes per run. A line through those peaks gives the
per-sequence cost (the slope), split into the kept cache (``cache_bytes / batch``), on the fast
engine the static store's new-token slots, and the prefill's transients (the rest, signed: a small
negative is noise in the peaks, reported as it is), and the largest batch whose predicted peak fits
the memory torch can use (free + reserved, read after the config's fit runs, or ``--memory-gb``).
The ``--confirm`` configs (names whole, or their first word) then run at that batch, and at one just
above it (``--above``, 2% more), which should end in a clean out-of-memory row (a confirm run that
runs out of memory is followed by one 4% below instead). ``--expandable-batch N`` reruns the full
cache (one-shot) at batch N in a child process under
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (with this run's engine and rows). Confirm runs
whose estimated time (from the fit runs' prefill) does not fit ``--time-budget-s`` are skipped and
say so. Every row goes to ``--out`` as it is measured; the summary table is printed at the end (and
by ``--table FILE`` from a written file).

The fast engine (``--engine fast``) holds one decoder at a time and drops it after every point
(then empties torch's CUDA cache), so each peak is that point's own; its step runs eagerly inside
the captured graph (``--fast-compile none``, the default here): the benchmark measures memory, and
the compiled step (``layers``, ``dynamic=False``) would recompile for every new batch (past
torch's recompile limit of 8 it falls back to eager anyway), inside the measured point.

Row groups (``--prefill-rows N``, fast only): a batch is prefilled N sequences at a time, each
group's kept K/V written into the static store's rows and its prefill cache freed before the next
group. The store (batch x (kept + new tokens)) is allocated before the prefill, so a point's peak is
weights + one group's transient (its full-length prefill cache and activations, a constant) + batch
x the store per sequence: a line whose slope is the kept cache plus slots, transients per sequence
about 0. That holds only for batches >= N (a smaller batch is one smaller group: a smaller
transient), so the fit batches default to N and 4N, and ``--batches`` below N is refused.

``--confirm-max-batch B``: a config predicted above B is confirmed at B instead, with torch's
allocator capped (``torch.cuda.set_per_process_memory_fraction``) where its line predicts B (halfway
between the line's peaks at B and B + 1); the above run under the same cap should run out of memory.
It checks the same line where filling the whole device would take too long; the full-device
prediction stays in the fit (``predicted_max_batch``), rows say ``memory_cap_bytes``.

Two lines on CUDA: the allocated peaks (``torch.cuda.max_memory_allocated``, what the tensors
need: ``predicted_max_batch``) and the reserved peaks (``max_memory_reserved``, what the caching
allocator holds, its slack included: ``predicted_max_batch_reserved``). An out-of-memory error comes
when the reserved memory hits the device, and the fraction cap limits reserved memory too, so the cap
is placed on the reserved line. On the H200 (2026-12-03, ``reports/h200-2026-12-03e``) the allocated
line predicted the allocated peak of every confirm run within 0.8%, but reserved ran 0.6-6.8 GB above
allocated: 16k full, predicted 54, ran out of memory at 54 and ran at 52 (the reserved line says 52),
and caps placed on the allocated line (half a SnapKV sequence of room, 0.11 GB) ran out of memory at
SnapKV's 64 and 61. For the full cache the largest batch lay between the two predictions (16k: 52-54,
52 ran; 32k: 27-28, 28 ran and 29 did not); caps on the reserved line are not yet measured.

The H200 call (139.8 GiB = 150.1 GB; weights 16.1 GB; the full cache 2.15 GB per 16k sequence and
SnapKV 10% 0.215 GB, twice that at 32k; transformers' prefill ~0.7 s per 16k sequence (2026-12-02:
0.66-0.69 s at batch 4-32), ~1.65 s estimated per 32k one (quadratic attention)). Expected: 16k full
~54 sequences, SnapKV ~600 (~11x); 32k full ~28, SnapKV ~300. Confirming SnapKV on the whole device
would take 600 x 0.7 s = 7 minutes of prefill at 16k alone, so it is confirmed under a cap (64 at
16k, 32 at 32k); the full cache is confirmed on the whole device (its predicted ~54 and ~28 are under
the caps' batches).
32k prefills 2 sequences at a time (as many tokens per group as 4 at 16k) and fits only the chunked
configs, since row groups make the chunk matter only for the intercept, which 16k shows. Estimate:
setup.sh ~30 s on a fresh machine; 16k: load ~25 s, fits 80 sequences (~70 s with decoder builds),
full confirm ~40 s + its above (out of memory in the first group: a few s), SnapKV confirm ~50 s +
above: ~190 s; 32k: load ~25 s, fits 20 sequences (~40 s), full confirm ~46 s, SnapKV ~55 s, aboves:
~175 s; in all ~6.5 minutes (measured on a warm machine: 275 s, reports/h200-2026-12-03e call 5). If
prefill runs slower, the time budgets skip confirm runs (each says so) and ``timeout`` cuts the rest;
the JSON holds every row measured. A whole-device SnapKV confirm
at 16k (~600 sequences) does not fit one call with its fit and above run; a call of its own with
``--methods snapkv10 --chunks 2048 --confirm-max-batch 400`` (~4.7 minutes of prefill) gets closer.

CPU smoke (mechanics only: a CPU's peak is the process's peak RSS, and no memory cap is enforced):
    python benchmarks/capacity.py --device cpu --model tiny-llama --ctx 256 --chunks none 64 --memory-gb 2 --out /tmp/c.json
    python benchmarks/capacity.py --device cpu --model tiny-llama --ctx 256 --chunks 64 --engine fast --prefill-rows 2 --memory-gb 2 --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from kvlab.card import device_card
from kvlab.energy import cuda_index
from kvlab.engine.llama import STEP_COMPILE

METHODS = {
    "full": ("full", {}),
    "snapkv10": ("snapkv", {"keep": 0.1}),
    "pyramidkv10": ("pyramidkv", {"keep": 0.1}),
    "kvq-int4": ("kvq-int4", {}),
    "quanto4": ("quanto", {"nbits": 4}),
}
DEFAULT_CONFIRM = ["snapkv10@2048", "full@once", "full@2048"]
GB = 1e9


def config_name(method: str, chunk: int | None, engine: str = "hf", rows: int | None = None) -> str:
    """``snapkv10@2048 fast rows4``: method, prefill chunk, engine and (fast) sequences per prefill
    group, so a table mixing engines or row groups is unambiguous. ``--confirm`` also takes the first
    word alone (``snapkv10@2048``): one invocation runs one engine and one row count."""
    name = f"{method}@{chunk if chunk else 'once'} {engine}"
    return f"{name} rows{rows}" if rows else name


def parse_chunk(text: str) -> int | None:
    return None if text.lower() in ("none", "null", "once") else int(text)


def release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def usable_bytes(device: str, memory_gb: float | None) -> float:
    """What torch can hold at its peak: ``--memory-gb``, else the device's free memory plus what
    torch's allocator already reserved (weights included), read now (the benchmark reads it again after
    each config's fit points: the CUDA context grows as kernels load)."""
    if memory_gb is not None:
        return memory_gb * GB
    if not device.startswith("cuda"):
        raise SystemExit("capacity.py: on a CPU give --memory-gb (the memory to predict against)")
    release(device)
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def drop_decoders(engine, device: str) -> None:
    """Drop what the fast engine keeps for reuse (its one decoder: static store and captured graph)
    and give the memory back, so the next point's peak is its own: a point's peak counter starts
    from what is allocated when it starts, so a store kept from the point before would count in it."""
    engine.release()
    release(device)


@contextmanager
def memory_cap(device: str, cap_bytes: float | None):
    """torch's allocator refuses to reserve more than ``cap_bytes`` inside the block (CUDA:
    ``set_per_process_memory_fraction``; it raises the same out-of-memory error as a full device).
    Nothing is capped on a CPU, or without a cap."""
    if cap_bytes is None or not device.startswith("cuda"):
        yield
        return
    release(device)
    index = cuda_index(device)  # the fraction refuses "cuda" without an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), index)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)


def measure_point(loaded, policy, ctx: int, batch: int, new_tokens: int, engine, device: str,
                  rows: int | None = None) -> dict:
    """One generation at ``batch`` (fast: ``rows`` sequences per prefill group): its peak, cache and
    timing; a CUDA OOM is a clean ``oom`` row. The engine holds no decoder before or after it."""
    from kvlab.measure import measure_generation

    row: dict = {"batch": batch}
    started = time.time()
    drop_decoders(engine, device)
    try:
        m = measure_generation(loaded, policy, ctx=ctx, batch=batch, new_tokens=new_tokens, engine=engine,
                               prefill_rows=rows)
        r = m.record
        used = r.get("prefill_rows")  # None: the whole batch in one group
        row.update(status="ok", peak_mem_bytes=r["peak_mem_bytes"],
                   peak_mem_reserved_bytes=r.get("peak_mem_reserved_bytes"), cache_bytes=r["cache_bytes"],
                   cache_bytes_allocated=r.get("cache_bytes_allocated"),
                   cache_physical_tokens=r["cache_physical_tokens"], prefill_s=r["prefill_s"],
                   prefill_groups=-(-batch // used) if used else 1,
                   itl_median_ms=r["itl_median_ms"], peak_mem_source=r.get("peak_mem_source"))
        del m
    except torch.OutOfMemoryError as err:
        row.update(status="oom", error=str(err).splitlines()[0][:400])
    except Exception as err:  # noqa: BLE001 - recorded, the benchmark goes on
        row.update(status="failed", error=f"{type(err).__name__}: {err}"[:800], trace=traceback.format_exc()[-1500:])
    row["seconds"] = time.time() - started
    drop_decoders(engine, device)
    return row


def weights_bytes(loaded, device: str) -> float:
    if device.startswith("cuda"):
        release(device)
        return float(torch.cuda.memory_allocated(device))
    return float(sum(p.numel() * p.element_size() for p in loaded.model.parameters()))


class Report:
    """The JSON written after every row (so a cut command keeps what it measured)."""

    def __init__(self, path: str, args):
        self.path = Path(path)
        self.data = {"args": vars(args), "torch": torch.__version__, "card": device_card(args.device),
                     "rows": [], "fits": [],
                     "env": {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}}

    def add(self, key: str, item: dict) -> None:
        self.data[key].append(item)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def run_context(args, loaded, ctx: int, report: Report, deadline: float) -> None:
    from kvlab.capacity import above, cap_for_batch, fit_peaks, max_batch, split_sequence
    from kvlab.engine.engines import EngineSet
    from kvlab.policies import make_policy

    device = args.device
    # fast: one decoder at a time, dropped after every point (drop_decoders): each peak is its own
    engine = EngineSet(loaded, fast={"max_decoders": 1, "compile": args.fast_compile}).get(args.engine)
    rows = args.prefill_rows
    weights = weights_bytes(loaded, device)
    usable = usable_bytes(device, args.memory_gb)
    report.data.setdefault("contexts", []).append({"ctx": ctx, "weights_bytes": weights, "usable_bytes": usable})
    print(f"ctx {ctx}: weights {weights / GB:.2f} GB, usable {usable / GB:.2f} GB (at load)", flush=True)
    with ExitStack() as stack:
        stack.callback(drop_decoders, engine, device)
        policies = {}
        for method in args.methods:
            name, kw = METHODS[method]
            for chunk in args.chunks:
                policy = make_policy(name, **kw, prefill_chunk=chunk)
                policies[config_name(method, chunk, args.engine, rows)] = stack.enter_context(policy.attach(loaded))
        fits, lines, reserved_lines = {}, {}, {}
        for config, policy in policies.items():
            base = {"ctx": ctx, "config": config, "label": policy.label, "engine": args.engine, "prefill_rows": rows}
            points, reserved, kept, allocated, per_seq_s = [], [], None, None, 0.0
            for batch in args.fixed_batch or args.batches:
                row = {**base, "phase": "fixed" if args.fixed_batch else "fit",
                       **measure_point(loaded, policy, ctx, batch, args.new_tokens, engine, device, rows)}
                report.add("rows", row)
                show(row)
                if row["status"] == "ok":
                    points.append((batch, row["peak_mem_bytes"]))
                    if row.get("peak_mem_reserved_bytes"):
                        reserved.append((batch, row["peak_mem_reserved_bytes"]))
                    kept = row["cache_bytes"] / batch
                    allocated = row["cache_bytes_allocated"] / batch if row.get("cache_bytes_allocated") else None
                    per_seq_s = row["prefill_s"] / batch
            if args.fixed_batch or len({b for b, _ in points}) < 2:
                continue
            line = fit_peaks(points)
            # what torch can hold, read after the points ran: the CUDA context grows as kernels load
            usable = usable_bytes(device, args.memory_gb)
            predicted = max_batch(line, usable)
            split = split_sequence(line, weights, kept, allocated)
            fit = {**base, "intercept_bytes": line.intercept, "slope_bytes": line.slope, "usable_bytes": usable,
                   "predicted_max_batch": predicted, "split": split.as_dict(), "prefill_s_per_sequence": per_seq_s}
            fits[config], lines[config] = fit, line
            if len({b for b, _ in reserved}) >= 2:  # CUDA: what the allocator holds, its slack included
                reserved_lines[config] = r_line = fit_peaks(reserved)
                fit.update(reserved_intercept_bytes=r_line.intercept, reserved_slope_bytes=r_line.slope,
                           predicted_max_batch_reserved=max_batch(r_line, usable))
            report.add("fits", fit)
            share = "" if split.transient_share is None else f" ({split.transient_share:+.1%})"
            print(f"  {config}: {line.slope / GB:.3f} GB/sequence (kept {kept / GB:.3f}, new-token slots "
                  f"{split.new_token_slots_bytes / GB:.3f}, transients {split.transient_bytes / GB:+.3f}{share}); "
                  f"predicted max batch {predicted}"
                  + (f" ({fit['predicted_max_batch_reserved']} from reserved peaks)" if config in reserved_lines else ""),
                  flush=True)
        for config in confirm_list(args.confirm, fits):
            fit = fits[config]
            n = fit["predicted_max_batch"]
            if not n:
                continue
            cap = None
            if args.confirm_max_batch and n > args.confirm_max_batch:  # the line checked under a memory cap
                n = args.confirm_max_batch
                # the cap limits what the allocator reserves: placed on the reserved line where there is one
                cap = cap_for_batch(reserved_lines.get(config) or lines[config], n)
            plan = [("confirm", n)]
            while plan:
                phase, batch = plan.pop(0)
                estimate = 1.3 * batch * fit["prefill_s_per_sequence"] + 5
                head = {"ctx": ctx, "config": config, "label": fit["label"], "engine": args.engine,
                        "prefill_rows": rows, "phase": phase, "batch": batch, "memory_cap_bytes": cap}
                if time.time() + estimate > deadline:
                    row = {**head, "status": "skipped",
                           "error": f"estimated {estimate:.0f} s does not fit --time-budget-s"}
                else:
                    with memory_cap(device, cap):
                        row = {**head, "predicted_peak_bytes": lines[config].peak(batch),
                               "predicted_reserved_bytes": (reserved_lines[config].peak(batch)
                                                            if config in reserved_lines else None),
                               "memory_cap_enforced": cap is not None and device.startswith("cuda"),
                               **measure_point(loaded, policies[config], ctx, batch, args.new_tokens, engine, device,
                                               rows)}
                report.add("rows", row)
                show(row)
                if phase == "confirm" and row["status"] == "ok":
                    plan.append(("above", above(n, args.above)))
                elif phase == "confirm" and row["status"] == "oom":  # the allocator's slack: one step down
                    plan.append(("below", max(1, n - max(1, round(n * args.above * 2)))))


def confirm_list(wanted: list[str], fits: dict) -> list[str]:
    """The fitted configs ``--confirm`` names, in its order: ``all``, ``none``, or names, whole
    (``snapkv10@2048 fast rows4``) or their first word (``snapkv10@2048``)."""
    if wanted == ["all"]:
        return list(fits)
    if wanted == ["none"]:
        return []
    return [c for w in wanted for c in fits if w in (c, c.split()[0])]


def show(row: dict) -> None:
    peak = row.get("peak_mem_bytes")
    text = f"{peak / GB:7.2f} GB peak" if peak else row.get("error", "")[:120]
    cap = ""
    if row.get("memory_cap_bytes"):
        enforced = "" if row.get("memory_cap_enforced", True) else ", not enforced off CUDA"
        cap = f" (cap {row['memory_cap_bytes'] / GB:.2f} GB{enforced})"
    print(f"  {row['config']:26s} {row['phase']:8s} batch {row['batch']:4d}  {row['status']:7s} {text}{cap} "
          f"[{row.get('seconds', 0):.0f}s]", flush=True)


def expandable_child(args, batch: int, ctx: int, report: Report) -> None:
    """The full cache at ``batch`` under expandable segments, in a fresh process (the allocator reads
    PYTORCH_CUDA_ALLOC_CONF once, at CUDA init)."""
    out = str(Path(args.out).with_suffix(f".expandable-{ctx}.json"))
    cmd = [sys.executable, __file__, "--model", args.model, "--weights", args.weights, "--device", args.device,
           "--ctx", str(ctx), "--methods", "full", "--chunks", "none", "--fixed-batch", str(batch),
           "--new-tokens", str(args.new_tokens), "--engine", args.engine, "--out", out]
    if args.engine == "fast":
        cmd += ["--fast-compile", args.fast_compile]
    if args.prefill_rows is not None:
        cmd += ["--prefill-rows", str(args.prefill_rows)]
    if args.memory_gb is not None:
        cmd += ["--memory-gb", str(args.memory_gb)]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    config = config_name("full", None, args.engine, args.prefill_rows)
    print(f"expandable segments: {config} at batch {batch} (child process)", flush=True)
    done = subprocess.run(cmd, env=env, check=False)
    rows = json.loads(Path(out).read_text())["rows"] if Path(out).is_file() else []
    for row in rows:
        report.add("rows", {**row, "phase": "expandable_segments"})
    if not rows:
        report.add("rows", {"ctx": ctx, "config": config, "engine": args.engine, "prefill_rows": args.prefill_rows,
                            "phase": "expandable_segments", "batch": batch, "status": "failed",
                            "error": f"child exited {done.returncode} with no rows"})


def full_baseline(config: str, names) -> str | None:
    """The full cache a config is compared with: same engine and rows, same chunk if fitted, else
    one-shot (older files name configs without engine: ``full@once``)."""
    head, _, suffix = config.partition(" ")
    chunk = head.split("@", 1)[-1]
    for candidate in (f"full@{chunk}", "full@once"):
        name = f"{candidate} {suffix}".strip()
        if name in names and name != config:
            return name
    return None


def summarize(report: Report) -> None:
    print(f"\n{'ctx':>6} {'config':26s} GB/seq   kept  slots  transient (share)  max batch (predicted)  "
          f"(reserved)  confirm  above")
    rows = report.data["rows"]
    for fit in report.data["fits"]:
        s = fit["split"]

        def status(phase, fit=fit):
            r = [x for x in rows if x["config"] == fit["config"] and x["ctx"] == fit["ctx"] and x["phase"] == phase]
            if not r:
                return "-"
            cap = r[-1].get("memory_cap_bytes")
            return f"{r[-1]['status']}@{r[-1]['batch']}" + (f" (cap {cap / GB:.1f} GB)" if cap else "")

        share = s.get("transient_share")
        share = f"({share:+.1%})" if share is not None else ""
        print(f"{fit['ctx']:6d} {fit['config']:26s} {s['per_sequence_bytes'] / GB:6.3f} {s['kept_cache_bytes'] / GB:6.3f}"
              f" {s.get('new_token_slots_bytes', 0.0) / GB:6.3f} {s['transient_bytes'] / GB:+9.3f} {share:>8}"
              f"  {fit['predicted_max_batch']!s:>21}  {fit.get('predicted_max_batch_reserved', '-')!s:>10}"
              f"  {status('confirm'):>7}  {status('above')}")
    by = {(f["ctx"], f["config"]): f["predicted_max_batch"] for f in report.data["fits"]}
    for ctx in sorted({c for c, _ in by}):
        names = {config for c, config in by if c == ctx}
        for config in sorted(names):
            base_name = full_baseline(config, names)
            n, base = by[(ctx, config)], by.get((ctx, base_name))
            if base and n and not config.startswith("full@"):
                print(f"{ctx}: {config} holds {n / base:.2f}x the full cache's predicted batch "
                      f"({n} vs {base}, {base_name})")


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """Bad combinations end here, before any model loads (``ap.error``: one line, exit 2); fills in
    the default fit batches."""
    rows = args.prefill_rows
    if not args.device.startswith("cuda") and args.memory_gb is None:
        ap.error(f"--device {args.device}: give --memory-gb (the memory to predict against; a CPU has no "
                 f"allocator to read it from)")
    if rows is not None and rows < 1:
        ap.error(f"--prefill-rows {rows}: give a number of sequences >= 1")
    if rows is not None and args.engine != "fast":
        ap.error(f"--prefill-rows {rows} needs --engine fast: transformers' decode cache (hf) cannot be put "
                 f"together from row groups without holding the whole batch's")
    if args.fast_compile is not None and args.engine != "fast":
        ap.error(f"--fast-compile {args.fast_compile} needs --engine fast")
    args.fast_compile = args.fast_compile or "none"
    if args.batches is None:
        args.batches = [rows, 4 * rows] if rows else [1, 8]
    if any(b < 1 for b in args.batches + (args.fixed_batch or [])):
        ap.error("--batches and --fixed-batch take batches >= 1")
    if rows and min(args.batches) < rows and not args.fixed_batch:
        ap.error(f"--batches {' '.join(map(str, args.batches))} with --prefill-rows {rows}: fit batches must be "
                 f">= {rows} (a smaller batch prefills in one smaller group, so its transient differs and the "
                 f"line would not hold); e.g. --batches {rows} {4 * rows}")
    if args.confirm_max_batch is not None and args.confirm_max_batch < 1:
        ap.error(f"--confirm-max-batch {args.confirm_max_batch}: give a batch >= 1")
    if args.confirm is None:  # the default names what the default methods and chunks measure
        args.confirm = DEFAULT_CONFIRM
        return
    known = {config_name(m, c).split()[0] for m in args.methods for c in args.chunks}
    unknown = [c for c in args.confirm if c not in ("all", "none") and c.split()[0] not in known]
    if unknown:
        ap.error(f"--confirm {' '.join(unknown)}: not a measured config; this run measures "
                 f"{', '.join(sorted(known))} (or give all | none)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--weights", default="synthetic")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, nargs="+", default=[16384])
    ap.add_argument("--methods", nargs="+", default=["full", "snapkv10"], choices=list(METHODS))
    ap.add_argument("--chunks", nargs="+", type=parse_chunk, default=[None, 2048, 512],
                    help="prefill chunks (none: one shot)")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="batches the peak line is fitted to (default 1 8; with --prefill-rows N: N 4N)")
    ap.add_argument("--fixed-batch", type=int, nargs="+", default=None, help="only run these batches (no fit)")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--confirm", nargs="+", default=None,
                    help="configs run at their predicted max batch and just above it (all | none | names; "
                         f"default: {' '.join(DEFAULT_CONFIRM)}, those measured)")
    ap.add_argument("--above", type=float, default=0.02, help="the batch above: predicted x (1 + this), at least +1")
    ap.add_argument("--memory-gb", type=float, default=None, help="memory to predict against (default: the GPU's)")
    ap.add_argument("--engine", choices=["hf", "fast"], default="hf")
    ap.add_argument("--prefill-rows", type=int, default=None, metavar="N",
                    help="fast engine: prefill N sequences at a time into the static store (fit batches >= N)")
    ap.add_argument("--fast-compile", choices=STEP_COMPILE, default=None,
                    help="fast engine: how its step is compiled (default none: see the docstring)")
    ap.add_argument("--confirm-max-batch", type=int, default=None, metavar="B",
                    help="confirm a config predicted above B at B, under a memory cap where its line predicts B")
    ap.add_argument("--expandable-batch", type=int, default=None,
                    help="also run full@once at this batch under expandable_segments (child process)")
    ap.add_argument("--time-budget-s", type=float, default=420,
                    help="skip confirm runs whose estimate would end past this (from the start, load included)")
    ap.add_argument("--out", default="capacity.json")
    ap.add_argument("--table", default=None, metavar="JSON", help="only print the summary of a written file")
    args = ap.parse_args(argv)
    if args.table:
        report = Report(args.table, args)
        report.data = json.loads(Path(args.table).read_text())
        summarize(report)
        return 0
    check_args(ap, args)

    from kvlab.models import load_model

    started = time.time()
    deadline = started + args.time_budget_s
    report = Report(args.out, args)
    if args.device.startswith("cuda"):
        report.data["gpu"] = torch.cuda.get_device_name(args.device)
    loaded = load_model(args.model, weights=args.weights, device=args.device)
    report.data["load_s"] = time.time() - started
    for ctx in args.ctx:
        run_context(args, loaded, ctx, report, deadline)
    if args.expandable_batch and not args.fixed_batch:
        del loaded
        release(args.device)
        for ctx in args.ctx:
            expandable_child(args, args.expandable_batch, ctx, report)
    report.data["seconds"] = time.time() - started
    report.write()
    summarize(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
