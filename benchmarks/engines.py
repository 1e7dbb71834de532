"""hf vs fast engine, side by side in one process: ms per decode step, decode J/token, HBM floor.

For the H200 (issue #12), e.g.

    python benchmarks/engines.py --batch 1 --ctx 16384 --new-tokens 256 --repeats 3 --out $OUT/engines-b1.json

Per batch size: loads the model once (Llama-3.1-8B shape, synthetic bf16 weights unless --model
says otherwise), measures the device copy bandwidth, then for every (method, engine) pair one
warm-up run (the exact shape: CUDA graph capture, cuDNN plans, quanto's build) and ``repeats``
measured runs in a seeded shuffled order per repeat, all through ``kvlab.measure`` (the sweep's
harness, NVML energy counter). Prints per pair: median ms/step (ITL), decode J/token (mean and
95% bootstrap CI over repeats), the HBM floor ((weight + KV bytes) / copy bandwidth) and the
ratio to it; then the fast/hf ratio per method, and the fast engine's logit error and top-1
agreement against hf (teacher-forced, bf16). Every row, failures included, goes to ``--out``.

``--prefill-rows N`` prefills the fast engines' batch N sequences at a time into their static
buffers (``kvlab.engine.fast.FastDecoder.prefill``), so a batch whose whole-batch prefill cache does
not fit beside the store still runs, e.g. batch 32 at 16k:

    python benchmarks/engines.py --batch 32 --ctx 16384 --new-tokens 64 --repeats 1 --max-decoders 1 \
        --methods full fp8 quanto4 --engines fast --compare-steps 0 --prefill-rows 4 --out $OUT/engines-b32.json

hf rows cannot prefill in row groups: with a batch above N they are refused (use ``--engines fast``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import traceback

import torch

# fast-engine variants: FastEngine keyword arguments
FAST_VARIANTS = {
    "fast": {},  # the engine's defaults (on CUDA: layers compiled, inside kvlab's graph)
    "fast-deq": {"quant_attention": "dequantize"},
    "fast-eager": {"compile": "none"},
    "fast-layers": {"compile": "layers"},
    "fast-ro": {"compile": "reduce-overhead"},
    "fast-triton": {"attention": "triton"},  # bf16 cache read by kvlab's split-K kernel, not flash
}

METHODS = {
    "full": ("full", {}),
    "snapkv10": ("snapkv", {"keep": 0.1}),
    "pyramidkv10": ("pyramidkv", {"keep": 0.1}),
    "quanto4": ("quanto", {"nbits": 4}),
    "fp8": ("fp8", {}),
    "kvq4": ("kvq-int4", {}),
    "kivi": ("kivi", {}),
    "quest": ("quest", {}),
}


def copy_bandwidth(device: str, gib: float = 4) -> float:
    """Device-to-device copy, bytes read + written per second (median; on CPU a 64 MiB memcpy)."""
    n = int((gib if device.startswith("cuda") else 1 / 16) * 2**30)
    bufs = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2)]
    ms = median_ms(lambda: bufs[1].copy_(bufs[0]), device, iters=2, repeats=7, graph=False)
    bufs.clear()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def median_ms(fn, device: str, iters: int = 20, repeats: int = 5, graph: bool = True) -> float:
    """Median milliseconds of ``fn()``: CUDA events on a GPU (``fn`` replayed from a CUDA graph, so
    launches do not count; ``graph=False`` launches it directly), perf_counter on CPU. Copies are
    timed without a graph: a captured 4 GiB copy ran at 2.77 TB/s (read + write) on the H200, below
    the 4.14 TB/s the flash kernel read in the same call and the 4.26 TB/s an uncaptured copy gave
    (reports/h200-2026-12-03f)."""
    if not device.startswith("cuda"):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / iters)
        return statistics.median(times)
    if not graph:
        fn()
        return _event_median_ms(fn, iters, repeats)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        fn()
    return _event_median_ms(captured.replay, iters, repeats)


def _event_median_ms(run, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of ``iters`` back-to-back ``run()`` calls between two CUDA events."""
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def copy_same_bytes_ms(nbytes: float, device: str, cap_bytes: int = 2**31) -> float:
    """Milliseconds of a device-to-device copy of ``nbytes`` in this run: a buffer of at most
    ``cap_bytes`` copied (scaled per byte when ``nbytes`` is larger, so that a batch-16 bf16 cache is
    not allocated twice more beside the store)."""
    n = max(1, int(min(nbytes, cap_bytes)))
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), device, iters=10, graph=False) * nbytes / n


def attention_kernel_bandwidth(decoder, ctx: int, device: str, copy_gbps: float | None) -> dict:
    """One step's attention kernels alone, over every layer of a fast decoder's store (each layer's
    own buffers, so L2 cannot serve them), ``ctx`` slots per sequence: ms, the KV bytes they read, and
    those bytes' GB/s as a fraction of a copy of the same bytes timed here (:func:`kvlab.budget.bandwidth_fields`).
    The new token's write is not included; the store's content is whatever the last run left."""
    from kvlab.budget import bandwidth_fields
    from kvlab.kernels import decode_attention
    from kvlab.storage.dense import DenseStore
    from kvlab.storage.slots import flash_decode, sdpa_decode, segment_lengths

    store, layout, step = decoder.store, decoder.layout, decoder.step_fn
    b, hq, d = layout.batch, step.num_heads, layout.head_dim
    n = min(ctx, min(layout.capacity))
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = next(decoder.model.parameters()).dtype
    q = torch.randn(b, hq, d, device=device, generator=gen).to(dtype)
    used = torch.full((b,), n, dtype=torch.int32, device=device)
    length = torch.tensor([n], device=device)
    layers = range(len(layout.kept))
    if isinstance(store, DenseStore):
        q4 = q.unsqueeze(2)
        if store.attention == "flash":
            segments = segment_lengths(used, layout.kv_heads)

            def run():
                for i in layers:
                    flash_decode(q4, store.keys[i], store.values[i], segments, store.scale, *store.offsets[i],
                                 splits=store.splits)
        else:
            def run():
                for i in layers:
                    sdpa_decode(q4, store.keys[i], store.values[i], length, store.scale)
    else:
        def run():
            for i in layers:
                decode_attention(q, store.keys[i], store.values[i], used, store.scale, workspace=store.workspaces[i])
    nbytes = n * b * len(layout.kept) * store.bytes_per_slot()
    kernel_ms = median_ms(run, device)
    out = {"attention": store.attention, "kv_format": store.kv_format, "slots": n, "kv_bytes": nbytes,
           "kernel_ms": kernel_ms, "kernel_ms_per_layer": kernel_ms / len(layout.kept)}
    out.update(bandwidth_fields(nbytes, kernel_ms, copy_same_bytes_ms(nbytes, device), copy_gbps))
    return out


def force_kernel_variant(variant: str) -> None:
    """Every fused store built from now on runs ``variant`` (tuned configs keep their block sizes)."""
    import dataclasses

    from kvlab.kernels import decode, formats

    decode.DEFAULT_VARIANT = variant
    formats.TUNED_CONFIGS = {label: dataclasses.replace(c, variant=None) for label, c in formats.TUNED_CONFIGS.items()}


def load_launch_configs(path: str, variant: str | None = None) -> None:
    """Install the per-format winners of a quant_attention.py --tune run as kvlab's tuned launch configs
    (``variant``: the winners among that kernel's configs)."""
    from kvlab.kernels import LaunchConfig, formats

    with open(path) as f:
        tuned = json.load(f)
    by_variant = tuned.get("winners_by_variant") or {}
    winners = by_variant.get(variant) if variant else tuned.get("winners")
    if variant in ("fold_asm", "warp", "warp_asm"):  # formats they do not read run fold, with fold's winners
        winners = {**by_variant.get("fold", {}), **(winners or {})}
    if not winners:
        raise SystemExit(f"{path} has no winners{f' for {variant}' if variant else ''}: run "
                         "benchmarks/quant_attention.py with --tune")
    formats.TUNED_CONFIGS = {label: LaunchConfig(**w["config"]) for label, w in winners.items()}
    print(f"launch configs from {path}: {formats.TUNED_CONFIGS}", flush=True)


def bootstrap_ci(values: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    from kvlab.metrics import bootstrap_ci as ci

    _, lo, hi = ci(values, n_boot=n, seed=seed)
    return lo, hi


def ratio_ci(a: list[float], b: list[float], n: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """mean(a)/mean(b) with a 95% bootstrap interval (independent resamples)."""
    rng = random.Random(seed)
    point = statistics.fmean(a) / statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return point, float("nan"), float("nan")
    draws = sorted(statistics.fmean(rng.choices(a, k=len(a))) / statistics.fmean(rng.choices(b, k=len(b)))
                   for _ in range(n))
    return point, draws[int(0.025 * n)], draws[int(0.975 * n) - 1]


def main() -> int:
    from kvlab.kernels.formats import VARIANTS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--weights", default="synthetic")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--engines", nargs="+", default=["hf", "fast"], choices=list(FAST_VARIANTS) + ["hf"],
                    help="fast-deq: the fast engine with quantized stores dequantized before attention; "
                         "fast-eager / fast-layers: the step's layers eager / compiled by torch.compile, "
                         "inside kvlab's graph (fast: the engine's default); "
                         "fast-ro: the whole step compiled with mode='reduce-overhead' (torch's graphs)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS replays of each fast variant's full-cache step (kernels by "
                         "category and the top kernels)")
    ap.add_argument("--profile-methods", nargs="+", default=["full"], choices=list(METHODS), metavar="METHOD",
                    help="the methods --profile profiles (default: full; each must be in --methods)")
    ap.add_argument("--attention", default="auto", help="fast engine attention: auto, flash, sdpa")
    ap.add_argument("--max-decoders", type=int, default=8, help="fast-engine layouts kept alive (1 at large batch)")
    ap.add_argument("--prefill-rows", type=int, default=None, metavar="N",
                    help="fast engines: prefill N sequences at a time into the static buffers (one group's "
                         "prefill cache at a time; default: the whole batch at once); hf refuses a batch above N")
    ap.add_argument("--kernel-bw", action=argparse.BooleanOptionalAction, default=True,
                    help="per method and fast variant, time one step's attention kernels alone against a copy of "
                         "the same bytes (kernel_bw rows: of_copy_same_bytes, x_floor)")
    ap.add_argument("--compare-steps", type=int, default=32, help="teacher-forced steps for the logit check")
    ap.add_argument("--kernel-variant", choices=list(VARIANTS), default=None,
                    help="fused quantized attention's split kernel for every format (default: kvlab's "
                         "DEFAULT_VARIANT and TUNED_CONFIGS)")
    ap.add_argument("--launch-configs", default=None,
                    help="a benchmarks/quant_attention.py --tune JSON: its winners become the tuned launch configs")
    ap.add_argument("--out", default="engines.json")
    args = ap.parse_args()
    if args.profile and set(args.profile_methods) - set(args.methods):
        ap.error(f"--profile-methods {' '.join(args.profile_methods)}: each must also be in --methods "
                 f"({' '.join(args.methods)})")
    if args.prefill_rows is not None:
        if args.prefill_rows < 1:
            ap.error(f"--prefill-rows {args.prefill_rows}: give a number of sequences >= 1")
        if "hf" in args.engines and any(b > args.prefill_rows for b in args.batch):
            ap.error(f"--prefill-rows {args.prefill_rows} with hf at batch {max(args.batch)}: transformers' decode "
                     f"cache cannot be put together from row groups; drop hf from --engines (or run it apart)")
    if args.kernel_variant:
        force_kernel_variant(args.kernel_variant)
    if args.launch_configs:
        load_launch_configs(args.launch_configs, args.kernel_variant)

    from kvlab.budget import DecodeBytes
    from kvlab.energy import make_sampler
    from kvlab.engine.compare import compare_engines
    from kvlab.engine.engines import make_engine
    from kvlab.measure import make_prompt, measure_generation
    from kvlab.models import load_model
    from kvlab.policies import make_policy

    t_start = time.time()
    from kvlab.kernels import decode, formats

    result: dict = {"args": vars(args), "torch": torch.__version__, "rows": [], "compare": [],
                    "kernel_variant": decode.DEFAULT_VARIANT,
                    "tuned_configs": {k: vars(c) for k, c in formats.TUNED_CONFIGS.items()}}
    cuda = args.device.startswith("cuda")
    result["gpu"] = torch.cuda.get_device_name() if cuda else None
    bw = copy_bandwidth(args.device)
    result["copy_bandwidth_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)

    sampler = make_sampler(args.device)
    for batch in args.batch:
        loaded = load_model(args.model, weights=args.weights, device=args.device)
        weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        engines = {"hf": make_engine("hf", loaded)}
        for name in args.engines:
            if name in FAST_VARIANTS:
                engines[name] = make_engine("fast", loaded, **{"attention": args.attention, "max_decoders": args.max_decoders,
                                                      **FAST_VARIANTS[name]})
        policies = {}
        for name in args.methods:
            method, kw = METHODS[name]
            try:
                p = make_policy(method, **kw)
                p.check(loaded)
                p.prepare(loaded.model)
                if "hf" in args.engines:  # transformers-side kernels (quanto's build); fast needs none
                    p.warmup(loaded.model)
                policies[name] = p
            except Exception as err:
                result["rows"].append({"method": name, "batch": batch, "status": "failed", "error": repr(err)})
                print(f"{name}: setup failed: {err!r}", flush=True)
        pairs = [(m, e) for m in policies for e in args.engines
                 if not (e == "fast-deq" and policies[m].storage().kv_format == "model dtype")]
        ids = make_prompt(loaded, args.ctx, batch, 0, 0)
        for rep in range(-1, args.repeats):  # -1: the warm-up pass, never recorded
            order = list(pairs)
            random.Random(f"{batch}-{rep}").shuffle(order)
            for name, engine in order:
                row = {"method": name, "engine": engine, "batch": batch, "ctx": args.ctx, "repeat": rep}
                try:
                    if rep < 0 and engine != "hf":  # capture (or compile) time, outside any window
                        t0 = time.perf_counter()
                        engines[engine].decoder(policies[name], batch, args.ctx, args.new_tokens)
                        torch.cuda.synchronize() if cuda else None
                        setup_s = time.perf_counter() - t0
                        result.setdefault("setup", []).append({"method": name, "engine": engine, "batch": batch,
                                                               "decoder_build_s": setup_s})
                        print(f"b{batch} {name} {engine}: decoder built in {setup_s:.1f} s", flush=True)
                    m = measure_generation(loaded, policies[name], ctx=args.ctx, batch=batch,
                                           new_tokens=args.new_tokens, sampler=sampler, input_ids=ids,
                                           engine=engines[engine],
                                           prefill_rows=None if engine == "hf" else args.prefill_rows)
                    r = m.record
                    kv_bytes = r.get("cache_bytes") or 0
                    floor_ms = DecodeBytes(weight_bytes, kv_bytes).floor_s(bw) * 1000 if bw else None
                    row.update(status="ok", ms_step=r["itl_median_ms"], itl_mean_ms=r["itl_mean_ms"],
                               decode_j_per_token=r.get("decode_j_per_token"), prefill_s=r["prefill_s"],
                               peak_mem_bytes=r.get("peak_mem_bytes"), cache_bytes=kv_bytes,
                               weight_bytes=weight_bytes, floor_ms=floor_ms,
                               x_floor=r["itl_median_ms"] / floor_ms if floor_ms else None,
                               kv_format=r.get("kv_format"), fast_attention=r.get("fast_attention"),
                               prefill_rows=r.get("prefill_rows"),
                               cuda_graph=r.get("cuda_graph"), energy_source=r.get("energy_source"),
                               tokens=m.tokens[:, :8].tolist())
                    del m
                except Exception as err:
                    row.update(status="failed", error=f"{type(err).__name__}: {err}",
                               trace=traceback.format_exc()[-1500:])
                    torch.cuda.empty_cache() if cuda else None
                if rep >= 0:
                    result["rows"].append(row)
                    with open(args.out, "w") as f:  # every measured row is kept, even if the call is cut
                        json.dump(result, f, indent=1)
                label = "warm-up" if rep < 0 else f"rep {rep}"
                if row["status"] == "ok":
                    j = row["decode_j_per_token"]
                    print(f"b{batch} {label:7s} {name:12s} {engine:4s} {row['ms_step']:8.2f} ms/step "
                          f"{j if j is None else round(j, 3)} J/tok  floor {row['floor_ms'] or 0:.2f} ms "
                          f"[{time.time() - t_start:.0f}s]", flush=True)
                else:
                    print(f"b{batch} {label} {name} {engine}: {row['error']}", flush=True)
        if args.kernel_bw:
            kernel_bandwidths(result, policies, engines, args, batch, bw)
        if args.profile:
            profile_variants(result, loaded, policies, engines, args, batch)
        if "fast" in args.engines and args.compare_steps:
            for name, p in policies.items():
                try:
                    c = compare_engines(loaded, p, ids[:1, :], args.compare_steps)
                    c.update(method=name, batch=1)
                except Exception as err:
                    c = {"method": name, "error": f"{type(err).__name__}: {err}"}
                result["compare"].append(c)
                print(f"compare {name}: {c}", flush=True)
        del loaded, engines, policies
        torch.cuda.empty_cache() if cuda else None
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    summarize(result)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def kernel_bandwidths(result: dict, policies: dict, engines: dict, args, batch: int, bw: float | None) -> None:
    """Per (method, fast variant) at this batch: the attention kernels of one step alone, as a
    fraction of copy bandwidth (:func:`attention_kernel_bandwidth`), in ``result["kernel_bw"]``."""
    for engine in [e for e in args.engines if e in FAST_VARIANTS]:
        for method, policy in policies.items():
            row = {"batch": batch, "method": method, "engine": engine, "ctx": args.ctx}
            try:
                decoder = engines[engine].decoder(policy, batch, args.ctx, args.new_tokens)
                row.update(attention_kernel_bandwidth(decoder, args.ctx, args.device,
                                                      bw / 1e9 if bw else None), status="ok")
                print(f"kernel b{batch} {method:12s} {engine:10s} {row['kv_format']:>11s} {row['attention']:>8s} "
                      f"{row['kernel_ms']:7.3f} ms/step {row['kernel_GBps']:6.0f} GB/s "
                      f"{row['of_copy_same_bytes']:.2f} of copy, {row['x_floor']:.2f}x floor", flush=True)
            except Exception as err:  # noqa: BLE001
                row.update(status="failed", error=f"{type(err).__name__}: {err}")
                print(f"kernel b{batch} {method} {engine}: {row['error']}", flush=True)
            result.setdefault("kernel_bw", []).append(row)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def profile_variants(result: dict, loaded, policies: dict, engines: dict, args, batch: int) -> None:
    """Where each fast variant's step goes, per ``--profile-methods`` method: kernels by category,
    then the largest kernels."""
    for engine, method in [(e, m) for e in args.engines if e in FAST_VARIANTS and e != "fast-deq"
                           for m in args.profile_methods if m in policies]:  # a failed setup is recorded
        try:
            a = engines[engine].anatomy(policies[method], args.ctx, batch, steps=args.profile)
        except Exception as err:
            result.setdefault("profiles", []).append({"engine": engine, "method": method, "batch": batch,
                                                      "error": repr(err)})
            print(f"profile {engine} {method}: {err!r}", flush=True)
            continue
        top = a.top_ops(20)
        kernels_per_step = float(a.ops["calls"].sum())
        result.setdefault("profiles", []).append({
            "engine": engine, "method": method, "batch": batch, "label": a.label, "wall_ms": a.wall_ms, "busy_ms": a.busy_ms,
            "by_category": a.by_category, "kernels_per_step": kernels_per_step,
            "top": top.to_dict(orient="records")})
        print(f"\nprofile b{batch} {a.label}: wall {a.wall_ms:.2f} ms/step, kernels busy {a.busy_ms:.2f} ms, "
              f"{kernels_per_step:.0f} kernels/step", flush=True)
        for cat, ms in a.by_category.items():
            print(f"  {cat:24s} {ms:7.3f} ms")
        for r in top.itertuples():
            print(f"  {r.ms:7.3f} ms {r.calls:6.1f}x  {r.category:20s} {r.op[:90]}")
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def summarize(result: dict) -> None:
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["batch"], r["method"], r["engine"]), []).append(r)
    print("\nbatch method       engine  ms/step  floor  x floor  decode J/token (95% CI)")
    summary = []
    for (batch, method, engine), rs in sorted(groups.items()):
        ms = statistics.median(r["ms_step"] for r in rs)
        js = [r["decode_j_per_token"] for r in rs if r["decode_j_per_token"] is not None]
        floor = rs[0]["floor_ms"]
        j = statistics.fmean(js) if js else None
        lo, hi = bootstrap_ci(js) if len(js) > 1 else (float("nan"), float("nan"))
        summary.append({"batch": batch, "method": method, "engine": engine, "ms_step": ms, "floor_ms": floor,
                        "decode_j_per_token": j, "ci": [lo, hi], "n": len(rs)})
        print(f"{batch:5d} {method:12s} {engine:6s} {ms:8.2f} {floor or 0:6.2f} {ms / floor if floor else 0:7.2f}  "
              f"{j if j is None else f'{j:.3f} ({lo:.3f}-{hi:.3f})'}")
    result["summary"] = summary
    kernel = [r for r in result.get("kernel_bw", []) if r.get("status") == "ok"]
    if kernel:
        print("\nattention kernels alone (one step, every layer): batch method engine format  ms  GB/s  "
              "of copy (same bytes)  x floor")
        for r in kernel:
            print(f"{r['batch']:5d} {r['method']:12s} {r['engine']:10s} {r['kv_format']:>11s} {r['kernel_ms']:7.3f} "
                  f"{r['kernel_GBps']:6.0f} {r['of_copy_same_bytes']:6.2f} {r['x_floor']:7.2f}")
    print("\nratios (J/token, 95% CI over repeats)")
    ratios = []
    for batch in sorted({r["batch"] for r in rows}):
        def js(method, engine, b=batch):
            return [r["decode_j_per_token"] for r in groups.get((b, method, engine), [])
                    if r["decode_j_per_token"] is not None]
        for method in sorted({r["method"] for r in rows}):
            if js(method, "fast") and js(method, "hf"):
                ratios.append({"batch": batch, "what": f"{method}: fast / hf",
                               "ratio": ratio_ci(js(method, "fast"), js(method, "hf"))})
            for variant in ("fast-eager", "fast-layers", "fast-ro", "fast-triton"):
                if js(method, variant) and js(method, "fast"):
                    ratios.append({"batch": batch, "what": f"{method}: {variant} / fast",
                                   "ratio": ratio_ci(js(method, variant), js(method, "fast"))})
            for engine in ("hf", "fast", "fast-layers"):
                if method != "full" and js(method, engine) and js("full", engine):
                    ratios.append({"batch": batch, "what": f"{engine}: {method} / full",
                                   "ratio": ratio_ci(js(method, engine), js("full", engine))})
    for r in ratios:
        point, lo, hi = r["ratio"]
        print(f"  b{r['batch']:<3d} {r['what']:28s} {point:.3f} ({lo:.3f}-{hi:.3f})")
    result["ratios"] = ratios


if __name__ == "__main__":
    raise SystemExit(main())
