"""Capacity per method at long context: per-sequence peak split, the predicted largest batch, confirmed.

For the H200 (issue #14), after ``. scripts/device/setup.sh``:

    python benchmarks/capacity.py --ctx 16384 --out $OUT/capacity-16k.json --expandable-batch 32
    python benchmarks/capacity.py --ctx 32768 --chunks none 2048 --confirm snapkv10@2048 --out $OUT/capacity-32k.json

Per context (Llama-3.1-8B shape, synthetic bf16 weights, the ``hf`` engine unless ``--engine fast``):
every config (method x prefill chunk; ``snapkv10@2048`` = SnapKV keep 10%, 2048-token chunks,
``full@once`` = the full cache, one-shot prefill) is measured at the ``--batches`` (default 1 and 8,
``--new-tokens`` 4): torch's peak allocated bytes per run. A line through those peaks gives the
per-sequence cost (the slope), split into the kept cache (``cache_bytes / batch``) and the
prefill's transients (the rest), and the largest batch whose predicted peak fits the memory torch
can use (free + reserved after loading, or ``--memory-gb``). The ``--confirm`` configs then run at
that batch, and at one just above it (``--above``, 2% more), which should end in a clean
out-of-memory row (a confirm run that runs out of memory is followed by one 4% below instead). ``--expandable-batch N`` reruns the full cache (one-shot) at batch N in a child
process under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. Confirm runs whose estimated
time (from the fit runs' prefill) does not fit ``--time-budget-s`` are skipped and say so.
Every row goes to ``--out`` as it is measured; the summary table is printed at the end (and by
``--table FILE`` from a written file).

CPU smoke (mechanics only: a CPU's peak is the process's peak RSS):
    python benchmarks/capacity.py --device cpu --model tiny-llama --ctx 256 --chunks none 64 --memory-gb 2 --out /tmp/c.json
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
from contextlib import ExitStack
from pathlib import Path

import torch

METHODS = {
    "full": ("full", {}),
    "snapkv10": ("snapkv", {"keep": 0.1}),
    "pyramidkv10": ("pyramidkv", {"keep": 0.1}),
    "kvq-int4": ("kvq-int4", {}),
    "quanto4": ("quanto", {"nbits": 4}),
}
GB = 1e9


def config_name(method: str, chunk: int | None) -> str:
    return f"{method}@{chunk if chunk else 'once'}"


def parse_chunk(text: str) -> int | None:
    return None if text.lower() in ("none", "null", "once") else int(text)


def release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def usable_bytes(device: str, memory_gb: float | None) -> float:
    """What torch can hold at its peak: ``--memory-gb``, else the device's free memory plus what
    torch's allocator already reserved (weights included), measured after the model loaded."""
    if memory_gb is not None:
        return memory_gb * GB
    if not device.startswith("cuda"):
        raise SystemExit("capacity.py: on a CPU give --memory-gb (the memory to predict against)")
    release(device)
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def measure_point(loaded, policy, ctx: int, batch: int, new_tokens: int, engine, device: str) -> dict:
    """One generation at ``batch``: its peak, cache and timing; a CUDA OOM is a clean ``oom`` row."""
    from kvlab.measure import measure_generation

    row: dict = {"batch": batch}
    started = time.time()
    try:
        m = measure_generation(loaded, policy, ctx=ctx, batch=batch, new_tokens=new_tokens, engine=engine)
        r = m.record
        row.update(status="ok", peak_mem_bytes=r["peak_mem_bytes"],
                   peak_mem_reserved_bytes=r.get("peak_mem_reserved_bytes"), cache_bytes=r["cache_bytes"],
                   cache_physical_tokens=r["cache_physical_tokens"], prefill_s=r["prefill_s"],
                   itl_median_ms=r["itl_median_ms"], peak_mem_source=r.get("peak_mem_source"))
        del m
    except torch.OutOfMemoryError as err:
        row.update(status="oom", error=str(err).splitlines()[0][:400])
    except Exception as err:  # noqa: BLE001 - recorded, the benchmark goes on
        row.update(status="failed", error=f"{type(err).__name__}: {err}"[:800], trace=traceback.format_exc()[-1500:])
    row["seconds"] = time.time() - started
    release(device)
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
        self.data = {"args": vars(args), "torch": torch.__version__, "rows": [], "fits": [],
                     "env": {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}}

    def add(self, key: str, item: dict) -> None:
        self.data[key].append(item)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def run_context(args, loaded, ctx: int, report: Report, deadline: float) -> None:
    from kvlab.capacity import above, fit_peaks, max_batch, split_sequence
    from kvlab.policies import make_policy

    device = args.device
    engine = None
    if args.engine == "fast":
        from kvlab.engine.fast import FastEngine

        engine = FastEngine(loaded, max_decoders=1)
    weights = weights_bytes(loaded, device)
    usable = usable_bytes(device, args.memory_gb)
    report.data.setdefault("contexts", []).append({"ctx": ctx, "weights_bytes": weights, "usable_bytes": usable})
    print(f"ctx {ctx}: weights {weights / GB:.2f} GB, usable {usable / GB:.2f} GB", flush=True)
    with ExitStack() as stack:
        policies = {}
        for method in args.methods:
            name, kw = METHODS[method]
            for chunk in args.chunks:
                policy = make_policy(name, **kw, prefill_chunk=chunk)
                policies[config_name(method, chunk)] = stack.enter_context(policy.attach(loaded))
        fits = {}
        for config, policy in policies.items():
            points, kept, per_seq_s = [], None, 0.0
            for batch in args.fixed_batch or args.batches:
                row = {"ctx": ctx, "config": config, "label": policy.label, "phase": "fixed" if args.fixed_batch
                       else "fit", **measure_point(loaded, policy, ctx, batch, args.new_tokens, engine, device)}
                report.add("rows", row)
                show(row)
                if row["status"] == "ok":
                    points.append((batch, row["peak_mem_bytes"]))
                    kept = row["cache_bytes"] / batch
                    per_seq_s = row["prefill_s"] / batch
            if args.fixed_batch or len({b for b, _ in points}) < 2:
                continue
            line = fit_peaks(points)
            predicted = max_batch(line, usable)
            fit = {"ctx": ctx, "config": config, "label": policy.label, "intercept_bytes": line.intercept,
                   "slope_bytes": line.slope, "predicted_max_batch": predicted,
                   "split": split_sequence(line, weights, kept).as_dict(), "prefill_s_per_sequence": per_seq_s}
            fits[config] = fit
            report.add("fits", fit)
            print(f"  {config}: {line.slope / GB:.3f} GB/sequence (kept {kept / GB:.3f}, transients "
                  f"{(line.slope - kept) / GB:.3f}); predicted max batch {predicted}", flush=True)
        for config in confirm_list(args.confirm, fits):
            fit = fits[config]
            n = fit["predicted_max_batch"]
            if not n:
                continue
            plan = [("confirm", n)]
            while plan:
                phase, batch = plan.pop(0)
                estimate = 1.3 * batch * fit["prefill_s_per_sequence"] + 5
                if time.time() + estimate > deadline:
                    row = {"ctx": ctx, "config": config, "phase": phase, "batch": batch, "status": "skipped",
                           "error": f"estimated {estimate:.0f} s does not fit --time-budget-s"}
                else:
                    row = {"ctx": ctx, "config": config, "label": fit["label"], "phase": phase,
                           "predicted_peak_bytes": fit["intercept_bytes"] + fit["slope_bytes"] * batch,
                           **measure_point(loaded, policies[config], ctx, batch, args.new_tokens, engine, device)}
                report.add("rows", row)
                show(row)
                if phase == "confirm" and row["status"] == "ok":
                    plan.append(("above", above(n, args.above)))
                elif phase == "confirm" and row["status"] == "oom":  # the allocator's slack: one step down
                    plan.append(("below", max(1, n - max(1, round(n * args.above * 2)))))


def confirm_list(wanted: list[str], fits: dict) -> list[str]:
    if wanted == ["all"]:
        return list(fits)
    if wanted == ["none"]:
        return []
    return [c for c in wanted if c in fits]


def show(row: dict) -> None:
    peak = row.get("peak_mem_bytes")
    text = f"{peak / GB:7.2f} GB peak" if peak else row.get("error", "")[:120]
    print(f"  {row['config']:18s} {row['phase']:8s} batch {row['batch']:4d}  {row['status']:7s} {text} "
          f"[{row.get('seconds', 0):.0f}s]", flush=True)


def expandable_child(args, batch: int, ctx: int, report: Report) -> None:
    """The full cache at ``batch`` under expandable segments, in a fresh process (the allocator reads
    PYTORCH_CUDA_ALLOC_CONF once, at CUDA init)."""
    out = str(Path(args.out).with_suffix(f".expandable-{ctx}.json"))
    cmd = [sys.executable, __file__, "--model", args.model, "--weights", args.weights, "--device", args.device,
           "--ctx", str(ctx), "--methods", "full", "--chunks", "none", "--fixed-batch", str(batch),
           "--new-tokens", str(args.new_tokens), "--engine", args.engine, "--out", out]
    if args.memory_gb is not None:
        cmd += ["--memory-gb", str(args.memory_gb)]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    print(f"expandable segments: full@once at batch {batch} (child process)", flush=True)
    done = subprocess.run(cmd, env=env, check=False)
    rows = json.loads(Path(out).read_text())["rows"] if Path(out).is_file() else []
    for row in rows:
        report.add("rows", {**row, "phase": "expandable_segments"})
    if not rows:
        report.add("rows", {"ctx": ctx, "config": "full@once", "phase": "expandable_segments", "batch": batch,
                            "status": "failed", "error": f"child exited {done.returncode} with no rows"})


def summarize(report: Report) -> None:
    print("\nctx    config             GB/seq  kept  transient  max batch (predicted)  confirm  above")
    rows = report.data["rows"]
    for fit in report.data["fits"]:
        s = fit["split"]

        def status(phase, fit=fit):
            r = [x for x in rows if x["config"] == fit["config"] and x["ctx"] == fit["ctx"] and x["phase"] == phase]
            return f"{r[-1]['status']}@{r[-1]['batch']}" if r else "-"

        print(f"{fit['ctx']:6d} {fit['config']:18s} {s['per_sequence_bytes'] / GB:6.3f} {s['kept_cache_bytes'] / GB:5.3f}"
              f" {s['transient_bytes'] / GB:9.3f}  {fit['predicted_max_batch']!s:>21}  {status('confirm'):>7}"
              f"  {status('above')}")
    by = {(f["ctx"], f["config"]): f["predicted_max_batch"] for f in report.data["fits"]}
    for ctx in sorted({c for c, _ in by}):
        base = by.get((ctx, "full@once"))
        for (c, config), n in sorted(by.items()):
            if c == ctx and base and n:
                print(f"{ctx}: {config} holds {n / base:.2f}x the full cache's one-shot batch ({n} vs {base})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--weights", default="synthetic")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, nargs="+", default=[16384])
    ap.add_argument("--methods", nargs="+", default=["full", "snapkv10"], choices=list(METHODS))
    ap.add_argument("--chunks", nargs="+", type=parse_chunk, default=[None, 2048, 512],
                    help="prefill chunks (none: one shot)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batches the peak line is fitted to")
    ap.add_argument("--fixed-batch", type=int, nargs="+", default=None, help="only run these batches (no fit)")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--confirm", nargs="+", default=["snapkv10@2048", "full@once", "full@2048"],
                    help="configs run at their predicted max batch and just above it (all | none | names)")
    ap.add_argument("--above", type=float, default=0.02, help="the batch above: predicted x (1 + this), at least +1")
    ap.add_argument("--memory-gb", type=float, default=None, help="memory to predict against (default: the GPU's)")
    ap.add_argument("--engine", choices=["hf", "fast"], default="hf")
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
