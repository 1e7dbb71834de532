"""What KVzap adds to a prefill: one prompt's prefill with ``full``, ``knorm`` (top-k eviction, no scorer)
and ``kvzap`` (top-k eviction of the surrogate's scores), alternated, and the surrogate's own time.

    python benchmarks/kvzap_cost.py --ctx 1024 4096 --repeats 3 --json-out reports/cpu-kvzap-2026-12-07/cost.json

KVzap evicts at the prefill only, so its decode step is an evicted cache's (the anatomy's decode step of
any eviction method at that keep); its cost is in the prefill: the surrogate (``n x hidden x Hkv``
multiply-adds per layer) and the top-k gather every eviction pays (``knorm`` beside it). The surrogate's
time is summed over its calls (``Surrogate.scores``). The surrogate's values do not change its cost:
``surrogate`` defaults to the packaged one when the model has one, else 'random'.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvlab.card import device_card
from kvlab.engine.generation import prefill
from kvlab.intervals import ratio_interval
from kvlab.measure import make_prompt
from kvlab.models import load_model
from kvlab.policies import PolicyError, make_policy
from kvlab.policies.kvzap import Surrogate


def timed_surrogate(out: list):
    original = Surrogate.scores

    def scores(self, hidden, layer_idx):
        t0 = time.perf_counter()
        try:
            return original(self, hidden, layer_idx)
        finally:
            out[-1] += time.perf_counter() - t0

    return original, scores


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, weights=args.weights)
    try:
        make_policy("kvzap").check(loaded.model)
        surrogate = "auto"
    except PolicyError:
        surrogate = "random"
    policies = {"full": make_policy("full"), "knorm": make_policy("knorm", keep=args.keep),
                "kvzap": make_policy("kvzap", keep=args.keep, surrogate=surrogate)}
    surrogate_s: list[float] = []
    original, patched = timed_surrogate(surrogate_s)
    Surrogate.scores = patched
    rows = []
    try:
        for ctx in args.ctx:
            ids = make_prompt(loaded, ctx, 1, seed=0)
            times: dict[str, list[float]] = {name: [] for name in policies}
            zap: list[float] = []
            for rep in range(args.repeats + 1):  # the first round warms up, untimed
                for name, policy in policies.items():  # ABC ABC ...: alternated
                    with torch.no_grad(), policy.attach(loaded, warm=False):
                        cache = policy.make_cache(loaded.model)
                        surrogate_s.append(0.0)
                        t0 = time.perf_counter()
                        prefill(loaded.model, ids, cache)
                        seconds = time.perf_counter() - t0
                    if rep:
                        times[name].append(seconds)
                        if name == "kvzap":
                            zap.append(surrogate_s[-1])
            row = {"ctx": ctx, "keep": args.keep, "prefill_s": times, "surrogate_s": zap,
                   "kvzap_over_full": ratio_interval(times["kvzap"], times["full"]).to_dict(),
                   "kvzap_over_knorm": ratio_interval(times["kvzap"], times["knorm"]).to_dict(),
                   "surrogate_over_full": ratio_interval(zap, times["full"]).to_dict()}
            rows.append(row)
            print(f"ctx {ctx}: kvzap / full prefill {ratio_interval(times['kvzap'], times['full']).text()}; "
                  f"kvzap / knorm {ratio_interval(times['kvzap'], times['knorm']).text()}; surrogate / full prefill "
                  f"{ratio_interval(zap, times['full']).text(4)}", flush=True)
    finally:
        Surrogate.scores = original
    if args.json_out:
        out = {"model": args.model, "weights": loaded.weights, "surrogate": surrogate, "threads": args.threads,
               "card": device_card(torch.device("cpu")), "command": "python benchmarks/kvzap_cost.py " + " ".join(sys.argv[1:]),
               "rows": rows}
        with open(args.json_out, "w") as f:
            f.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
