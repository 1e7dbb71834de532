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

import torch

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
    ap.add_argument("--no-hf1", dest="hf1", action="store_false",
                    help="skip hf1 (hf feeding one token at a time: the rounding-noise yardstick)")
    ap.add_argument("--out", default="quality_engines.json")
    args = ap.parse_args()

    from kvlab.engine.engines import make_engine
    from kvlab.engine.hf import HFDecoder, HFEngine
    from kvlab.models import load_model
    from kvlab.policies import make_policy
    from kvlab.quality.run import run_quality
    from kvlab.quality.spec import TaskSpec

    class TokenByTokenDecoder(HFDecoder):
        def feed(self, input_ids, start_position):
            return torch.cat([super(TokenByTokenDecoder, self).feed(input_ids[:, j:j + 1], start_position + j)
                              for j in range(input_ids.shape[1])], dim=1)

    class TokenByTokenEngine(HFEngine):  # records say engine hf; the summary calls it hf1
        def decoder_for_cache(self, policy, cache, new_tokens, prefill_stats=None):
            return TokenByTokenDecoder(self.model, cache, prefill_stats)

    t0 = time.time()
    loaded = load_model(args.model, device=args.device)
    spec = TaskSpec(tasks=args.tasks, lengths=args.lengths, depths=args.depths, samples=args.samples)
    records = {}
    engines = {"hf": make_engine("hf", loaded), "fast": make_engine("fast", loaded)}
    if args.hf1:
        engines["hf1"] = TokenByTokenEngine(loaded)
    for engine, made in engines.items():
        policies = [make_policy(m) for m in args.methods]
        records[engine] = run_quality(loaded, policies, spec, engine=made)
        print(f"{engine}: {len(records[engine])} records [{time.time() - t0:.0f}s]", flush=True)

    def key(r):
        return (r["method"], r["task"], r["length"], r["depth"], r["sample"])

    by = {e: {key(r): r for r in rs if r.get("status", "ok") == "ok"} for e, rs in records.items()}
    rows = []
    print("\nmethod      task          length  hf gold NLL  fast gold NLL  fast-hf  max |item diff|  "
          "hf1 gold NLL  hf1-hf  max |item diff hf1-hf|  n")
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
                hf1 = [by["hf1"][k]["gold_nll"] for k in keys if k in by.get("hf1", {})]
                if len(hf1) == len(keys):
                    row.update(hf1_gold_nll=statistics.fmean(hf1), hf1_diff=statistics.fmean(hf1) - row["hf_gold_nll"],
                               hf1_max_item_diff=max(abs(a - b) for a, b in zip(hf, hf1, strict=True)))
                rows.append(row)
                extra = (f" {row['hf1_gold_nll']:13.4f} {row['hf1_diff']:+7.4f} {row['hf1_max_item_diff']:23.4f}"
                         if "hf1_gold_nll" in row else f" {'-':>13} {'-':>7} {'-':>23}")
                print(f"{method:11s} {task:13s} {length:6d} {row['hf_gold_nll']:11.4f} {row['fast_gold_nll']:14.4f} "
                      f"{row['diff']:+8.4f} {row['max_item_diff']:16.4f}{extra} {len(keys):2d}")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "summary": rows, "records": records}, f, indent=1, default=str)
    print(f"wrote {args.out} [{time.time() - t0:.0f}s]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
