"""`kvlab sweep PARAMS.yaml [-o DIR] [--set key=value ...] [--executor {local,process,ray}]`: run or resume a sweep.

Exit status: 0 when every run is recorded, 3 when a run budget stopped it early (rerun the same
command to continue), 2 for invalid params or a folder locked by another sweep.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXIT_INCOMPLETE = 3


def register(sub) -> None:
    p = sub.add_parser("sweep", help="run (or resume) a measurement sweep from a params YAML",
                       description=__doc__.splitlines()[0])
    p.add_argument("params", help="params YAML, e.g. params/smoke.yaml")
    p.add_argument("-o", "--out", default=None, help="sweep folder (default: outputs/<params name>)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a params key (value parsed as YAML), e.g. --set ctx=16384; repeatable")
    p.add_argument("--executor", choices=("local", "process", "ray"), default=None,
                   help="where runs execute (params key `executor`): local (this process, the default), "
                        "process (a child process per group: a crash costs one run), ray (a Ray task per GPU)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="Ray cluster to join with --executor ray, e.g. auto or ray://head:10001 "
                        "(default: RAY_ADDRESS, else a local cluster)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan; load nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvlab.params import load_params
    from kvlab.sweep import SweepLocked, count_by, plan, run_sweep

    sets = list(args.sets)
    if args.executor:
        sets.append(f"executor={args.executor}")
    if args.ray_address:
        sets.append(f"ray_address={json.dumps(args.ray_address)}")  # quoted: an address is a string
    params = load_params(args.params, sets)
    out = Path(args.out) if args.out else Path("outputs") / (params.name or Path(args.params).stem)
    if args.dry_run:
        todo = plan(params, out if out.exists() else None, check_device=False)
        print(f"{out}: {len(todo)} runs to do ({params.warmup_runs} warm-up(s) per method and shape; "
              f"executor {params.executor})")
        for attr in ("model", "method", "ctx", "batch"):
            print(f"  by {attr}: {count_by(todo, attr)}")
        return 0
    try:
        summary = run_sweep(params, out, progress=not args.no_progress)
    except SweepLocked as err:
        print(f"kvlab sweep: error: {err}", file=sys.stderr)
        return 2
    print(summary.line())
    if summary.failed:
        print(f"  failed runs keep their error in {out / 'records.jsonl'} (tracebacks in {out / 'errors.log'})")
    return 0 if summary.complete else EXIT_INCOMPLETE
