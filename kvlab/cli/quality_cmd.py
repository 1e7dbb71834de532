"""`kvlab quality`: the offline quality pass (generated retrieval tasks, LongBench files, continuation
fidelity) for one model and a set of cache policies; records go to DIR/records.jsonl.

    kvlab quality --model smollm2-135m --tasks niah_single --lengths 1024 2048 \\
        --methods full streamingllm snapkv quanto --keep 0.25 --bits 4 -o runs/quality
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("quality", help="score cache policies on offline tasks and against the full cache",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="preset name or local model folder (needs a tokenizer)")
    p.add_argument("--weights", choices=("real", "synthetic"), default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--tasks", nargs="*", default=["niah_single"],
                   help="niah_single niah_multikey niah_multivalue variable_tracking (vt) continuation")
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048], help="prompt tokens per item")
    p.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9], help="needle depths in [0, 1]")
    p.add_argument("--samples", type=int, default=2, help="items per (task, length, depth)")
    p.add_argument("--methods", nargs="+", default=["full"], help="policy names (see `kvlab policies`)")
    p.add_argument("--keep", nargs="+", type=float, default=None, help="kept fractions for eviction methods")
    p.add_argument("--bits", nargs="+", type=int, default=None, help="bit widths for quantized methods")
    p.add_argument("--query-aware", action="store_true", help="compress the question with the context")
    p.add_argument("--threshold", type=float, default=0.7,
                   help="full-cache score below which a (task, length) cell is marked no_signal")
    p.add_argument("--max-new-tokens", type=int, default=None, help="override the tasks' generation budgets")
    p.add_argument("--longbench", default=None, help="a LongBench jsonl file or folder you already have")
    p.add_argument("--longbench-datasets", nargs="+", default=None, help="only these LongBench datasets")
    p.add_argument("--text", nargs="+", default=[], help="text files for the continuation task "
                   "(default: text that ships with Python)")
    p.add_argument("--continuation-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--out", required=True, help="output folder (records.jsonl, manifest.json, summary)")
    p.set_defaults(func=run)


def policies_from_args(args) -> list:
    """Expand --methods x --keep/--bits the way sweeps do, then build the policies (validated)."""
    from kvlab.params import SweepParams, method_variants
    from kvlab.policies import make_policy

    params = SweepParams(models=[args.model], methods=args.methods, keep=args.keep, bits=args.bits,
                         ctx=args.lengths)
    return [make_policy(v.method, **v.kwargs) for _, v in method_variants(params)]


def run(args) -> int:
    from kvlab.models import load_model
    from kvlab.quality import TaskSpec, quality_notes, run_quality, summarize
    from kvlab.records import RECORDS_FILE, RecordWriter, write_manifest

    spec = TaskSpec(tasks=args.tasks, lengths=args.lengths, depths=args.depths, samples=args.samples,
                    seed=args.seed, query_aware=args.query_aware, no_signal_threshold=args.threshold,
                    max_new_tokens=args.max_new_tokens, longbench=args.longbench,
                    longbench_datasets=args.longbench_datasets, text_files=args.text,
                    continuation_tokens=args.continuation_tokens)
    policies = policies_from_args(args)  # validated before the model loads
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model, weights=args.weights, device=args.device, dtype=args.dtype, seed=args.seed)
    write_manifest(out, {"kind": "quality", "model": loaded.provenance(), "task_spec": spec.model_dump(),
                         "methods": [p.params() for p in policies]})
    with RecordWriter(out / RECORDS_FILE) as writer:
        records = run_quality(loaded, policies, spec, writer, base={"sweep": out.name}, progress_bar=True)
    summary = summarize(records)
    if not summary.empty:
        summary.to_csv(out / "quality_summary.csv", index=False)
        cols = [c for c in ("task", "length", "label", "n", "no_signal", "score", "score_diff", "gold_nll",
                            "kl", "top1_agree") if c in summary.columns]
        print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for note in quality_notes(records):
        print(f"note: {note}")
    failed = [r for r in records if r["status"] != "ok"]
    for r in failed[:5]:
        print(f"failed: {r['label']} {r['task']} L={r['length']}: {r['error']}", file=sys.stderr)
    print(f"{len(records)} quality records ({len(failed)} failed) in {out / RECORDS_FILE}")
    return 1 if failed else 0
