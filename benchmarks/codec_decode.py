"""The rotated-codebook decode kernel (turboquant presets) beside flash over bf16 K/V, with each read's
bandwidth quoted against a read-only stream (a sum over the same number of bytes) and, beside it, a
device-to-device copy, all measured in the same call on the same card. Not a test: a GPU script.

    python benchmarks/codec_decode.py --out codec_decode.json            # Llama-3.1-8B shape, 16k, batch 1 and 16
    TRITON_INTERPRET=1 python benchmarks/codec_decode.py --device cpu --quick   # smoke test

Rows: ``sdpa-bf16`` (torch SDPA over dense ``[B, Hkv, C, D]`` K/V with GQA), ``tq-<variant>`` (the fused
kernel, :func:`kvlab.kernels.turboquant_triton.fused_rotated_decode`, query rotation and output
rotation included), each with ``bytes`` (what one call must read of K/V), ``ms`` (median), ``GB/s`` and
``of_read`` / ``of_copy`` (its GB/s over the read-only stream's / the copy's). Repeats alternate
between the rows (ABAB...), ``--repeats`` rounds; the JSON keeps every time, the card
(:mod:`kvlab.card`) and each row's mean time over sdpa-bf16's (``ms_vs_sdpa``: a Welch-log interval
from :mod:`kvlab.intervals`, none below 3 rounds).
Caveats: no L2 flush between calls (at batch 1 a 16k preset's codes, ~15 MiB, fit an H100's L2: quote
batch 16); the kernel is one program per (row, query head) with no split over the slots, so at batch 1
it fills 32 of the SMs (a split-K version is the next step if the goal's 75% is to be met).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kvlab.card import device_card
from kvlab.intervals import ratio_interval
from kvlab.kernels import turboquant as tq


def timer(device):
    if torch.device(device).type == "cuda":
        def run(fn, n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn()
            start.record()
            for _ in range(n):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / n
    else:
        def run(fn, n):
            fn()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t) * 1e3 / n
    return run


def rows(batch, ctx, hq, hkv, d, device, variants):
    """{name: (fn, bytes read)}."""
    from kvlab.kernels.turboquant_triton import fused_rotated_decode

    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(batch, hq, 1, d, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(batch, hkv, ctx, d, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(batch, hkv, ctx, d, generator=gen).to(device, torch.bfloat16)
    out = {"sdpa-bf16": (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 2 * k.numel() * 2)}
    rot = tq.rotations(hkv, d, 0).to(device)
    used = torch.tensor([ctx], device=device)
    for name in variants:
        kbook, vbook = tq.VARIANTS[name]
        kp, vp = kbook.encode(tq.rotate(k, rot)), vbook.encode(tq.rotate(v, rot))
        nbytes = sum(t.numel() * t.element_size() for t in (*kp, *vp))
        out[f"tq-{name}"] = (lambda kp=kp, vp=vp, kb=kbook, vb=vbook: fused_rotated_decode(
            q, kp, vp, used, rot, d ** -0.5, kb, vb), nbytes)
    stream = torch.ones(2 * k.numel() * 2 // 4, device=device)  # the bf16 K/V's bytes, as float32
    sink = torch.empty_like(stream)
    out["read-stream"] = (lambda: stream.sum(), stream.numel() * 4)
    out["copy"] = (lambda: sink.copy_(stream), stream.numel() * 4)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--shape", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
    p.add_argument("--variants", nargs="+", default=["k3v4", "4bit", "3bit"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="tiny shape for a CPU smoke test")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.ctx, args.shape, args.iters, args.variants = [1], 64, [4, 2, 32], 1, ["k3v4"]
    run = timer(args.device)
    results = []
    for batch in args.batches:
        table = rows(batch, args.ctx, *args.shape, args.device, args.variants)
        times = {name: [] for name in table}
        for _ in range(args.repeats):  # ABAB: every row once per round
            for name, (fn, _) in table.items():
                times[name].append(run(fn, args.iters))
        gbs = {name: table[name][1] / (statistics.median(t) * 1e-3) / 1e9 for name, t in times.items()}
        for name, t in times.items():
            row = {"batch": batch, "ctx": args.ctx, "row": name, "bytes": table[name][1], "ms": statistics.median(t),
                   "ms_all": t, "GB/s": gbs[name], "of_read": gbs[name] / gbs["read-stream"],
                   "of_copy": gbs[name] / gbs["copy"], "n": len(t),
                   "ms_vs_sdpa": ratio_interval(t, times["sdpa-bf16"]).to_dict()}
            results.append(row)
            print(f"b={batch:3d} {name:12s} {row['bytes'] / 2**20:9.1f} MiB {row['ms']:8.3f} ms "
                  f"{row['GB/s']:8.1f} GB/s  {row['of_read']:.2f} of read, {row['of_copy']:.2f} of copy (n={row['n']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "card": device_card(args.device), "rows": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
