"""The same quality items on both engines: gold-answer NLL per storage format, hf vs fast (issue #28).

Both engines prefill the context exactly, then feed the question, decode, and teacher-force the
gold answer through their own storage (``Decoder.feed``): a format must score the same on both,
within the numerics of the two attention paths (transformers' SDPA over dequantized K/V vs kvlab's
fused kernel or, on CPU, its float32 reference). Prints per (method, length): mean gold NLL on each
engine, their difference, and the largest per-item difference; writes every record to ``--out``.

    python benchmarks/quality_engines.py --device cuda --lengths 1024 2048 4096 --out $OUT/quality_engines.json
    python benchmarks/quality_engines.py --device cpu --lengths 1024 --depths 0.5 --samples 1 --out q.json  # slow on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", nargs="+", default=["full", "kvq-int4", "kvq-fp8"])
    ap.add_argument("--tasks", nargs="+", default=["niah_single"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096])
    ap.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--out", default="quality_engines.json")
    args = ap.parse_args()

    from kvlab.engine.engines import make_engine
    from kvlab.models import load_model
    from kvlab.policies import make_policy
    from kvlab.quality.run import run_quality
    from kvlab.quality.spec import TaskSpec

    t0 = time.time()
    loaded = load_model(args.model, device=args.device)
    spec = TaskSpec(tasks=args.tasks, lengths=args.lengths, depths=args.depths, samples=args.samples)
    records = {}
    for engine in ("hf", "fast"):
        policies = [make_policy(m) for m in args.methods]
        records[engine] = run_quality(loaded, policies, spec, engine=make_engine(engine, loaded))
        print(f"{engine}: {len(records[engine])} records [{time.time() - t0:.0f}s]", flush=True)

    def key(r):
        return (r["method"], r["task"], r["length"], r["depth"], r["sample"])

    by = {e: {key(r): r for r in rs if r.get("status", "ok") == "ok"} for e, rs in records.items()}
    rows = []
    print("\nmethod      task          length  hf gold NLL  fast gold NLL  fast-hf  max |item diff|  n")
    for method in args.methods:
        for task in args.tasks:
            for length in args.lengths:
                keys = [k for k in by["hf"] if k[:3] == (method, task, length) and k in by["fast"]]
                if not keys:
                    continue
                hf = [by["hf"][k]["gold_nll"] for k in keys]
                fast = [by["fast"][k]["gold_nll"] for k in keys]
                row = {"method": method, "task": task, "length": length, "n": len(keys),
                       "hf_gold_nll": statistics.fmean(hf), "fast_gold_nll": statistics.fmean(fast),
                       "max_item_diff": max(abs(a - b) for a, b in zip(hf, fast, strict=True)),
                       "hf_score": statistics.fmean(by["hf"][k]["score"] for k in keys),
                       "fast_score": statistics.fmean(by["fast"][k]["score"] for k in keys)}
                row["diff"] = row["fast_gold_nll"] - row["hf_gold_nll"]
                rows.append(row)
                print(f"{method:11s} {task:13s} {length:6d} {row['hf_gold_nll']:11.4f} {row['fast_gold_nll']:14.4f} "
                      f"{row['diff']:+8.4f} {row['max_item_diff']:16.4f} {len(keys):2d}")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "summary": rows, "records": records}, f, indent=1, default=str)
    print(f"wrote {args.out} [{time.time() - t0:.0f}s]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
