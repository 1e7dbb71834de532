"""The serving sweep: a params file with a ``traffic:`` block, every method at every rate.

    python benchmarks/serve_rates.py params/serve-cpu.yaml -o out/serve-cpu
    python benchmarks/serve_rates.py params/h100-serve-sharegpt.yaml -o $OUT/serve-sharegpt
    python benchmarks/serve_rates.py params/serve-cpu.yaml --set traffic.target=http://127.0.0.1:8000 -o out/t

With ``traffic.target`` set, the traffic goes to that running server through kvlab's load
generator (kvlab.loadgen.sweep) instead of an in-process engine.

Per run: a folder with ``run.json`` (status, metrics), ``requests.jsonl`` (one record per finished
request), ``timeline.jsonl`` (running, waiting, blocks used per step); one row per run in
``serve_runs.jsonl``. Printed at the end: per method and rate, the medians over repeats of p99
TTFT, p99 TPOT, output tokens/s, goodput and peak running requests, with n; beside each method its
predicted peak concurrency (pool blocks / blocks a mean request holds), so the two read side by side,
and the share of step time outside the model's forward (scheduling, block bookkeeping, eviction);
then each method's crossover against the full cache (energy per request) with its interval.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict

from kvlab.errors import UserError
from kvlab.serve.sweep import run_serving_sweep
from kvlab.sweep.params import load_params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("params")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE overrides, as kvlab sweep")
    args = ap.parse_args(argv)
    try:
        params = load_params(args.params, args.set)
        if params.traffic is None:
            raise UserError(f"{args.params}: no traffic: block; add one (kvlab.serve.traffic)")
        if params.traffic.target:  # a running server: kvlab's load generator sends the traffic there
            from kvlab.loadgen.sweep import run_target_sweep

            rows = run_target_sweep(params, args.out)
        else:
            rows = run_serving_sweep(params, args.out)
    except UserError as err:
        print(f"serve_rates: error: {err}", file=sys.stderr)
        return 2
    table = defaultdict(list)
    for r in rows:
        if r["status"] == "complete":
            table[(r["method"], r["params"], r["rate"])].append(r)
    print("method params rate n p99_ttft_s p99_tpot_s out_tok_s goodput peak_running predicted_peak bookkeeping")
    for (method, knobs, rate), runs in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        cols = ("ttft_p99_s", "tpot_p99_s", "output_throughput", "goodput", "peak_running", "predicted_peak",
                "bookkeeping_share")
        print(method, knobs, rate, len(runs), *(median(runs, key) for key in cols))
    if not params.traffic.target:
        print_crossovers(args.out)
    failed = [r for r in rows if r["status"] == "failed"]
    for r in failed:
        print(f"FAILED {r['run']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


def print_crossovers(out) -> None:
    """Per method, the rate from which its energy per request stays at or below the full cache's, with
    the interval of :func:`kvlab.serve.figures.crossover_interval` (>= 3 repeats a side; else n)."""
    from kvlab.serve.figures import crossover_interval, load_sweep

    df = load_sweep(out)
    if df.empty or "energy_per_request" not in df:
        return
    for label, c in crossover_interval(df).items():
        bounds = (f"may pay from {c['lo']}, pays at 95% from {c['hi']} (welch-log, n={c['n']})"
                  if c["method"] != "none" else f"n={c['n']}, no interval")
        print(f"crossover {label.strip()}: energy/request <= full's from rate {c['rate']}; {bounds}")


def median(runs: list[dict], key: str) -> str:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return f"{statistics.median(vals):.4g}" if vals else "-"


if __name__ == "__main__":
    sys.exit(main())
