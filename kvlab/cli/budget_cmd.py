"""`kvlab budget`: cache bytes, compression, capacity and the decode byte floor for one setting."""

from __future__ import annotations

import json
import math
import sys

from kvlab.budget import (
    DEFAULT_RESERVE_BYTES,
    BudgetError,
    budget_report,
    check_bits,
    check_positive,
    context_problem,
    get_gpu,
)
from kvlab.models import get_spec
from kvlab.yamlfile import load_yaml


def register(sub) -> None:
    p = sub.add_parser("budget", help="KV-cache byte budget for a model, context and format")
    p.add_argument("--model", required=True, help="preset name or local model folder")
    p.add_argument("--ctx", type=int, default=None, help="prompt length in tokens (or --ctx-dist)")
    p.add_argument("--ctx-dist", default=None, metavar="YAML",
                   help="a context-length distribution, as a sweep's ctx: e.g. '{dist: lognormal, median: 4096, "
                        "sigma: 0.6}' or '{file: lengths.txt}' (expected bytes over it)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--bits", type=int, default=16, choices=[16, 8, 4, 3, 2, 1], help="stored bits per K/V element")
    p.add_argument("--group-size", type=int, default=64, help="quantization group size (scale + zero per group)")
    p.add_argument("--residual", type=int, default=None,
                   help=f"recent tokens a quantized cache keeps in 16-bit (default {DEFAULT_RESIDUAL}; needs --bits below 16)")
    p.add_argument("--keep", type=float, default=1.0, help="eviction keep ratio of the prompt cache, in (0, 1]")
    p.add_argument("--new-tokens", type=int, default=0, help="generated tokens appended uncompressed")
    p.add_argument("--gpu", help="GPU preset: rtx-a6000, rtx-4090, a100-80gb, h100-sxm, h200")
    p.add_argument("--bandwidth", type=float, help="memory bandwidth in GB/s (instead of --gpu)")
    p.add_argument("--memory", type=float, help="GPU memory in GB (instead of --gpu)")
    p.add_argument("--reserve", type=float, default=None, help="activation reserve in GiB (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


DEFAULT_RESIDUAL = 128


def check_flags(args) -> None:
    """What the flags cannot mean together, or a value no finite positive reading takes: one line."""
    if (args.ctx is None) == (args.ctx_dist is None):
        raise BudgetError("give --ctx N (one length) or --ctx-dist '{dist: lognormal, median: 4096, sigma: 0.6}'")
    check_positive("--batch", args.batch)
    if args.residual is not None:
        if args.residual < 0:
            raise BudgetError(f"--residual must be >= 0 tokens (kept at full precision), got {args.residual}")
        if args.bits >= 16:
            raise BudgetError(f"--residual {args.residual}: only a quantized cache keeps a 16-bit residual; add --bits "
                              f"4 (or 8, 3, 2, 1), or drop --residual")
    if args.gpu is not None:
        if not args.gpu.strip():
            raise BudgetError("--gpu '' names no GPU; give a preset (rtx-a6000, rtx-4090, a100-80gb, h100-sxm, h200) "
                              "or drop --gpu")
        both = [flag for flag, value in (("--bandwidth", args.bandwidth), ("--memory", args.memory)) if value is not None]
        if both:
            raise BudgetError(f"--gpu {args.gpu} and {' and '.join(both)}: the preset sets bandwidth and memory; "
                              f"give --gpu, or --bandwidth and --memory, not both")
    for flag, value, what in (("--bandwidth", args.bandwidth, "a finite positive number of GB/s"),
                              ("--memory", args.memory, "a finite positive number of GB"),
                              ("--reserve", args.reserve, "a finite number of GiB >= 0")):
        if value is not None and not (math.isfinite(value) and (value > 0 or (flag == "--reserve" and value == 0))):
            raise BudgetError(f"{flag} must be {what}, got {value:g}")


def run(args) -> int:
    check_flags(args)
    if args.residual is None:
        args.residual = DEFAULT_RESIDUAL
    spec = get_spec(args.model)
    gpu = get_gpu(args.gpu) if args.gpu else None
    if args.ctx_dist is not None:
        return run_distribution(args, spec, gpu)
    check_positive("--ctx", args.ctx)
    problem = context_problem(spec, args.ctx, max(args.new_tokens, 0), key="--ctx", new_key="--new-tokens")
    if problem:
        raise BudgetError(problem)
    report = budget_report(
        spec, args.ctx, batch=args.batch, bits=args.bits, group_size=args.group_size,
        residual=args.residual, keep=args.keep, new_tokens=args.new_tokens, gpu=gpu,
        bandwidth_bytes_per_s=args.bandwidth * 1e9 if args.bandwidth is not None else None,
        memory_bytes=args.memory * 1e9 if args.memory is not None else None,
        reserve_bytes=args.reserve * 1024**3 if args.reserve is not None else DEFAULT_RESERVE_BYTES,
    )
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(report))
    return 0


def run_distribution(args, spec, gpu) -> int:
    """``--ctx-dist``: the budget averaged over the distribution's lengths (kvlab.workload_budget).
    Its modules load here: kvlab.workload's pydantic would add about 0.15 s of imports to ``--ctx N``."""
    from kvlab.workload import parse_distribution
    from kvlab.workload_budget import distribution_budget, format_distribution

    try:
        data = load_yaml(args.ctx_dist, "--ctx-dist", BudgetError)
    except BudgetError as err:
        if "not valid YAML" not in str(err):  # a duplicate key, or past a bound: its own line
            raise
        data = None
    if not isinstance(data, dict):
        raise BudgetError(f"--ctx-dist {args.ctx_dist!r}: write a mapping, e.g. '{{dist: lognormal, median: 4096, "
                          f"sigma: 0.6}}' or '{{file: lengths.txt}}'")
    dist = parse_distribution(data, key="--ctx-dist")
    check_bits(args.bits, key="--bits")
    memory = args.memory * 1e9 if args.memory is not None else (gpu.memory_bytes if gpu else None)
    window = spec.max_context - max(args.new_tokens, 0)
    problem = dist.window_problem(window, f"{spec.name}'s window {spec.max_context} minus --new-tokens {args.new_tokens}", key="--ctx-dist")
    if problem:
        raise BudgetError(problem)
    lengths = dist.population(window)
    note = dist.clip_note(dist.population(), window, f"{spec.name}'s window {spec.max_context} minus --new-tokens "
                                                     f"{args.new_tokens}", key="--ctx-dist")
    if note:
        print(f"kvlab budget: note: {note}", file=sys.stderr)
    report = distribution_budget(
        spec, lengths, dist.label, batch=args.batch, bits=args.bits, group_size=args.group_size,
        residual=args.residual, keep=args.keep, new_tokens=args.new_tokens, memory_bytes=memory,
        reserve_bytes=args.reserve * 1024**3 if args.reserve is not None else DEFAULT_RESERVE_BYTES)
    print(json.dumps(report) if args.json else format_distribution(report))
    return 0


def _gib(b: float) -> str:
    return f"{b / 1024**3:,.3f} GiB ({b / 1e9:,.2f} GB)"


def format_table(r: dict) -> str:
    fmt = "bf16/fp16" if r["bits"] >= 16 else f"{r['bits']}-bit, group {r['group_size']}, residual {r['residual']}"
    lines = [
        f"model                {r['model']} ({r['dtype']})",
        f"setting              ctx {r['ctx']:,} x batch {r['batch']}, keep {r['keep']}, {fmt}",
        f"KV bytes / token     {r['bytes_per_token']:,.1f}",
        f"cache                {_gib(r['cache_bytes'])}   (16-bit: {_gib(r['cache_bytes_full'])})",
        f"compression ratio    {r['compression_ratio']:.2f}x",
        f"weights              {_gib(r['weights_bytes'])}",
        f"decode step reads    {_gib(r['decode_bytes_per_step'])} "
        f"(KV {r['decode_kv_bytes_per_step'] / r['decode_bytes_per_step']:.1%}; "
        f"saves {r['decode_bytes_saved_fraction']:.1%} vs 16-bit full cache)",
    ]
    if "decode_floor_ms" in r:
        lines.append(f"decode floor         {r['decode_floor_ms']:.2f} ms/step at {r['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s"
                     + (f" ({r['gpu']})" if r["gpu"] else ""))
    if "max_batch" in r:
        verdict = "fits" if r["fits"] else "does NOT fit"
        lines.append(f"capacity             max batch {r['max_batch']} at this ctx, max ctx {r['max_context']:,} "
                     f"at this batch ({_gib(r['memory_bytes'])} minus weights and "
                     f"{r['reserve_bytes'] / 1024**3:.1f} GiB reserve): batch {r['batch']} {verdict}")
    return "\n".join(lines)
