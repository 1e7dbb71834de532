"""`kvlab sweep PARAMS.yaml [-o DIR] [--set key=value ...] [--executor {local,process,ray}]`: run or resume a sweep.

Exit status: 0 when every planned run is recorded ok; 3 when every run is recorded but some failed
(their errors are in records.jsonl; fix the cause and rerun to retry them); 4 when a run or time
budget stopped it early (rerun the same command to continue); 2 for invalid params, an unusable
output folder (also one that fills up or hits ``ulimit -f`` mid-sweep) or a folder locked by
another sweep; 130 after Ctrl-C and 143 after SIGTERM (records kept, manifest incomplete). The manifest's status says the same:
complete, failed_runs or incomplete.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvlab.cli import EXIT_USAGE, STATUS_EXIT
from kvlab.preflight import check_out_dir, print_warnings
from kvlab.sweep.checks import outlier_keys_lines, params_notes
from kvlab.sweep.lock import SweepLocked
from kvlab.sweep.params import EXECUTORS, load_params, method_variants
from kvlab.sweep.plan import count_by, planned_runs


def register(sub) -> None:
    p = sub.add_parser("sweep", help="run (or resume) a measurement sweep from a params YAML",
                       description=__doc__.splitlines()[0])
    p.add_argument("params", help="params YAML, e.g. params/smoke.yaml")
    p.add_argument("-o", "--out", default=None, help="sweep folder (default: outputs/<params name>)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a params key (value parsed as YAML), e.g. --set ctx=16384; repeatable")
    p.add_argument("--executor", choices=tuple(EXECUTORS), default=None,
                   help="where runs execute (params key `executor`): local (this process, the default), "
                        "process (a child process per group: a crash costs the run in flight), ray (a Ray task per GPU)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="Ray cluster to join with --executor ray, e.g. auto or ray://head:10001 "
                        "(default: RAY_ADDRESS, else a local cluster)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan; load nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def print_notes(params, join: bool = True) -> None:
    """The plan's notes and the outlier-key warnings (``join=False``: a dry run joins no split preset)."""
    for note in params_notes(params):
        print(f"kvlab sweep: note: {note}", file=sys.stderr)
    for model, lines in outlier_keys_lines(params, join).items():
        print_warnings("kvlab sweep", lines, where=f"models {model}")


def run(args) -> int:
    sets = list(args.sets)
    if args.executor:
        sets.append(f"executor={args.executor}")
    if args.ray_address:
        sets.append(f"ray_address={json.dumps(args.ray_address)}")  # quoted: an address is a string
    params = load_params(args.params, sets)
    out = Path(args.out) if args.out else Path("outputs") / (params.name or Path(args.params).stem)
    flag = "-o" if args.out else "the default output folder"
    if args.dry_run:
        check_out_dir(out, flag, create=False)
        todo = planned_runs(params, out if out.is_dir() else None, check_device=False)
        print_notes(params, join=False)
        if not params.perf:
            quality = params.quality or {}
            print(f"{out}: 0 runs to do (perf: false); the quality pass runs {len(method_variants(params))} "
                  f"method variant(s) on {', '.join(params.models)}: {quality.get('tasks', 'default tasks')} at "
                  f"lengths {quality.get('lengths', 'default')}")
            return 0
        print(f"{out}: {len(todo)} runs to do ({params.warmup_runs} warm-up(s) per method and shape; "
              f"executor {params.executor})")
        for attr in ("model", "method", "ctx", "batch") + (("weights_quant",) if len(params.weights_quant) > 1 else ()):
            print(f"  by {attr}: {count_by(todo, attr)}")
        if params.budget_gb is not None:
            print(f"  then each method at the batch budget_gb: {params.budget_gb} admits (from these runs' peaks)")
        return 0
    planned_runs(params, check_device=True)  # every check (device, memory, policies) before the folder is made
    check_out_dir(out, flag)
    print_notes(params)
    from kvlab.sweep.admission import run_budgeted  # torch and the measured group: only once params are valid
    from kvlab.sweep.driver import run_sweep

    try:
        if params.quality is not None and set(params.weights_quant) != {"none"}:
            print("kvlab sweep: note: the quality pass runs the models' own weights; for quantized weights run "
                  "kvlab quality --weights-quant int8|int4 -o ANOTHER_FOLDER", file=sys.stderr)
        if params.budget_gb is not None:  # probes, then each method at its admitted batch
            summary = run_budgeted(params, out, progress=not args.no_progress)
        else:
            summary = run_sweep(params, out, progress=not args.no_progress)
    except SweepLocked as err:
        print(f"kvlab sweep: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(summary.line())
    if summary.failed or summary.failed_recorded:
        print(f"  failed runs keep their error in {out / 'records.jsonl'} (tracebacks in {out / 'errors.log'})")
    return STATUS_EXIT[summary.status]
