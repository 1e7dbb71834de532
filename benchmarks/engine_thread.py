"""Which thread steps the serving engine, and with how many torch threads: the same requests stepped
in the process's main thread and in a thread of its own (as `kvlab serve` steps its engine), with
torch's default intra-op threads and with one, alternated (main, worker, main-1, worker-1, ...).
On a CPU shared with other processes this decides ms/step more than HTTP does, so an in-process
against HTTP comparison steps both engines the same way (benchmarks/serve_http_overhead.py).

Prints ms/step per variant and repeat, then each variant's mean over the main thread's (default
threads) with a 95% interval from >= 3 repeats; rows (naming the card and OpenMP's wait policy) go
to --out as JSON. torch is imported here before kvlab, so libgomp's wait policy is the environment's
(kvlab sets OMP_WAIT_POLICY=PASSIVE only when it is imported first): run it with and without
OMP_WAIT_POLICY=PASSIVE to see both.

    python benchmarks/engine_thread.py --repeats 3 --out outputs/engine-thread-default.json
    OMP_WAIT_POLICY=PASSIVE python benchmarks/engine_thread.py --repeats 3 --out outputs/engine-thread-passive.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from serve_http_overhead import in_worker_thread  # benchmarks/ is the script's folder

from kvlab.card import device_card
from kvlab.intervals import mean_interval
from kvlab.models import load_model
from kvlab.serve.engine import Request, make_serving_engine


def ms_per_step(loaded, method: str, requests: int, input_tokens: int, output_tokens: int) -> float:
    engine = make_serving_engine(loaded, method, pool_gb=0.5)
    engine.warm_up()
    for i in range(requests):
        engine.add(Request(f"r{i}", [100 + (i + j) % 1000 for j in range(input_tokens)], output_tokens,
                           time.perf_counter()))
    start, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="full")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="outputs/engine-thread.json")
    args = ap.parse_args()
    loaded = load_model(args.model)
    default_threads = torch.get_num_threads()
    shape = (loaded, args.method, args.requests, args.input_tokens, args.output_tokens)
    rows = []
    for repeat in range(args.repeats):
        for threads in (default_threads, 1):
            torch.set_num_threads(threads)
            for where in ("main", "worker"):
                ms = ms_per_step(*shape) if where == "main" else in_worker_thread(ms_per_step, *shape)
                rows.append({"repeat": repeat, "thread": where, "torch_threads": threads, "ms_per_step": ms,
                             "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                             **device_card(loaded.device)})
                print(json.dumps(rows[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": vars(args), "rows": rows}, indent=1))
    base = {r["repeat"]: r["ms_per_step"] for r in rows if r["thread"] == "main" and r["torch_threads"] == default_threads}
    for threads in (default_threads, 1):
        for where in ("main", "worker"):
            ratios = [r["ms_per_step"] / base[r["repeat"]] for r in rows
                      if r["thread"] == where and r["torch_threads"] == threads]
            m = mean_interval(ratios)
            bounds = f" [{m.lo:.2f}, {m.hi:.2f}]" if m.has_bounds else " (no interval)"
            print(f"{where} thread, {threads} torch thread(s): ms/step over main's with {default_threads}: "
                  f"{m.value:.2f}{bounds} ({m.n_text()})")


if __name__ == "__main__":
    main()
