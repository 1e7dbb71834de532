"""The fast engine's dense decode attention on the GPU, kernel by kernel, with its power (issue #28).

    python benchmarks/fast_attention.py --ctx 16384 --batch 1 16 --splits 8 16 --seconds 2 --out $OUT/fast_attention.json

At the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head dim 128), bf16 K/V of
``ctx + new`` slots with ``ctx`` used, random values (``--fills zeros``: zeros, as the minimal step's
buffers held on 2026-12-03f; the same bytes, but the power drawn may depend on them), per batch and
variant:

- ``flash``: what the engine runs, flash's varlen kernel over the head-major store, one sequence
  per (row, KV head) (:func:`kvlab.storage.slots.flash_decode`);
- ``flash-bchd``: the call the engine made before, ``B`` sequences of ``Hkv`` heads over
  ``[B, C, Hkv, D]``, whose GQA transposes torch copies at batch > 1 (three copy kernels a call);
- ``flash-sN``: ``flash`` with ``N`` KV splits (``--splits``; 0 is flash's heuristic, which is
  ``flash``), where torch's op takes ``num_splits``: fewer splits, a shorter combine pass;
- ``sdpa``: masked SDPA as the engine's ``attention="sdpa"`` calls it (GQA as query rows), torch's
  backend choice; ``cudnn-rows``: the same call pinned to cuDNN; ``cudnn``: the engine's
  ``attention="cudnn"`` (:func:`kvlab.storage.slots.cudnn_decode`: ``Hq`` query heads,
  ``enable_gqa``, the lengths as an additive bias: the minimal step's kernel, with the lengths).

Each: max abs error against a float32 reference, µs per call replayed from a CUDA graph over
rotating buffer copies (so L2 does not serve the K/V), the GB/s of the K/V bytes it must read, its
kernels per call (name, µs: the split kernel, the combine pass, copies), and with ``--seconds`` the
NVML counter's W and µJ per call over a steady window. ``--device cpu`` smoke-tests the SDPA rows.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext

import torch

from kvlab.card import device_card
from kvlab.storage.slots import (
    cudnn_decode,
    cumulative_offsets,
    flash_decode,
    flash_takes_splits,
    sdpa_decode,
    segment_lengths,
)

L2_BYTES = 60 * 2**20  # a little above the H100/H200's 50 MB


def reference(q, keys, values, length, scale):
    """float32 attention of ``q [B, Hq, 1, D]`` over the first ``length`` slots of ``[B, Hkv, C, D]``."""
    bsz, hq, _, d = q.shape
    groups = hq // keys.shape[1]
    k = keys[:, :, :length].float().repeat_interleave(groups, dim=1)
    v = values[:, :, :length].float().repeat_interleave(groups, dim=1)
    p = torch.softmax(q.float() @ k.transpose(-1, -2) * scale, dim=-1)
    return (p @ v).reshape(bsz, hq, d)


def pinned(backend: str | None):
    """An SDPA backend pin (None: torch's choice) around the call and its capture."""
    if backend is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, backend)])


def old_flash(q, keys_bchd, values_bchd, used, scale):
    """The engine's flash call before the head-major store: ``B`` sequences of ``Hkv`` heads."""
    bsz, hq, _, d = q.shape
    cap, hkv = keys_bchd.shape[1], keys_bchd.shape[2]
    cu_q, cu_k = cumulative_offsets(bsz, cap, q.device)
    out = torch.ops.aten._flash_attention_forward(
        q.reshape(bsz, hq, d), keys_bchd.view(bsz * cap, hkv, d), values_bchd.view(bsz * cap, hkv, d),
        cu_q, cu_k, 1, cap, 0.0, False, False, scale=scale, seqused_k=used)[0]
    return out.view(bsz, hq, d)


def variants(args, bsz: int, hkv: int, cap: int, device) -> dict[str, tuple[Callable, str | None, bool]]:
    """name -> (fn(q, keys, values, bchd) on head-major buffers, SDPA backend pin, needs [B, C, Hkv, D])."""
    scale = 128**-0.5
    length = torch.tensor([args.ctx], device=device)
    seg = segment_lengths(torch.full((bsz,), args.ctx, device=device), hkv)
    rows = torch.full((bsz,), args.ctx, dtype=torch.int32, device=device)
    offsets = cumulative_offsets(bsz * hkv, cap, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bias = torch.zeros(1, 1, 1, cap, dtype=dtype, device=device)
    bias[..., args.ctx:] = float("-inf")
    out: dict[str, tuple[Callable, str | None, bool]] = {}
    if device.type == "cuda":
        out["flash"] = (lambda q, k, v, kv: flash_decode(q, k, v, seg, scale, *offsets), None, False)
        out["flash-bchd"] = (lambda q, k, v, kv: old_flash(q, *kv, rows, scale), None, True)
        for n in args.splits if flash_takes_splits() else []:
            if n > 0:
                out[f"flash-s{n}"] = (lambda q, k, v, kv, n=n: flash_decode(q, k, v, seg, scale, *offsets, splits=n),
                                      None, False)
    out["sdpa"] = (lambda q, k, v, kv: sdpa_decode(q, k, v, length, scale), None, False)
    if device.type == "cuda":
        out["cudnn"] = (lambda q, k, v, kv: cudnn_decode(q, k, v, bias, scale), None, False)
        out["cudnn-rows"] = (lambda q, k, v, kv: sdpa_decode(q, k, v, length, scale), "CUDNN_ATTENTION", False)
    return out


def replay_graph(fn, calls: int, device) -> Callable[[], None]:
    """``fn(i)`` for ``i`` in ``range(calls)``, captured once (CUDA) after a warm-up; eager on CPU."""
    if device.type != "cuda":
        return lambda: [fn(i) for i in range(calls)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return graph.replay


def per_call_us(run, calls: int, reps: int, device) -> float:
    """µs per call over ``reps`` runs of ``calls`` calls (CUDA events; perf_counter on CPU)."""
    run()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        return (time.perf_counter() - t0) * 1e6 / (reps * calls)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        run()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * calls)


def kernels_per_call(run, calls: int, device) -> dict[str, dict[str, float]]:
    """Kernel name -> launches and µs per call, from torch.profiler over one run (CUDA only)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    table: dict[str, dict[str, float]] = defaultdict(lambda: {"launches": 0.0, "us": 0.0})
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            table[e.name]["launches"] += 1 / calls
            table[e.name]["us"] += e.time_range.elapsed_us() / calls
    return dict(sorted(table.items(), key=lambda kv: -kv[1]["us"]))


def energy_per_call(run, calls: int, us: float, seconds: float, sampler) -> dict:
    """W and µJ per call over a steady window of about ``seconds``, after a second of the same replays
    (a window that starts from idle under-counts: ../shared/reference/h200-measurements.md)."""
    per_run_s = max(us * calls, 1e-3) / 1e6
    for _ in range(max(1, int(1.0 / per_run_s))):
        run()
    runs = max(1, int(seconds / per_run_s))
    with sampler.window() as w:
        for _ in range(runs):
            run()
    res = w.result
    if res.energy_j is None:
        return {"energy_source": res.source}
    return {"energy_source": res.source, "window_s": res.seconds, "mean_power_w": res.energy_j / res.seconds,
            "uj_per_call": res.energy_j * 1e6 / (runs * calls)}


def measure(name, fn, pin, q, bufs, ref, args, device, sampler) -> dict:
    """One variant: error, µs and kernels per call, energy; an ``error`` row if it cannot run here
    (cuDNN may refuse the mask or the layout on this torch: that is a result too)."""
    calls = len(bufs) * args.rounds
    try:
        with pinned(pin):
            err = (fn(q, *bufs[0]).float() - ref).abs().max().item()
            run = replay_graph(lambda i: fn(q, *bufs[i % len(bufs)]), calls, device)
            us = per_call_us(run, calls, args.reps, device)
            row = {"variant": name, "max_err": err, "us_per_call": us, "kernels": kernels_per_call(run, calls, device)}
            if args.seconds > 0:
                row.update(energy_per_call(run, calls, us, args.seconds, sampler))
            return row
    except RuntimeError as err:
        return {"variant": name, "error": f"{type(err).__name__}: {str(err)[:300]}"}


def batch_rows(bsz: int, fill: str, args, device, sampler) -> list[dict]:
    """Every variant at one batch over K/V holding ``fill`` (``random`` or ``zeros``: the same bytes
    read, the power they draw may differ)."""
    hq, hkv, d = 32, 8, 128
    cap = args.ctx + args.new_tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv_bytes = 2 * bsz * args.ctx * hkv * d * 2
    copies = max(1, min(8, math.ceil(4 * L2_BYTES / kv_bytes))) if device.type == "cuda" else 1
    g = torch.Generator(device=device).manual_seed(0)
    heads = [tuple(torch.randn(bsz, hkv, cap, d, device=device, dtype=dtype, generator=g) for _ in range(2))
             for _ in range(copies)]
    if fill == "zeros":
        heads = [(k.zero_(), v.zero_()) for k, v in heads]
    q = torch.randn(bsz, hq, 1, d, device=device, dtype=dtype, generator=g)
    ref = reference(q, *heads[0], args.ctx, d**-0.5)
    rows, outs = [], {}
    chosen = {n: v for n, v in variants(args, bsz, hkv, cap, device).items() if not args.only or n in args.only}
    for name, (fn, pin, bchd) in chosen.items():
        bufs = [(k, v, tuple(t.transpose(1, 2).contiguous() for t in (k, v)) if bchd else None) for k, v in heads]
        row = {"batch": bsz, "fill": fill, "ctx": args.ctx, "capacity": cap, "kv_bytes": kv_bytes, "copies": copies,
               **measure(name, fn, pin, q, bufs, ref, args, device, sampler)}
        if "us_per_call" in row:
            row["GB/s"] = kv_bytes / row["us_per_call"] / 1e3
            with pinned(pin):
                outs[name] = fn(q, *bufs[0])
        rows.append(row)
        print_row(row)
        del bufs
    if "flash" in outs and "flash-bchd" in outs:  # the head-major call computes what the old one did, bit for bit
        same = bool(torch.equal(outs["flash"], outs["flash-bchd"]))
        print(f"{bsz:5d} flash == flash-bchd bit for bit: {same}", flush=True)
        for row in rows:
            row["flash_equals_bchd"] = same
    return rows


def print_row(row: dict) -> None:
    if "error" in row:
        print(f"{row['batch']:5d} {row['fill']:6s} {row['variant']:11s} failed: {row['error']}", flush=True)
        return
    power = f"{row['mean_power_w']:6.0f} W {row['uj_per_call']:8.1f} uJ" if "mean_power_w" in row else ""
    print(f"{row['batch']:5d} {row['fill']:6s} {row['variant']:11s} {row['max_err']:.1e} {row['us_per_call']:8.1f} us "
          f"{row['GB/s']:7.0f} GB/s {power}", flush=True)
    for k, c in list(row["kernels"].items())[:4]:
        print(f"{'':25s}{c['launches']:4.1f}x {c['us']:7.1f} us  {k[:90]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=256, help="room past ctx, as the engine sizes its store")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--splits", type=int, nargs="*", default=[0, 8, 16, 64],
                    help="flash split-KV counts to try (0: flash's heuristic), where torch's op takes them")
    ap.add_argument("--rounds", type=int, default=4, help="passes over the buffer copies per captured run")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=0.0, help="energy window per variant (0: none)")
    ap.add_argument("--fills", nargs="+", choices=["random", "zeros"], default=["random"],
                    help="what the K/V hold (the minimal step's buffers were zeros, a prefilled cache is not)")
    ap.add_argument("--only", nargs="*", default=[], help="run only these variants (names as printed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from kvlab.energy import make_sampler

    device = torch.device(args.device)
    sampler = make_sampler(args.device)
    print(f"torch {torch.__version__}, flash takes num_splits: {flash_takes_splits()}, energy: {sampler.source}")
    print("batch fill   variant     max_err   per call      K/V read   power")
    rows = []
    with torch.no_grad():
        for fill in args.fills:
            for bsz in args.batch:
                rows += batch_rows(bsz, fill, args, device, sampler)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "flash_takes_splits": flash_takes_splits(),
                       "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                       "card": device_card(args.device), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
