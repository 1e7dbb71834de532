"""Time the cells a quality report is made of, to estimate a whole params file's CPU cost before
launching it: the model load, one needle item under the full cache alone, the same item with one
compressed method beside it (the increment is one method's run), and one continuation window.

    python scripts/time_quality_cell.py --model qwen2.5-coder-1.5b --length 1024 --method kvq-int4

Prints wall and process CPU seconds (all threads) per step, then one JSON line. CPU seconds are the
figure to scale by when the machine is shared: wall time then depends on the other jobs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvlab.models import load_model
from kvlab.policies import make_policy
from kvlab.quality import TaskSpec
from kvlab.quality.run import run_quality


def timed(out: dict, name: str, loaded, policies, spec: TaskSpec) -> None:
    wall, cpu = time.monotonic(), time.process_time()
    records = run_quality(loaded, policies, spec)
    out[name] = {"wall_s": round(time.monotonic() - wall, 1), "cpu_s": round(time.process_time() - cpu, 1),
                 "records": [(r["label"], r.get("score"), r.get("kl"), r.get("prediction")) for r in records]}
    print(name, out[name], flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--method", default="kvq-int4", help="the compressed method timed beside the full cache")
    args = p.parse_args()
    out: dict = {"threads": torch.get_num_threads(), "length": args.length}
    wall = time.monotonic()
    loaded = load_model(args.model)
    out["load_wall_s"] = round(time.monotonic() - wall, 1)
    needle = TaskSpec(tasks=["niah_single"], lengths=[args.length], depths=[0.5], samples=1)
    timed(out, "needle_full", loaded, [make_policy("full")], needle)
    timed(out, f"needle_full_{args.method}", loaded, [make_policy("full"), make_policy(args.method)], needle)
    continuation = TaskSpec(tasks=["continuation"], lengths=[args.length], samples=1, continuation_tokens=128)
    timed(out, "continuation_full", loaded, [make_policy("full")], continuation)
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
