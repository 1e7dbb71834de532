"""`kvlab quality`: the offline quality pass (generated retrieval tasks, LongBench files, continuation
fidelity) for one model and a set of cache policies; records go to DIR/records.jsonl.

    kvlab quality --model smollm2-135m --tasks niah_single --lengths 1024 2048 \\
        --methods full streamingllm snapkv quanto --keep 0.25 --bits 4 -o runs/quality

Rerunning into the same folder resumes: items recorded ok are not run again. Exit status: 0 when
every record is ok, 3 when some failed (their errors are in the records), 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys

# TaskSpec fields whose flag is not --field-name
FLAGS = {"no_signal_threshold": "--threshold", "text_files": "--text"}


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
    p.add_argument("--engine", choices=["hf", "fast"], default="hf",
                   help="decode loop of the greedy replies: hf (transformers) or fast (static KV, CUDA graph)")
    p.add_argument("--weights-quant", choices=["none", "int8", "int4"], default="none",
                   help="quantize the model's weights first (optimum-quanto; engine hf): does the stack still answer?")
    p.add_argument("--prefill-chunk", nargs="+", type=chunk_arg, default=[None], metavar="N|none",
                   help="prefill chunk sizes in tokens, each run for every method (none: one shot)")
    p.add_argument("-o", "--out", required=True, help="output folder (records.jsonl, manifest.json, summary)")
    p.set_defaults(func=run)


def chunk_arg(text: str) -> int | None:
    """``none``/``null`` (a one-shot prefill) or a token count (checked by the policies)."""
    return None if text.lower() in ("none", "null") else int(text)


def policies_from_args(args, spec=None) -> list:
    """Expand --methods x --keep/--bits the way sweeps do, then build the policies (validated, and
    checked against the model's spec when given)."""
    from kvlab.policies import make_policy
    from kvlab.policies.base import check_prefill_chunk
    from kvlab.sweep.params import SweepParams, method_variants

    for chunk in getattr(args, "prefill_chunk", None) or ():
        check_prefill_chunk(chunk)  # one clear line before SweepParams' own validation
    params = SweepParams(models=[args.model], methods=args.methods, keep=args.keep, bits=args.bits,
                         ctx=args.lengths, prefill_chunk=getattr(args, "prefill_chunk", None))
    policies = [make_policy(v.method, **v.kwargs) for _, v in method_variants(params)]
    for policy in policies if spec is not None else ():
        policy.check(spec)
    return policies


def task_spec_from_args(args):
    from pydantic import ValidationError

    from kvlab.errors import UserError
    from kvlab.quality import TaskSpec

    try:
        return TaskSpec(tasks=args.tasks, lengths=args.lengths, depths=args.depths, samples=args.samples,
                        seed=args.seed, query_aware=args.query_aware, no_signal_threshold=args.threshold,
                        max_new_tokens=args.max_new_tokens, longbench=args.longbench,
                        longbench_datasets=args.longbench_datasets, text_files=args.text,
                        continuation_tokens=args.continuation_tokens)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            field = str(e["loc"][0]) if e["loc"] else ""
            flag = FLAGS.get(field, "--" + field.replace("_", "-")) if field else "quality"
            lines.append(f"{flag}: {e['msg'].removeprefix('Value error, ')}")
        raise UserError("; ".join(dict.fromkeys(lines))) from None


def check_args(args):
    """Every check that needs no weights: tasks, policies, device, lengths, memory, output folder."""
    from pathlib import Path

    from kvlab.errors import UserError
    from kvlab.models import get_spec
    from kvlab.preflight import check_out_dir, device_problem, require, shape_problems, weights_problem
    from kvlab.records import read_manifest
    from kvlab.sweep.params import DTYPES
    from kvlab.weights_quant import weights_quant_problems

    spec = task_spec_from_args(args)
    if args.weights == "synthetic":
        raise UserError("--weights synthetic comes without a tokenizer, and the quality pass reads and scores "
                        "text: use a model with real weights (smollm2-135m, or a local folder with a tokenizer)")
    model_spec = get_spec(args.model)
    policies = policies_from_args(args, model_spec)
    if args.engine == "fast":
        from kvlab.engine.llama import check_model_type

        check_model_type(model_spec.model_type)
        for policy in policies:
            policy.fast_storage()
    require(device_problem(args.device), weights_problem(args.model, args.weights))
    require(*weights_quant_problems([args.weights_quant], [args.engine]))
    done = read_manifest(args.out) if Path(args.out).is_dir() else None
    if done and done.get("weights_quant", "none") != args.weights_quant:  # record ids do not hold it
        raise UserError(f"-o {args.out} holds records with --weights-quant {done.get('weights_quant', 'none')}; "
                        f"write --weights-quant {args.weights_quant} to another folder")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise UserError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}")
    require(*shape_problems(model_spec, args.device, args.dtype, max(spec.lengths), 1, spec.max_new_tokens or 1,
                            ctx_key="--lengths", new_key="--max-new-tokens"))  # the full-cache reference always runs
    return spec, policies, check_out_dir(args.out)


def run(args) -> int:
    from kvlab.cli import EXIT_FAILED_RUNS, EXIT_OK
    from kvlab.models import load_model
    from kvlab.quality import quality_notes, run_quality, summarize
    from kvlab.records import RECORDS_FILE, RecordWriter, load_records, recorded_run_ids, write_manifest
    from kvlab.weights_quant import quantize_weights

    spec, policies, out = check_args(args)  # before the model loads
    loaded = load_model(args.model, weights=args.weights, device=args.device, dtype=args.dtype, seed=args.seed)
    quantize_weights(loaded.model, args.weights_quant)
    manifest = {"kind": "quality", "model": loaded.provenance(), "weights_quant": args.weights_quant,
                "task_spec": spec.model_dump(),
                "methods": [p.params() for p in policies], "status": "incomplete"}
    write_manifest(out, manifest)
    skip = recorded_run_ids(out, statuses={"ok"})  # a rerun resumes: items recorded ok are not rerun
    engine = None
    if args.engine == "fast":
        from kvlab.engine.fast import FastEngine

        engine = FastEngine(loaded)
    with RecordWriter(out / RECORDS_FILE) as writer:
        records = run_quality(loaded, policies, spec, writer, base={"sweep": out.name, "weights_quant": args.weights_quant},
                              skip=skip,
                              engine=engine, progress_bar=True)
    failed = [r for r in records if r["status"] != "ok"]
    write_manifest(out, {**manifest, "status": "failed_runs" if failed else "complete"})
    summary = summarize(load_records(out, kind="quality"))
    if not summary.empty:
        summary.to_csv(out / "quality_summary.csv", index=False)
        cols = [c for c in ("task", "length", "label", "n", "no_signal", "score", "score_diff", "gold_nll",
                            "kl", "top1_agree") if c in summary.columns]
        print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for note in quality_notes(records):
        print(f"note: {note}")
    for r in failed[:5]:
        print(f"failed: {r['label']} {r['task']} L={r['length']}: {r['error']}", file=sys.stderr)
    print(f"{len(records)} new quality records ({len(failed)} failed; items already recorded ok were skipped) "
          f"in {out / RECORDS_FILE}")
    return EXIT_FAILED_RUNS if failed else EXIT_OK
