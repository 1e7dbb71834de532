"""In-process serving against the same engine behind `kvlab serve`: same model, method, pool and
workload; the in-process run drives the engine directly (kvlab.serve.run.run_workload), the HTTP
run sends the same token ids through kvlab's load generator to a `kvlab serve` process. Goal:
output throughput within 5%; the TTFT overhead of HTTP in ms.

Runs alternate (in-process, HTTP, in-process, HTTP, ...), a fresh engine per in-process run.
Prints each run, then HTTP/in-process throughput ratios and TTFT p50 differences (with a 95%
interval from >= 3 pairs).

    python benchmarks/serve_http_overhead.py --requests 16 --rate 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvlab.card import device_card
from kvlab.intervals import mean_interval
from kvlab.loadgen.external import kvlab_server
from kvlab.loadgen.run import run_load
from kvlab.loadgen.trace import items_from_workload
from kvlab.models import load_model
from kvlab.serve.engine import make_serving_engine
from kvlab.serve.run import run_workload
from kvlab.serve.traffic import parse_traffic
from kvlab.serve.workload import build_workload


def interval(values: list[float]) -> str:
    """The values, then their mean with a 95% t-interval (:mod:`kvlab.intervals`; none below 3)."""
    text = ", ".join(f"{v:.3g}" for v in values)
    mean = mean_interval(values)
    if not mean.has_bounds:
        return f"{text} ({mean.n_text()}, no interval)"
    return f"{text}; mean {mean.value:.3g}, 95% t-interval [{mean.lo:.3g}, {mean.hi:.3g}] ({mean.n_text()})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="full")
    ap.add_argument("--pool-gb", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="outputs/serve-http-overhead")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model)
    spec = parse_traffic({"arrival": "poisson", "rate": args.rate, "requests": args.requests, "seed": 0,
                          "lengths": {"kind": "fixed", "input": args.input_tokens, "output": args.output_tokens}})
    workload = build_workload(spec, args.rate, loaded.tokenizer, loaded.spec.vocab_size)
    items = items_from_workload(workload)
    rows = []
    with kvlab_server("--model", args.model, "--method", args.method, "--pool-gb", str(args.pool_gb),
                      log_path=out / "server.log") as url:
        for repeat in range(args.repeats):
            engine = make_serving_engine(loaded, args.method, pool_gb=args.pool_gb)
            engine.warm_up()  # as kvlab serve warms its engine at startup
            local = run_workload(engine, workload, out / f"inprocess-{repeat}")["metrics"]
            http = run_load(url, items, out / f"http-{repeat}").metrics
            for name, m in (("inprocess", local), ("http", http)):
                row = {"side": name, "repeat": repeat, "completed": m["completed"], **device_card(loaded.device),
                       **{k: m[k] for k in ("output_throughput", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s")}}
                rows.append(row)
                print(json.dumps(row))
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    pairs = list(zip(rows[0::2], rows[1::2], strict=True))
    print(f"\nHTTP vs in-process, same workload ({args.requests} requests, {args.rate}/s, {args.input_tokens} in, "
          f"{args.output_tokens} out, {args.method}):")
    print("  output throughput HTTP/in-process:", interval([h["output_throughput"] / i["output_throughput"]
                                                           for i, h in pairs]))
    print("  TTFT p50 HTTP - in-process (ms):", interval([(h["ttft_p50_s"] - i["ttft_p50_s"]) * 1e3 for i, h in pairs]))
    print("  TPOT p50 HTTP/in-process:", interval([h["tpot_p50_s"] / i["tpot_p50_s"] for i, h in pairs]))


if __name__ == "__main__":
    main()
