"""`kvlab quality`'s work: policies from the flags, checks before the load, the pass, its summary."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import ValidationError

from kvlab import models
from kvlab.cli import EXIT_FAILED_RUNS, EXIT_OK
from kvlab.cli.generate_run import param_overrides
from kvlab.engine import check_model_type
from kvlab.engine.engines import make_engine
from kvlab.errors import UserError
from kvlab.policies import POLICIES, make_policy
from kvlab.policies.base import check_prefill_chunk
from kvlab.preflight import (
    check_out_dir,
    device_problem,
    outlier_keys_warnings,
    print_warnings,
    require,
    shape_problems,
    weights_problem,
)
from kvlab.quality.notes import quality_notes, summarize
from kvlab.quality.run import run_quality
from kvlab.quality.spec import items_problem
from kvlab.records import (
    RECORDS_FILE,
    RecordWriter,
    load_records,
    read_manifest,
    recorded_run_ids,
    write_manifest,
)
from kvlab.sweep.params import DTYPES, SweepParams, method_variants, pydantic_lines
from kvlab.weights_quant import quantize_weights, weights_quant_problems


def method_entries(methods: list, params: dict) -> list:
    """``--methods`` (names or sweep entries) with each ``--param`` added to every method whose policy
    takes it (read from the registry); a parameter no listed method takes is an error."""
    axis = {"keep": "--keep", "nbits": "--bits", "bits": "--bits"}
    for key in params:
        if key in axis:
            raise UserError(f"--param {key}: give {key} with {axis[key]} (every method on that axis gets each value)")
    entries, used = [], set()
    for method in methods:
        entry = dict(method) if isinstance(method, dict) else {"method": method}
        cls = POLICIES.get(entry["method"])  # an unknown method: make_policy names it
        takes = {row["name"] for row in cls.describe()} - {"prefill_chunk"} if cls else set()
        for key in sorted(set(params) & takes - set(entry)):
            entry[key] = params[key]
            used.add(key)
        entries.append(entry)
    unused = sorted(set(params) - used)
    if unused:
        names = [m["method"] if isinstance(m, dict) else m for m in methods]
        raise UserError(f"--param {', '.join(unused)}: none of --methods {' '.join(names)} takes it "
                        f"(`kvlab policies` lists each method's parameters)")
    return entries


def policies_from_args(args, spec=None) -> list:
    """Expand --methods x --keep/--bits the way sweeps do, then build the policies (validated, and
    checked against the model's spec when given)."""
    for chunk in getattr(args, "prefill_chunk", None) or ():
        check_prefill_chunk(chunk)  # one clear line before SweepParams' own validation
    methods = method_entries(args.methods, param_overrides(getattr(args, "param", None) or []))
    try:
        params = SweepParams(models=[args.model], methods=methods, keep=args.keep, bits=args.bits,
                             ctx=args.lengths, prefill_chunk=getattr(args, "prefill_chunk", None))
    except ValidationError as err:
        raise UserError("; ".join(pydantic_lines(err, prefix="--methods: "))) from None
    policies = [make_policy(v.method, **v.kwargs) for _, v in method_variants(params)]
    for policy in policies if spec is not None else ():
        policy.check(spec)
    return policies


def check_args(args, spec):
    """Every check that needs no weights: tasks, policies, device, lengths, memory, output folder."""
    if args.weights == "synthetic":
        raise UserError("--weights synthetic comes without a tokenizer, and the quality pass reads and scores "
                        "text: use a model with real weights (smollm2-135m, or a local folder with a tokenizer)")
    model_spec = models.get_spec(args.model)
    policies = policies_from_args(args, model_spec)
    if args.engine == "fast":
        check_model_type(model_spec.model_type)
        for policy in policies:
            policy.storage()
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


def quality(args, spec) -> int:
    """``kvlab quality``: checks before the load, then the pass, its summary and notes."""
    spec, policies, out = check_args(args, spec)  # before the model loads
    print_warnings("kvlab quality", outlier_keys_warnings(args.model, args.weights, policies))
    require(items_problem(spec, models.load_tokenizer(args.model), args.model))  # the tokenizer alone
    loaded = models.load_model(args.model, weights=args.weights, device=args.device, dtype=args.dtype, seed=args.seed)
    quantize_weights(loaded.model, args.weights_quant)
    manifest = {"kind": "quality", "model": loaded.provenance(), "weights_quant": args.weights_quant,
                "task_spec": spec.model_dump(),
                "methods": [p.params() for p in policies], "status": "incomplete"}
    write_manifest(out, manifest)
    skip = recorded_run_ids(out, statuses={"ok"})  # a rerun resumes: items recorded ok are not rerun
    engine = make_engine(args.engine, loaded)
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
