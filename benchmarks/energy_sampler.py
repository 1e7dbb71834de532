"""Validate kvlab's energy sampler on one GPU (run once per machine or driver; not a test).

1. Channel cadence: how often the energy counter, instant power, averaged power and
   ``nvmlDeviceGetPowerUsage`` change under a constant matmul load.
2. Sampler overhead on decode: the same generation (Llama-3.1-8B shape, synthetic weights) with
   a null sampler and with the NVML polling thread, interleaved in pairs; target < 1 % on decode.
3. Counter vs integrated power on a known load: idle, then a bf16 matmul square load for
   T = 0.5 ... 10 s inside one window. Prints each channel's energy relative to the counter, and
   what a 1 s trailing average predicts for the study's 10 Hz method: 1 - (P_load - P_idle) * 0.5 s / (P_load * T).

Needs only torch, transformers and nvidia-ml-py (kvlab on PYTHONPATH). Writes a JSON summary to
``$OUT/energy_sampler.json`` when ``OUT`` is set (else the working directory).

    PYTHONPATH=. python benchmarks/energy_sampler.py            # about 4 minutes on an H200
    PYTHONPATH=. python benchmarks/energy_sampler.py --quick    # about 1.5 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvlab.card import device_card
from kvlab.energy import NullSampler, NvmlSampler, make_sampler


def change_intervals_ms(ts: list[float], vs: list[float]) -> list[float]:
    """Intervals between successive value changes of a polled series (ms)."""
    changes = [t for k, (t, v) in enumerate(zip(ts, vs, strict=True)) if k == 0 or v != vs[k - 1]]
    return [(b - a) * 1000 for a, b in zip(changes[:-1], changes[1:], strict=True)]


def med(xs):
    return statistics.median(xs) if xs else float("nan")


class MatmulLoad:
    """A bf16 square matmul loop: a steady, known GPU load."""

    def __init__(self, device: str, n: int = 8192):
        self.device = device
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        self.run(10)
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        self.run(50)
        torch.cuda.synchronize(device)
        self.iter_s = (time.perf_counter() - t) / 50

    def run(self, iters: int) -> None:
        for _ in range(iters):
            torch.mm(self.a, self.b, out=self.c)

    def for_seconds(self, seconds: float) -> None:
        self.run(max(1, round(seconds / self.iter_s)))


def cadence(device: str, load: MatmulLoad, seconds: float) -> dict:
    s = make_sampler(device, interval_s=0.002, study_interval_s=0.002)
    if not isinstance(s, NvmlSampler):
        return {"error": s.source}
    with s.window() as w:
        load.for_seconds(seconds)
    tl = w.result.timeline
    out = {}
    for name, (ts, vs) in (("counter", tl.counter), ("instant", tl.instant), ("average", tl.average),
                           ("power_usage", tl.power_usage)):
        iv = change_intervals_ms(ts, vs)
        out[name] = {"changes": len(iv) + 1 if ts else 0, "median_interval_ms": med(iv)}
    out["polls"] = w.result.n_samples
    out["mean_w_counter"] = w.result.energy_j / w.result.seconds
    s.close()
    return out


def decode_overhead(device: str, model_name: str, ctx: int, new_tokens: int, pairs: int,
                    intervals_ms: list[float]) -> dict:
    from kvlab.energy import cuda_sync
    from kvlab.engine.engines import make_engine
    from kvlab.measure import measure_generation
    from kvlab.models import load_model
    from kvlab.policies import make_policy

    loaded = load_model(model_name, weights="synthetic", device=device)
    policy = make_policy("full")
    policy.check(loaded.model)
    policy.prepare(loaded.model)
    null = NullSampler("none: baseline without the polling thread", sync=cuda_sync(device))

    def run(sampler):
        m = measure_generation(loaded, policy, ctx=ctx, batch=1, new_tokens=new_tokens, sampler=sampler, engine=make_engine("hf", loaded))
        r = m.record
        return {"decode_ms_per_token": r["decode_s"] * 1000 / (new_tokens - 1), "gpu_busy_ms": r["gpu_busy_ms"],
                "itl_median_ms": r["itl_median_ms"], "energy_j": r["energy_j"], "prefill_j": r["prefill_j"],
                "decode_j": r["decode_j"], "energy_10hz_j": r["energy_10hz_j"], "samples": r["energy_samples"],
                "window_s": r["window_s"], "ttft_s": r["ttft_s"]}

    for _ in range(2):  # warm-up: the exact shape, twice (cuDNN plans, allocator)
        run(null)
    result = {"model": model_name, "ctx": ctx, "new_tokens": new_tokens, "by_interval": {}}
    for interval in intervals_ms:
        sampler = make_sampler(device, interval_s=interval / 1000)
        ratios, busy_ratios, rows = [], [], []
        for k in range(pairs):
            order = (null, sampler) if k % 2 == 0 else (sampler, null)
            got = {id(s): run(s) for s in order}
            a, b = got[id(null)], got[id(sampler)]
            ratios.append(b["decode_ms_per_token"] / a["decode_ms_per_token"])
            if a["gpu_busy_ms"] and b["gpu_busy_ms"]:
                busy_ratios.append(b["gpu_busy_ms"] / a["gpu_busy_ms"])
            rows.append({"null": a, "sampler": b})
        result["by_interval"][str(interval)] = {
            "median_ratio": med(ratios), "mean_ratio": statistics.fmean(ratios), "ratios": ratios,
            "median_gpu_busy_ratio": med(busy_ratios), "runs": rows,
        }
        sampler.close()
    return result  # the model is freed with this frame


def windows(device: str, load: MatmulLoad, lengths: list[float], repeats: int, idle_gap_s: float) -> dict:
    s = make_sampler(device)
    idle_w = s.measure_idle(10.0)
    rows = []
    for T in lengths:
        for _ in range(repeats):
            time.sleep(idle_gap_s)  # back to idle: each window starts with a step, like a short run
            with s.window() as w:
                load.for_seconds(T)
            r = w.result
            p_load = r.energy_j / r.seconds
            rows.append({
                "T_s": r.seconds, "counter_j": r.energy_j, "mean_w": p_load,
                "instant_over_counter": r.energy_instant_j / r.energy_j if r.energy_instant_j else None,
                "average_over_counter": r.energy_average_j / r.energy_j if r.energy_average_j else None,
                "10hz_over_counter": r.energy_10hz_j / r.energy_j if r.energy_10hz_j else None,
                "10hz_predicted": 1 - (p_load - idle_w) * 0.5 / (p_load * r.seconds) if idle_w else None,
                "temp_end_c": r.temp_end_c,
            })
    s.close()
    return {"idle_w": idle_w, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--intervals-ms", default="15,10")
    ap.add_argument("--windows", default="0.5,1,2,5,10")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer pairs and windows")
    ap.add_argument("--parts", default="cadence,overhead,windows",
                    help="which of the three measurements to run (comma-separated)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"cadence", "overhead", "windows"}:
        ap.error(f"--parts takes cadence, overhead, windows; got {args.parts}")
    if args.quick:
        args.pairs, args.intervals_ms, args.windows, args.repeats = 4, "15", "0.5,2,5", 1
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    probe = make_sampler(args.device)
    print(f"device {args.device}: {torch.cuda.get_device_name(args.device)}; energy source: {probe.source}; "
          f"{getattr(probe, 'gpu', {})}")
    if not isinstance(probe, NvmlSampler):
        return 2
    print(f"power fields at GPU scope: {probe.field_ids}")
    probe.close()
    summary: dict = {"device": torch.cuda.get_device_name(args.device), "card": device_card(args.device),
                     "args": vars(args)}

    load = MatmulLoad(args.device) if parts & {"cadence", "windows"} else None
    if "cadence" in parts:
        _print_cadence(args, load, summary)
    if "overhead" in parts:
        _print_overhead(args, summary)
    if "windows" in parts:
        torch.cuda.empty_cache()
        _print_windows(args, load, summary)
    out = Path(os.environ.get("OUT", ".")) / "energy_sampler.json"
    out.write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nwrote {out}")
    return 0


def _print_cadence(args, load, summary) -> None:
    print(f"\n[1] channel cadence under a matmul load (iteration {load.iter_s * 1000:.2f} ms, polled every 2 ms)")
    summary["cadence"] = c = cadence(args.device, load, 3.0)
    for name in ("counter", "instant", "average", "power_usage"):
        print(f"  {name:<12} changes {c[name]['changes']:>5}   median interval {c[name]['median_interval_ms']:7.1f} ms")
    print(f"  mean power from the counter: {c['mean_w_counter']:.0f} W")


def _print_overhead(args, summary) -> None:
    print(f"\n[2] sampler overhead on decode ({args.model} synthetic, ctx {args.ctx}, {args.new_tokens} tokens, "
          f"{args.pairs} interleaved pairs)")
    intervals = [float(x) for x in args.intervals_ms.split(",")]
    summary["overhead"] = o = decode_overhead(args.device, args.model, args.ctx, args.new_tokens, args.pairs,
                                              intervals)
    for interval, res in o["by_interval"].items():
        last = res["runs"][-1]["sampler"]
        split = last["prefill_j"] / last["energy_j"] if last["prefill_j"] and last["energy_j"] else float("nan")
        print(f"  poll {interval:>4} ms: decode time ratio sampler/null median {res['median_ratio']:.4f} "
              f"(mean {res['mean_ratio']:.4f}; {(res['median_ratio'] - 1) * 100:+.2f}%, target < 1%); "
              f"GPU-busy ratio {res['median_gpu_busy_ratio']:.4f}")
        print(f"      last run: {last['decode_ms_per_token']:.1f} ms/token, {last['energy_j']:.1f} J, "
              f"prefill share {split:.3f}, 10 Hz/counter {last['energy_10hz_j'] / last['energy_j']:.3f}, "
              f"{last['samples']} polls in {last['window_s']:.2f} s")


def _print_windows(args, load, summary) -> None:
    lengths = [float(x) for x in args.windows.split(",")]
    print(f"\n[3] counter vs integrated power: idle {2.0:.0f} s, then a matmul load of T s in one window")
    summary["windows"] = wv = windows(args.device, load, lengths, args.repeats, idle_gap_s=2.0)
    print(f"  loaded idle (model freed, CUDA context alive): {wv['idle_w']:.1f} W")
    print(f"  {'T s':>6} {'counter J':>10} {'mean W':>7} {'inst/ctr':>9} {'avg/ctr':>8} {'10Hz/ctr':>9} {'predicted':>9}")
    for r in wv["rows"]:
        def f(x):
            return f"{x:.3f}" if x is not None else "  -  "

        print(f"  {r['T_s']:6.2f} {r['counter_j']:10.1f} {r['mean_w']:7.0f} {f(r['instant_over_counter']):>9} "
              f"{f(r['average_over_counter']):>8} {f(r['10hz_over_counter']):>9} {f(r['10hz_predicted']):>9}")


if __name__ == "__main__":
    sys.exit(main())
