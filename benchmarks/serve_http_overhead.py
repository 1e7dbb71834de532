"""In-process serving against the same engine behind `kvlab serve`: same model, method, pool and
workload; the in-process run drives the engine directly (kvlab.serve.run.run_workload), the HTTP
run sends the same token ids through kvlab's load generator to a `kvlab serve` process. Goal:
output throughput within 5%; the TTFT overhead of HTTP in ms; on a GPU, J/request of both sides
(NVML over each run's steady window).

Per method one server; per repeat and rate the two sides alternate (in-process, HTTP, in-process,
HTTP, ...), a fresh engine per in-process run, warmed up as `kvlab serve` warms its own at startup
and stepped, as there, in a thread of its own (`--inprocess-thread main` steps it in the main
thread: on a CPU shared with other processes that alone changes ms/step, benchmarks/engine_thread.py).
Prints each run, then per method and rate the HTTP/in-process throughput ratio and the TTFT p50
difference (with a 95% interval from >= 3 pairs, else n and no interval). Rows, each naming its
card, go to OUT/summary.json; each run's folder (run.json, requests.jsonl) beside it.

    python benchmarks/serve_http_overhead.py --requests 16 --rate 1 --repeats 3
    python benchmarks/serve_http_overhead.py --model llama-3.1-8b --weights synthetic --device cuda \\
        --methods full kvq-int4 --rate 4 16 64 --pool-gb 20 --input-tokens 512 --output-tokens 128
"""

from __future__ import annotations

import argparse
import json
import threading
from collections import defaultdict
from pathlib import Path

from kvlab.card import device_card
from kvlab.intervals import mean_interval
from kvlab.loadgen.external import kvlab_server
from kvlab.loadgen.run import pick_counter, run_load
from kvlab.loadgen.trace import items_from_workload
from kvlab.models import load_model
from kvlab.serve.engine import make_serving_engine
from kvlab.serve.run import run_workload
from kvlab.serve.traffic import parse_traffic
from kvlab.serve.workload import build_workload

KEYS = ("completed", "output_throughput", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "energy_per_request")


def interval(values: list[float]) -> str:
    """The values, then their mean with a 95% t-interval (:mod:`kvlab.intervals`; none below 3)."""
    text = ", ".join(f"{v:.3g}" for v in values)
    mean = mean_interval(values)
    if not mean.has_bounds:
        return f"{text} ({mean.n_text()}, no interval)"
    return f"{text}; mean {mean.value:.3g}, 95% t-interval [{mean.lo:.3g}, {mean.hi:.3g}] ({mean.n_text()})"


def in_worker_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run in a thread of its own, as kvlab serve's bridge steps its engine."""
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("v", fn(*args, **kwargs)), name="engine")
    worker.start()
    worker.join()
    return box["v"]


def in_main_thread(fn, *args, **kwargs):
    return fn(*args, **kwargs)


DRIVERS = {"worker": in_worker_thread, "main": in_main_thread}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", choices=["real", "synthetic"], default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--methods", nargs="+", default=["full"])
    ap.add_argument("--pool-gb", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rate", type=float, nargs="+", default=[1.0])
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--inprocess-thread", choices=sorted(DRIVERS), default="worker")
    ap.add_argument("--out", default="outputs/serve-http-overhead")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model, weights=args.weights, device=args.device)
    card = device_card(loaded.device)
    gpu = args.device if args.device.startswith("cuda") else None
    serve_flags = ["--model", args.model, "--device", args.device, "--pool-gb", str(args.pool_gb),
                   *(["--weights", args.weights] if args.weights else [])]
    rows = []
    for method in args.methods:
        server = kvlab_server(*serve_flags, "--method", method, log_path=out / f"server-{method}.log")
        with server as url:
            for repeat in range(args.repeats):
                for rate in args.rate:
                    spec = parse_traffic({"arrival": "poisson", "rate": rate, "requests": args.requests, "seed": repeat,
                                          "lengths": {"kind": "fixed", "input": args.input_tokens,
                                                      "output": args.output_tokens}})
                    workload = build_workload(spec, rate, loaded.tokenizer, loaded.spec.vocab_size)
                    tag = f"{method}-rate{rate:g}-rep{repeat}"
                    engine = make_serving_engine(loaded, method, pool_gb=args.pool_gb, device=args.device)
                    engine.warm_up()  # as kvlab serve warms its engine at startup
                    local = DRIVERS[args.inprocess_thread](run_workload, engine, workload, out / f"inprocess-{tag}")["metrics"]
                    del engine
                    http = run_load(url, items_from_workload(workload), out / f"http-{tag}",
                                    counter=pick_counter(server.pid, gpu)).metrics
                    for side, m in (("inprocess", local), ("http", http)):
                        row = {"side": side, "inprocess_thread": args.inprocess_thread, "method": method, "rate": rate, "repeat": repeat, **card,
                               **{k: m.get(k) for k in KEYS}}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    pairs = defaultdict(list)
    for local, http in zip(rows[0::2], rows[1::2], strict=True):
        pairs[(local["method"], local["rate"])].append((local, http))
    print(f"\nHTTP vs in-process, same workload ({args.requests} requests, {args.input_tokens} in, "
          f"{args.output_tokens} out; card {card.get('gpu_uuid') or card.get('device_name', 'cpu')}):")
    for (method, rate), ps in pairs.items():
        print(f"{method} at {rate:g}/s")
        print("  output throughput HTTP/in-process:", interval([h["output_throughput"] / i["output_throughput"]
                                                               for i, h in ps]))
        print("  TTFT p50 HTTP - in-process (ms):", interval([(h["ttft_p50_s"] - i["ttft_p50_s"]) * 1e3 for i, h in ps]))
        if all(i["energy_per_request"] and h["energy_per_request"] for i, h in ps):
            print("  energy/request HTTP/in-process:", interval([h["energy_per_request"] / i["energy_per_request"] for i, h in ps]))


if __name__ == "__main__":
    main()
