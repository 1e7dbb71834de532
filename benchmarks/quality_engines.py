"""The same quality items on both engines: gold-answer NLL per storage format, hf vs fast (issue #28).

Both engines prefill the context exactly, then feed the question, decode, and teacher-force the
gold answer through their own storage (``Decoder.feed``): a format must score the same on both,
within the numerics of the two attention paths (transformers' SDPA over dequantized K/V vs kvlab's
fused kernel or, on CPU, its float32 reference). Prints per (method, length): mean gold NLL on each
engine, their difference, and the largest per-item difference; writes every record to ``--out``.

The yardstick of "within noise": ``hf1``, the hf engine feeding the question and the gold one token
at a time (as fast does) instead of in one forward. Same storage, same codes for the context; only
the float rounding of the K/V computed for the fed tokens differs, and in an int4 store a 1-ulp
difference that crosses a rounding boundary moves an element by a whole quantization step, then
every later layer diverges (SmolLM2 on CPU, 2026-12-03: the first code flip at layer 12, dozens by
layer 27). hf vs hf1 is the per-item spread that any two implementations of the same format show.

So a format's gold NLL is compared between engines as a mean over items, against that spread: each
row prints the standard deviation of the per-item differences and ``within noise`` when the mean
difference's 95% t-interval holds 0 (:mod:`kvlab.intervals`; none below 3 items). On CPU (2026-12-05, SmolLM2, bf16,
reports/cpu-quality-engines-2026-12-05) the per-item kvq-int4 difference between engines, and
between hf and hf1, reached 0.2-0.3 nats, with the context's codes bit-identical on both engines.

    python benchmarks/quality_engines.py --device cuda --lengths 1024 2048 4096 --out $OUT/quality_engines.json
    python benchmarks/quality_engines.py --device cpu --dtype bfloat16 --lengths 1024 --samples 1 --out q.json  # slow on CPU
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvlab.intervals import mean_interval  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


def agreement(base: list[float], other: list[float]) -> dict[str, float | bool | None]:
    """Per-item gold NLLs of one cell on two engines (same items, same order): the mean difference
    ``other - base``, the standard deviation of the per-item differences, the standard error of the
    mean difference, the largest per-item difference, the mean difference's 95% t-interval
    (``diff_lo``, ``diff_hi``: :func:`kvlab.intervals.mean_interval`, none below 3 items) and
    ``within_noise``: that interval holds 0 (None below 3 items). Implementations of a quantized
    format disagree item by item by rounding noise that grows through the layers (the module
    docstring), so only a mean difference beyond that noise says one engine scores differently."""
    diffs = [b - a for a, b in zip(base, other, strict=True)]
    sd = statistics.stdev(diffs) if len(diffs) > 1 else None
    se = None if sd is None else sd / math.sqrt(len(diffs))
    mean = mean_interval(diffs)
    return {"diff": mean.value, "sd_item_diff": sd, "se_diff": se, "max_item_diff": max(abs(d) for d in diffs),
            "diff_lo": mean.lo if mean.has_bounds else None, "diff_hi": mean.hi if mean.has_bounds else None,
            "within_noise": mean.lo <= 0 <= mean.hi if mean.has_bounds else None}


def summary_rows(records: dict[str, list[dict]], methods, tasks, lengths) -> list[dict]:
    """One row per (method, task, length) with items on both hf and fast: mean gold NLL and score on
    each engine, :func:`agreement` of fast with hf, and of hf1 with hf where hf1 ran every item."""
    def key(r):
        return (r["method"], r["task"], r["length"], r["depth"], r["sample"])

    by = {e: {key(r): r for r in rs if r.get("status", "ok") == "ok"} for e, rs in records.items()}
    rows = []
    for method in methods:
        for task in tasks:
            for length in lengths:
                keys = [k for k in by["hf"] if k[:3] == (method, task, length) and k in by["fast"]]
                if not keys:
                    continue
                nll = {e: [by[e][k]["gold_nll"] for k in keys] for e in by if all(k in by[e] for k in keys)}
                row = {"method": method, "task": task, "length": length, "n": len(keys),
                       **{f"{e}_gold_nll": statistics.fmean(v) for e, v in nll.items()},
                       **{f"{e}_score": statistics.fmean(by[e][k]["score"] for k in keys) for e in nll},
                       **agreement(nll["hf"], nll["fast"])}
                if "hf1" in nll:
                    row.update({f"hf1_{k}": v for k, v in agreement(nll["hf"], nll["hf1"]).items()})
                rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    def num(value, spec):
        return "-" if value is None else format(value, spec)

    print("\nmethod      task          length  n  hf gold NLL  fast gold NLL  fast-hf  sd(item)  max|item|  noise?  "
          "hf1 gold NLL  hf1-hf  sd(item)  max|item|")
    for r in rows:
        verdict = {True: "within", False: "BEYOND", None: "-"}[r["within_noise"]]
        print(f"{r['method']:11s} {r['task']:13s} {r['length']:6d} {r['n']:2d} {r['hf_gold_nll']:11.4f} "
              f"{r['fast_gold_nll']:14.4f} {r['diff']:+8.4f} {num(r['sd_item_diff'], '9.4f'):>9} "
              f"{r['max_item_diff']:10.4f}  {verdict:6s} {num(r.get('hf1_gold_nll'), '13.4f'):>13} "
              f"{num(r.get('hf1_diff'), '+7.4f'):>7} {num(r.get('hf1_sd_item_diff'), '9.4f'):>9} "
              f"{num(r.get('hf1_max_item_diff'), '10.4f'):>10}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=DTYPES, default=None,
                    help="model dtype (default: the device's, bfloat16 on CUDA and float32 on CPU)")
    ap.add_argument("--methods", nargs="+", default=["full", "kvq-int4", "kvq-fp8"])
    ap.add_argument("--tasks", nargs="+", default=["niah_single"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096])
    ap.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--no-hf1", dest="hf1", action="store_false",
                    help="skip hf1 (hf feeding one token at a time: the rounding-noise yardstick)")
    ap.add_argument("--out", default="quality_engines.json")
    args = ap.parse_args()

    from kvlab.card import device_card
    from kvlab.engine.engines import make_engine
    from kvlab.models import load_model
    from kvlab.policies import make_policy
    from kvlab.quality.run import run_quality
    from kvlab.quality.spec import TaskSpec

    t0 = time.time()
    loaded = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    spec = TaskSpec(tasks=args.tasks, lengths=args.lengths, depths=args.depths, samples=args.samples)
    records = {}
    engines = {"hf": make_engine("hf", loaded), "fast": make_engine("fast", loaded)}
    if args.hf1:
        engines["hf1"] = make_engine("hf", loaded, feed="stepwise")  # records say engine hf; the summary: hf1
    for engine, made in engines.items():
        policies = [make_policy(m) for m in args.methods]
        records[engine] = run_quality(loaded, policies, spec, engine=made)
        print(f"{engine}: {len(records[engine])} records [{time.time() - t0:.0f}s]", flush=True)

    rows = summary_rows(records, args.methods, args.tasks, args.lengths)
    print_rows(rows)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "card": device_card(args.device), "summary": rows, "records": records}, f,
                  indent=1, default=str)
    print(f"wrote {args.out} [{time.time() - t0:.0f}s]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
