"""Where a serving engine's decode step spends its CPU time: ``--requests`` prompts admitted and
decoding, then torch's profiler over ``--steps`` engine steps (warm-up and the first steps left out).
Prints ms/step with and without the profiler and the ops by self CPU time.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/serve_step_profile.py --requests 3 --steps 10

(torch is imported here before kvlab, so OpenMP's wait policy is the environment's: PASSIVE is what
`kvlab serve` runs with, benchmarks/engine_thread.py shows why it matters on a shared CPU.)
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvlab.models import load_model
from kvlab.serve.engine import Request, make_serving_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="full")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    loaded = load_model(args.model)
    engine = make_serving_engine(loaded, args.method, pool_gb=1.0)
    engine.warm_up()
    for i in range(args.requests):
        engine.add(Request(f"r{i}", [100 + i + j for j in range(args.input_tokens)], 4 * args.steps, time.perf_counter()))
    for _ in range(5):  # the prompts' prefill and the first decode steps
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    plain = (time.perf_counter() - start) / args.steps * 1e3
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    profiled = (time.perf_counter() - start) / args.steps * 1e3
    print(f"{args.model} {args.method}, {args.requests} requests decoding, {torch.get_num_threads()} torch threads, "
          f"{next(loaded.model.parameters()).dtype}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}: {plain:.1f} ms/step, {profiled:.1f} ms/step profiled")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
