"""Quantized-KV decode attention on the GPU: kernel vs reference error, then time and bandwidth.

Not a test: a script to run on the H200 (issue 13). Needs only torch, triton and numpy (kvlab is
imported from this checkout). From the repository root:

    python benchmarks/quant_attention.py --tune --profile --skip write --out quant_attention.json   # ~6 min

The split-step kernels (``--variants``, default all of kvlab.kernels.formats.VARIANTS:
``split``, ``fold``, ``fold_asm``, ``warp``, ``warp_asm``, ``warp2``, ``warp2_asm``) run side by side on the same stores in every
section (a variant that falls back to another on a format, fold_asm off int4, warp off int4/fp8, is
not repeated). The performance section runs each at its format's launch geometry (``--geometry
format``, what the engines run) or at LaunchConfig's defaults (``--geometry default``); ``--tune``
(with ``--tune-variants``) times grids of them.

(a) Correctness: the Triton kernels (kvlab.kernels.decode_attention) against the float32 reference
    on a sampled grid: batch 1-32, lengths {1, 7, 1000, 4097, 16384, 32769} (the other rows of a
    batch get random shorter lengths), GQA 1-8, head dim 64 and 128, formats bf16/fp8/int4/int2.
    Reports the max abs error, ||out - ref|| / ||ref||, and whether every output element was
    written (the output is poisoned with NaN first), per case and worst per variant.
(b) Performance at the Llama-3.1-8B attention shape (Hq 32, Hkv 8, D 128), 16k tokens, batch
    1/16/32: median kernel time by CUDA events (eager launches, and replays of a captured CUDA
    graph), GB/s on the KV bytes read (codes + scales + zeros of K and V), the ratio to a read-only
    stream (a reduction over 4 GiB, ``of_read_bw``, and over the same bytes in the same case,
    ``of_read_same_bytes``: the kernel only reads, so this is its floor), the ratio to a 4 GiB
    device-to-device copy measured here (read + write counted; a copy also writes, which flatters a
    read-only kernel's fraction of it), and against a copy of the same bytes
    timed in the same case (``of_copy_same_bytes``; ``floor_ms`` = half that copy, the time to read
    the bytes at copy bandwidth; ``x_floor`` = the kernel's time over it), the error against the reference,
    and against bf16 SDPA (``F.scaled_dot_product_attention(..., enable_gqa=True)``) and
    dequantize-then-SDPA (what transformers' quantized caches do); then fold/split time per case.
    Inputs rotate over enough copies to exceed the L2 cache. Every timing of a case (each launch
    config eager and in a graph, the baselines, the same-bytes copy and read) alternates round by
    round (ABAB..., ``repeats`` rounds: ``kernel_timing.time_alternated``), as do (tune)'s grids and
    (c)'s torch write and kernel; rows say ``alternated: true``.
(tune) With ``--tune``: a grid of launch configs (``--tune-variants``, default fold, fold_asm and
    split; block, warps, stages, split density) for ``--tune-formats`` (fp8 and int4-g64) at batch 1/16/32, then per format the config
    with the best geometric mean over the batches (relative to the best at each batch; configs
    whose error exceeds 2e-2 relative are out), printed as a ``TUNED_CONFIGS`` line and a
    ``DEFAULT_VARIANT`` line to paste into kvlab/kernels/formats.py and kvlab/kernels/decode.py.
(profile) With ``--profile`` (CUDA): torch.profiler's time per launched kernel (the split step and
    the reduce) for each variant's default config and the tuned winner, same formats and batches.
(c) Quantize-on-write of the token a decode step appends (same shape, batch 1/16/32): the Triton
    kernel vs the torch ops of ``KVFormat.write`` (mismatching elements, time eager and in a graph).

Every case runs in its own try/except: a failure is reported (and lands in the JSON), never aborts.
The JSON is rewritten after every row, so a run cut short keeps what it measured.
``--device cpu --quick --backend triton`` with TRITON_INTERPRET=1 smoke-tests the script on CPU.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvlab.budget import bandwidth_fields  # noqa: E402
from kvlab.card import device_card  # noqa: E402
from kvlab.kernels import (  # noqa: E402
    LaunchConfig,
    decode_attention,
    decode_attention_reference,
    format_label,
    kernel_variant,
    make_format,
    make_workspace,
    quantize_write,
)
from kvlab.kernels.formats import VARIANTS, parse_format  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_timing import (  # noqa: E402
    Clock,
    copy_bandwidth,
    copy_same_bytes,
    l2_bytes,
    read_bandwidth,
    read_same_bytes,
    time_alternated,
)

FORMATS = [("bf16", None), ("fp8", None), ("int4", 64), ("int2", 64)]
EXTRA_GROUPS = [("int4", 32), ("int4", 128), ("int2", 128)]
LENGTHS = [1, 7, 1000, 4097, 16384, 32769]
BATCHES = [1, 3, 8, 32]
GQAS = [1, 2, 4, 8]


def fill_stores(name, group, batch, kv_heads, capacity, dim, device, seed):
    """K and V stores of ``capacity`` random tokens (K with a few large channels, as real keys have)."""
    fmt = make_format(name, group=group)
    gen = torch.Generator(device=device).manual_seed(seed)
    stores = []
    for which in ("k", "v"):
        store = fmt.alloc(batch, kv_heads, capacity, dim, device=device)
        chunk = max(1, 2**28 // (batch * kv_heads * dim))  # bound the float32 temporaries (~1 GiB)
        channel = torch.ones(dim, device=device)
        if which == "k":
            channel[:: max(1, dim // 8)] = 6.0
        for start in range(0, capacity, chunk):
            n = min(chunk, capacity - start)
            x = torch.randn(batch, kv_heads, n, dim, device=device, generator=gen) * channel
            fmt.write(store, x, torch.arange(start, start + n, device=device))
        stores.append(store)
    return fmt, stores[0], stores[1]


def correctness_cases(quick: bool):
    """A sampled grid: every format x head dim x length, batch and GQA rotating through their lists."""
    lengths = [1, 7, 100, 333] if quick else LENGTHS
    batches = [1, 3] if quick else BATCHES
    i = 0
    for dim in (64, 128):
        for length in lengths:
            for name, group in FORMATS + (EXTRA_GROUPS if dim == 128 and length in (4097, 333) else []):
                batch, gqa = batches[i % len(batches)], GQAS[(i // len(batches)) % len(GQAS)]
                if batch * length > 32 * 16384 and not quick:
                    batch = max(1, (32 * 16384) // length)  # bound memory: 32 rows of 32k are ~17 GB in float32
                slack = 0 if i % 2 == 0 else 61  # half the cases have a capacity past the longest row
                yield {"format": name, "group": group, "batch": batch, "gqa": gqa, "head_dim": dim,
                       "length": length, "capacity": length + slack}
                i += 1


def run_correctness(case, device, backend, seed, variants):
    """One sampled case, each variant's kernel on the same stores: a row per variant."""
    rows = []
    try:
        kv_heads = 4 if case["head_dim"] == 64 else 8
        if device == "cpu":
            kv_heads = 2
        batch, dim = case["batch"], case["head_dim"]
        fmt, k, v = fill_stores(case["format"], case["group"], batch, kv_heads, case["capacity"], dim, device, seed)
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        lengths = torch.randint(1, case["length"] + 1, (batch,), device=device, generator=gen)
        lengths[0] = case["length"]
        lengths = lengths.to(torch.int32)
        q = torch.randn(batch, kv_heads * case["gqa"], dim, device=device, generator=gen).to(torch.bfloat16)
        scale = dim**-0.5
        ref = decode_attention_reference(q, k, v, lengths, scale)
    except Exception as err:  # noqa: BLE001 - one case failing must not hide the others
        return [dict(case, status="failed", error=f"{type(err).__name__}: {err}",
                     traceback=traceback.format_exc(limit=6))]
    done = set()
    for variant in variants:
        config = LaunchConfig(variant=variant)
        if kernel_variant(config, k) in done:  # e.g. fold_asm on a format without PTX unpacking
            continue
        done.add(kernel_variant(config, k))
        row = dict(case)
        try:
            out = torch.full_like(q, float("nan"))
            decode_attention(q, k, v, lengths, scale, out=out, backend=backend,
                             workspace=make_workspace(q.shape[1], k, config=config))
            diff = out.float() - ref
            row.update(label=fmt.label, kv_heads=kv_heads, status="ok", variant=kernel_variant(config, k),
                       unwritten=int(torch.isnan(out).sum()),
                       max_abs_err=float(diff.nan_to_num(float("inf")).abs().max()),
                       rel_err=float(diff.norm() / ref.norm().clamp_min(1e-30)),
                       ref_max_abs=float(ref.abs().max()))
        except Exception as err:  # noqa: BLE001
            row.update(status="failed", variant=variant, error=f"{type(err).__name__}: {err}",
                       traceback=traceback.format_exc(limit=6))
        rows.append(row)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def perf_data(case, device, seed, l2_bytes):
    """Stores, q and lengths of one performance case; sets rotate so that the L2 cache cannot serve them."""
    name, group, batch = case["format"], case["group"], case["batch"]
    kv_heads, q_heads, dim, length, capacity = case["kv_heads"], case["q_heads"], 128, case["length"], case["capacity"]
    fmt = make_format(name, group=group)
    kv_bytes = 2 * fmt.bytes_per_token(kv_heads, dim) * length * batch  # K and V, up to the length
    copies = max(1, min(16, math.ceil(4 * l2_bytes / kv_bytes)))
    sets = [fill_stores(name, group, batch, kv_heads, capacity, dim, device, seed + i)[1:] for i in range(copies)]
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, q_heads, dim, device=device, generator=gen).to(torch.bfloat16)
    lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
    return {"fmt": fmt, "sets": sets, "q": q, "lengths": lengths, "scale": dim**-0.5, "kv_bytes": kv_bytes,
            "copies": copies, "length": length}


def kernel_of(data, config, backend, row):
    """One launch config on ``data``: the callable running a kernel call per copy (``row`` gets the
    config's fields), and its error against the reference."""
    sets, q, lengths, scale = data["sets"], data["q"], data["lengths"], data["scale"]
    out = torch.empty_like(q)
    spaces = [make_workspace(q.shape[1], k, config=config) for k, _ in sets]

    def kernel():
        for (k, v), ws in zip(sets, spaces, strict=True):
            decode_attention(q, k, v, lengths, scale, out=out, workspace=ws, backend=backend)

    row.update(label=data["fmt"].label, kv_bytes=data["kv_bytes"], copies=data["copies"], config=vars(config),
               variant=kernel_variant(config, sets[0][0]), num_splits=spaces[0].num_splits,
               split_len=spaces[0].split_len)
    k, v = sets[0]
    out.fill_(float("nan"))
    decode_attention(q, k, v, lengths, scale, out=out, workspace=spaces[0], backend=backend)
    ref = decode_attention_reference(q, k, v, lengths, scale)
    diff = out.float() - ref
    row.update(max_abs_err=float(diff.nan_to_num(float("inf")).abs().max()),
               rel_err=float(diff.norm() / ref.norm().clamp_min(1e-30)), status="ok")
    return kernel


def baselines_of(data, iters):
    """``{prefix: (fn, per_call[, iters])}``: bf16 SDPA on the bf16 buffers, or what a dequantizing
    cache does: the prefix back to bf16, then SDPA (eager only; ``sdpa`` is also graphed)."""
    sets, q4, scale, length, copies = data["sets"], data["q"].unsqueeze(2), data["scale"], data["length"], data["copies"]
    if data["fmt"].name == "bf16":
        kv = [(k.codes[:, :, :length], v.codes[:, :, :length]) for k, v in sets]

        def sdpa():
            for k, v in kv:
                F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

        return {"sdpa": (sdpa, copies)}

    def dequant_sdpa():
        for k, v in sets:
            F.scaled_dot_product_attention(q4, k.dequantize(length).to(torch.bfloat16),
                                           v.dequantize(length).to(torch.bfloat16), scale=scale, enable_gqa=True)

    return {"dequant_sdpa": (dequant_sdpa, copies, max(1, iters // 10), False)}


def run_performance(case, configs, device, backend, clock, copy_gbps, seed, l2_bytes, iters, repeats,
                    baselines=True, on_row=None, read_gbps=None):
    """One format at one batch, one row per launch config (same stores for all), plus the baselines
    and the same-bytes copy and read: every timing of the case in one alternation (ABAB...: each
    config, baseline and stream once per round, ``repeats`` rounds)."""
    rows = []
    try:
        data = perf_data(case, device, seed, l2_bytes)
    except Exception as err:  # noqa: BLE001
        return [dict(case, status="failed", error=f"{type(err).__name__}: {err}",
                     traceback=traceback.format_exc(limit=6))]
    fns = {"copy_same": (*copy_same_bytes(device, data["kv_bytes"], data["copies"]), None, False),  # eager only
           "read_same": (*read_same_bytes(device, data["kv_bytes"], data["copies"]), None, False)}
    base_fns, base_error = {}, None
    if baselines:
        try:
            base_fns = baselines_of(data, iters)
        except Exception as err:  # noqa: BLE001
            base_error = f"{type(err).__name__}: {err}"
    seen, timed = set(), []
    for config in configs:
        key = (kernel_variant(config, data["sets"][0][0]), config.block_n, config.num_warps, config.num_stages,
               config.programs_per_sm)
        if key in seen:  # a variant that falls back to one already timed here
            continue
        seen.add(key)
        row = dict(case)
        try:
            fns[f"kernel{len(timed)}"] = (kernel_of(data, config, backend, row), data["copies"])
            timed.append(row)
        except Exception as err:  # noqa: BLE001
            row.update(status="failed", config=vars(config), error=f"{type(err).__name__}: {err}",
                       traceback=traceback.format_exc(limit=6))
        rows.append(row)
    try:
        ms = time_alternated({**fns, **base_fns}, device, clock, iters, repeats)
    except Exception as err:  # noqa: BLE001 - the alternation's failure fails every row it timed
        for row in timed:
            row.update(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=6))
        ms = None
    base = {k: v for k, v in (ms or {}).items() if k.startswith(("sdpa", "dequant_sdpa"))}
    if base_error:
        base = {"baseline_error": base_error}
    for i, row in enumerate(timed):
        if ms is None:
            continue
        row.update(base, **{k.replace(f"kernel{i}_", "kernel_"): v for k, v in ms.items()
                            if k.startswith(f"kernel{i}_")}, alternated=True, repeats=repeats)
        best = min(row["kernel_ms"], row.get("kernel_graph_ms", math.inf))
        row.update(bandwidth_fields(data["kv_bytes"], best, ms["copy_same_ms"], copy_gbps, ms["read_same_ms"],
                                    read_gbps))
    for row in rows:
        if on_row:
            on_row(row)
    del data
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def profile_kernels(case, configs, device, backend, seed, l2_bytes, calls=20):
    """CUDA time per launched kernel (split step vs reduce) for each config, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    data = perf_data(case, device, seed, l2_bytes)
    sets, q, lengths, scale = data["sets"], data["q"], data["lengths"], data["scale"]
    rows = []
    for config in configs:
        row = dict(case, config=vars(config), label=data["fmt"].label, variant=kernel_variant(config, sets[0][0]))
        try:
            spaces = [make_workspace(q.shape[1], k, config=config) for k, _ in sets]
            out = torch.empty_like(q)

            def kernel(spaces=spaces, out=out):
                for (k, v), ws in zip(sets, spaces, strict=True):
                    decode_attention(q, k, v, lengths, scale, out=out, workspace=ws, backend=backend)

            kernel()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(max(1, calls // len(sets))):
                    kernel()
                torch.cuda.synchronize()
            n = max(1, calls // len(sets)) * len(sets)
            row["kernels_us"] = {e.key: e.device_time_total / n for e in prof.key_averages()
                                 if e.device_time_total > 0}
            row["status"] = "ok"
        except Exception as err:  # noqa: BLE001
            row.update(status="failed", error=f"{type(err).__name__}: {err}")
        rows.append(row)
    return rows


def print_profile(rows):
    print("\n(profile) CUDA microseconds per decode_attention call, by kernel")
    for r in rows:
        head = f"{r['label']:<10} B{r['batch']:<3} {r['variant']:<5} block {r['config']['block_n']:>3}"
        if r["status"] != "ok":
            print(f"{head} FAILED {r['error'][:100]}")
            continue
        print(head + "  " + ", ".join(f"{name[:40]} {us:.1f}" for name, us in
                                      sorted(r["kernels_us"].items(), key=lambda kv: -kv[1])))


def run_write(case, device, backend, clock, seed, iters, repeats):
    """One appended token per row: the write kernel against the torch write, agreement and time."""
    row = dict(case)
    try:
        fmt = make_format(case["format"], group=case["group"])
        batch, kv_heads, capacity = case["batch"], case["kv_heads"], case["capacity"]
        gen = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(batch, kv_heads, 1, 128, device=device, generator=gen).to(torch.bfloat16) * 3
        positions = torch.randint(0, capacity, (batch, 1), device=device, generator=gen)
        want, got = (fmt.alloc(batch, kv_heads, capacity, 128, device=device) for _ in range(2))
        fmt.write(want, x, positions)
        quantize_write(got, x, positions, backend=backend)
        row.update(label=fmt.label, status="ok", mismatched=sum(
            int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) if a.dtype == torch.float8_e4m3fn
            else int((a != b).sum()) for a, b in zip(got.tensors(), want.tensors(), strict=True)))
        row.update(time_alternated({"torch": (lambda: fmt.write(want, x, positions), 1),
                                    "kernel": (lambda: quantize_write(got, x, positions, backend=backend), 1)},
                                   device, clock, iters, repeats), alternated=True, repeats=repeats)
    except Exception as err:  # noqa: BLE001
        row.update(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=6))
    return row


def print_write(rows):
    print("\n(c) quantize-on-write of one token per row into a 16k store (ms per call)")
    print(f"{'format':<10} {'B':>3} {'mismatch':>8} {'torch':>8} {'torch gr':>8} {'kernel':>8} {'kern gr':>8}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['format']:<10} {r['batch']:>3} FAILED {r['error'][:120]}")
            continue
        print(f"{r['label']:<10} {r['batch']:>3} {r['mismatched']:>8} {fmt_ms(r.get('torch_ms'))} "
              f"{fmt_ms(r.get('torch_graph_ms'))} {fmt_ms(r.get('kernel_ms'))} {fmt_ms(r.get('kernel_graph_ms'))}")


def performance_cases(quick: bool):
    length = 300 if quick else 16384
    heads = (4, 2) if quick else (32, 8)
    for batch in ((1, 2) if quick else (1, 16, 32)):
        for name, group in FORMATS + [("int4", 32), ("int4", 128)]:
            yield {"format": name, "group": group, "batch": batch, "q_heads": heads[0], "kv_heads": heads[1],
                   "length": length, "capacity": length}
    # The price of a grid fixed by the capacity: a 32k buffer holding 16k tokens.
    for name in ("bf16", "int4"):
        yield {"format": name, "group": 64 if name == "int4" else None, "batch": 1, "q_heads": heads[0],
               "kv_heads": heads[1], "length": length, "capacity": 2 * length}


TUNE_FORMATS = ("fp8", "int4-g64")
TUNE_VARIANTS = ("split", "fold", "fold_asm")  # --tune's default grids (warp, warp_asm: --tune-variants)


def tune_cases(quick: bool, formats):
    """The formats to tune at the batches the issue's goals name (16k, Llama-3.1-8B attention shape)."""
    for case in performance_cases(quick):
        label = format_label(case["format"], case["group"])
        if label in formats and case["capacity"] == case["length"]:
            yield case


def tune_configs(case, quick: bool, variants=TUNE_VARIANTS):
    """Launch configs to compare at every tuned batch: grids of the fold-family ``variants`` that read
    the case's format (fold_asm: int4; warp, warp_asm: int4 and fp8) and a smaller split grid (its
    default inside; with ``split`` in ``variants``)."""
    if quick:
        return [LaunchConfig(variant=v, block_n=b) for v in ("split", "fold") for b in (32, 64)]
    # fold kernels: fewer warps and longer blocks cut instructions per slot (benchmarks/kernel_sass.py),
    # until 2 warps x 256 slots spill registers
    shapes = [(b, w, st) for b, w in ((64, 4), (128, 2), (128, 4), (128, 8), (256, 4), (256, 8)) for st in (2, 3)]
    warp = case["format"] in ("int4", "fp8")
    reads = {"fold": True, "fold_asm": case["format"] == "int4", "warp": warp, "warp_asm": warp, "warp2": warp,
             "warp2_asm": warp}
    folds = [v for v in reads if v in variants and reads[v]]
    configs = [LaunchConfig(variant=v, block_n=b, num_warps=w, num_stages=st) for v in folds for b, w, st in shapes]
    configs += [LaunchConfig(variant=v, block_n=128, num_stages=3, programs_per_sm=p) for v in folds for p in (2, 8)]
    if "split" in variants:
        configs += [LaunchConfig(variant="split", block_n=b, num_warps=w, num_stages=st)
                    for b in (64, 128) for w in (4, 8) for st in (2, 3)]
    return configs


def geometry_configs(case, variants, geometry: str):
    """The performance section's launch configs: ``default`` (:class:`LaunchConfig`'s geometry for every
    format) or ``format`` (the format's own, :data:`kvlab.kernels.formats.TUNED_CONFIGS`: what the
    engines run), one per variant."""
    if geometry == "default":
        return [LaunchConfig(variant=v) for v in variants]
    tuned = parse_format(format_label(case["format"], case["group"])).launch_config
    return [dataclasses.replace(tuned, variant=v) for v in variants]


def config_text(c):
    return f"{c['variant']:<5} {c['block_n']:>5} {c['num_warps']:>5} {c['num_stages']:>6} {c['programs_per_sm']:>6}"


def print_tune(rows):
    print("\n(tune) split-kernel launch configs at 16k (ms per call, eager / graph)")
    print(f"{'format':<10} {'B':>3} {'kern':<5} {'block':>5} {'warps':>5} {'stages':>6} {'per SM':>6} {'splits':>6} "
          f"{'eager':>8} {'graph':>8} {'GB/s':>6} {'of copy':>7} {'rel err':>8}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['format']:<10} {r['batch']:>3} {config_text(r.get('config') or {})} FAILED {r['error'][:100]}")
            continue
        print(f"{r['label']:<10} {r['batch']:>3} {config_text(r['config'])} {r['num_splits']:>6} "
              f"{fmt_ms(r.get('kernel_ms'))} {fmt_ms(r.get('kernel_graph_ms'))} {r['kernel_GBps']:6.0f} "
              f"{r.get('of_copy_bw', 0):7.2f} {r['rel_err']:8.1e}")


def best_ms(row):
    return min(row.get("kernel_ms", math.inf), row.get("kernel_graph_ms", math.inf))


def pick_winners(rows, max_rel_err=2e-2, variant=None):
    """Per format: the config whose times, relative to the best at each batch, have the smallest geometric mean.

    Only configs measured ok (and within ``max_rel_err`` of the reference) at every batch compete;
    ``variant`` restricts them to one kernel (the best times at each batch too).
    """
    by_format: dict[str, dict] = {}
    for r in rows:
        if r.get("status") == "ok" and r["rel_err"] <= max_rel_err and variant in (None, r["config"]["variant"]):
            key = tuple(sorted(r["config"].items()))
            by_format.setdefault(r["label"], {}).setdefault(key, {})[r["batch"]] = best_ms(r)
    winners = {}
    for label, configs in by_format.items():
        batches = set().union(*(t.keys() for t in configs.values()))
        best = {b: min(t[b] for t in configs.values() if b in t) for b in batches}
        full = {k: t for k, t in configs.items() if set(t) == batches}
        if not full:
            continue
        score = {k: math.exp(statistics.mean(math.log(t[b] / best[b]) for b in batches)) for k, t in full.items()}
        key = min(score, key=score.get)
        winners[label] = {"config": dict(key), "ms": full[key], "best_ms": best, "slowdown_vs_best": score[key]}
    return winners


def print_winners(winners):
    if not winners:
        return
    print("\n(winners) per format, best geometric mean over the tuned batches; paste into "
          "kvlab/kernels/formats.py (TUNED_CONFIGS) and kvlab/kernels/decode.py (DEFAULT_VARIANT):")
    items = []
    for label, w in winners.items():
        c = w["config"]
        times = ", ".join(f"B{b} {w['ms'][b]:.4f} ms (best {w['best_ms'][b]:.4f})" for b in sorted(w["ms"]))
        print(f"  {label}: {config_text(c)}  {times}")
        items.append(f'"{label}": LaunchConfig(block_n={c["block_n"]}, num_warps={c["num_warps"]}, '
                     f'num_stages={c["num_stages"]}, programs_per_sm={c["programs_per_sm"]}, variant="{c["variant"]}")')
    print("TUNED_CONFIGS: dict[str, LaunchConfig] = {" + ", ".join(items) + "}")
    wins = collections.Counter(w["config"]["variant"] for w in winners.values())
    top = max(wins, key=lambda v: (wins[v], v != "split"))  # a tie goes to a fold kernel
    print(f'DEFAULT_VARIANT = "{top}"  # wins per variant over the tuned formats: {dict(wins)}; formats not '
          "tuned run it (fold_asm runs fold off int4)")


def fmt_ms(x):
    return f"{x:8.4f}" if isinstance(x, float) else f"{'-':>8}"


def print_correctness(rows):
    print("\n(a) kernel vs float32 reference")
    print("(the kernel writes q's dtype, bf16 here: its rounding alone is ~2e-3 relative)")
    print(f"{'format':<10} {'kern':<5} {'D':>4} {'B':>3} {'GQA':>3} {'length':>6} {'cap':>6} {'max|err|':>10} "
          f"{'rel err':>10} {'unwritten':>9}")
    for r in rows:
        head = (f"{r.get('label', r['format']):<10} {r.get('variant', '-'):<5} {r['head_dim']:>4} {r['batch']:>3} "
                f"{r['gqa']:>3} {r['length']:>6} {r['capacity']:>6}")
        if r["status"] != "ok":
            print(f"{head} FAILED {r['error'][:120]}")
            continue
        print(f"{head} {r['max_abs_err']:10.2e} {r['rel_err']:10.2e} {r['unwritten']:>9}")
    for variant in sorted({r.get("variant") for r in rows if r.get("variant")}):
        ok = [r for r in rows if r["status"] == "ok" and r["variant"] == variant]
        failed = [r for r in rows if r["status"] != "ok" and r.get("variant") == variant]
        if ok:
            print(f"worst {variant}: max|err| {max(r['max_abs_err'] for r in ok):.2e}, "
                  f"rel {max(r['rel_err'] for r in ok):.2e}, unwritten {sum(r['unwritten'] for r in ok)}; "
                  f"failed cases: {len(failed)}")


def print_performance(rows, copy_gbps, read_gbps=None):
    print(f"\n(b) decode attention, Hq/Hkv/D = 32/8/128 (read-only stream {read_gbps or 0:.0f} GB/s; "
          f"copy bandwidth {copy_gbps or 0:.0f} GB/s, read + write)")
    print(f"{'format':<10} {'B':>3} {'kern':<5} {'len/cap':>11} {'MB read':>8} {'kernel':>8} {'graph':>8} {'GB/s':>6} "
          f"{'of read':>7} {'read B':>6} {'of copy':>7} {'same B':>6} {'x floor':>7} {'rel err':>8} {'sdpa':>8} "
          f"{'sdpa gr':>8} {'deq+sdpa':>8} {'splits':>6}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['format']:<10} {r['batch']:>3} {r.get('variant', '-'):<5} FAILED {r['error'][:120]}")
            continue
        print(f"{r['label']:<10} {r['batch']:>3} {r['variant']:<5} {r['length']:>5}/{r['capacity']:<5} "
              f"{r['kv_bytes'] / 1e6:8.1f} {fmt_ms(r.get('kernel_ms'))} {fmt_ms(r.get('kernel_graph_ms'))} "
              f"{r['kernel_GBps']:6.0f} {r.get('of_read_bw', 0):7.2f} {r.get('of_read_same_bytes', 0):6.2f} "
              f"{r.get('of_copy_bw', 0):7.2f} {r.get('of_copy_same_bytes', 0):6.2f} "
              f"{r.get('x_floor', 0):7.2f} {r['rel_err']:8.1e} {fmt_ms(r.get('sdpa_ms'))} "
              f"{fmt_ms(r.get('sdpa_graph_ms'))} {fmt_ms(r.get('dequant_sdpa_ms'))} {r['num_splits']:>6}")
    print("times in ms per call; GB/s from the faster of eager and graph; of read = GB/s over the large read-only "
          "stream's (a reduction); read B = over a read-only stream of the same bytes in this case; "
          "of copy = GB/s over the large copy's; "
          "same B = over a copy of the same bytes in this case; x floor = time over half that copy; "
          "sdpa = bf16 SDPA on the bf16 row's "
          "buffers; deq+sdpa = dequantize the prefix to bf16, then SDPA")
    pairs = {}
    for r in rows:
        if r["status"] == "ok":
            pairs.setdefault((r["label"], r["batch"], r["capacity"]), {})[r["variant"]] = best_ms(r)
    lines = [f"  {label:<10} B{batch:<3} cap {cap:<6} split {t['split']:.4f}  "
             + "  ".join(f"{v} {t[v]:.4f} ({t[v] / t['split']:.2f}x)" for v in VARIANTS if v != "split" and v in t)
             for (label, batch, cap), t in pairs.items() if "split" in t and len(t) > 1]
    if lines:
        print("variants vs split (default launch configs, faster of eager and graph; ms and time ratio):")
        print("\n".join(lines))


class Results:
    """The JSON result, rewritten after every row so that a run cut short still leaves its numbers."""

    def __init__(self, path: Path, result: dict):
        self.path, self.result = path, result

    def add(self, section: str, row: dict) -> None:
        self.result.setdefault(section, []).append(row)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        tmp.replace(self.path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="write the JSON results here (rewritten after every row)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto", choices=["auto", "triton", "reference"])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test of the script)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["correctness", "performance", "write"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="kernels to check and time side by side (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--copy-gib", type=float, default=4.0)
    ap.add_argument("--geometry", choices=("format", "default"), default="format",
                    help="the performance section's launch geometry: each format's own (TUNED_CONFIGS, what the "
                         "engines run; the default since 2026-12-06) or LaunchConfig's defaults for all (64 slots, "
                         "4 warps, 2 stages, 4 programs per SM: the reports before 2026-12-06)")
    ap.add_argument("--tune", action="store_true",
                    help="also time launch-config grids (every variant, batch 1/16/32; ~3-4 min) and print "
                         "the winners as TUNED_CONFIGS")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the kernels one call launches (split step vs reduce) at batch 1/16/32 (CUDA)")
    ap.add_argument("--tune-variants", nargs="+", default=list(TUNE_VARIANTS), choices=list(VARIANTS),
                    help=f"kernels whose launch-config grids --tune times (default: {' '.join(TUNE_VARIANTS)})")
    ap.add_argument("--tune-formats", nargs="+", default=list(TUNE_FORMATS),
                    help=f"format labels to tune (default: {' '.join(TUNE_FORMATS)})")
    args = ap.parse_args()
    t0 = time.perf_counter()
    clock = Clock(args.device)
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "card": device_card(args.device), "torch": torch.__version__, "args": vars(args)}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    print(f"{result['device']}: torch {result['torch']}, triton {result['triton']}")
    results = Results(Path(args.out), result)
    results.save()

    if "correctness" not in args.skip:
        for i, case in enumerate(correctness_cases(args.quick)):
            for row in run_correctness(case, args.device, args.backend, args.seed + i, args.variants):
                results.add("correctness", row)
        print_correctness(result.get("correctness", []))
        print(f"[{time.perf_counter() - t0:.0f} s]")

    copy_gbps = read_gbps = None
    l2 = l2_bytes(args.device)
    result["l2_bytes"] = l2
    if "performance" not in args.skip or args.tune:
        try:
            copy_gbps = copy_bandwidth(args.device, clock, 0.0625 if args.quick else args.copy_gib)
            read_gbps = read_bandwidth(args.device, clock, 0.0625 if args.quick else args.copy_gib)
        except Exception as err:  # noqa: BLE001
            result["copy_error"] = f"{type(err).__name__}: {err}"
        result["copy_GBps"] = copy_gbps
        result["read_GBps"] = read_gbps

    if "performance" not in args.skip:
        iters, repeats = (2, 2) if args.quick else (50, 5)
        for case in performance_cases(args.quick):
            run_performance(case, geometry_configs(case, args.variants, args.geometry), args.device, args.backend,
                            clock, copy_gbps, args.seed, l2, iters, repeats,
                            on_row=lambda row: results.add("performance", row), read_gbps=read_gbps)
        print_performance(result.get("performance", []), copy_gbps, read_gbps)
        print(f"[{time.perf_counter() - t0:.0f} s]")

    if args.tune:
        iters, repeats = (2, 1) if args.quick else (20, 3)
        for case in tune_cases(args.quick, args.tune_formats):
            run_performance(case, tune_configs(case, args.quick, args.tune_variants), args.device, args.backend,
                            clock, copy_gbps, args.seed, l2, iters, repeats, baselines=False, read_gbps=read_gbps,
                            on_row=lambda row: results.add("tune", row))
        print_tune(result.get("tune", []))
        result["winners"] = pick_winners(result.get("tune", []))
        result["winners_by_variant"] = {v: pick_winners(result.get("tune", []), variant=v) for v in VARIANTS}
        results.save()
        print_winners(result["winners"])
        for variant, winners in result["winners_by_variant"].items():
            print(f"  best {variant}: " + "; ".join(
                f"{label} block {w['config']['block_n']} warps {w['config']['num_warps']} stages "
                f"{w['config']['num_stages']} per SM {w['config']['programs_per_sm']}: "
                + ", ".join(f"B{b} {ms:.4f}" for b, ms in sorted(w["ms"].items())) for label, w in winners.items()))
        print(f"[{time.perf_counter() - t0:.0f} s]")

    if args.profile and args.device.startswith("cuda"):
        for case in tune_cases(args.quick, args.tune_formats):
            configs = [LaunchConfig(variant=v) for v in args.variants]
            winner = result.get("winners", {}).get(format_label(case["format"], case["group"]))
            if winner:
                configs.append(LaunchConfig(**winner["config"]))
            try:
                rows = profile_kernels(case, configs, args.device, args.backend, args.seed, l2)
            except Exception as err:  # noqa: BLE001
                rows = [dict(case, status="failed", error=f"{type(err).__name__}: {err}", label=case["format"],
                             variant="-", config={"block_n": 0})]
            for row in rows:
                results.add("profile", row)
        print_profile(result.get("profile", []))

    if "write" not in args.skip:
        iters, repeats = (2, 2) if args.quick else (50, 5)
        cases = [{"format": name, "group": group, "batch": batch, "kv_heads": 2 if args.quick else 8,
                  "capacity": 300 if args.quick else 16384}
                 for batch in ((1, 2) if args.quick else (1, 16, 32)) for name, group in FORMATS]
        for case in cases:
            results.add("write", run_write(case, args.device, args.backend, clock, args.seed, iters, repeats))
        print_write(result.get("write", []))

    result["elapsed_s"] = time.perf_counter() - t0
    results.save()
    print(f"\nwrote {args.out} in {result['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
