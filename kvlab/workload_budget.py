"""The byte budget over a context-length distribution: pure arithmetic on :mod:`kvlab.budget`.

Why: one synthetic length hides the tail. A fleet's cache memory is the expected bytes per request
times the requests in flight, while the longest requests decide whether a batch fits; and what a
compressed cache frees is worth the extra requests it lets in. Each length of the population (every
observed length of a file, or evenly spaced quantiles of a named shape) counts once.
"""

from __future__ import annotations

import math

from kvlab.budget import DEFAULT_RESERVE_BYTES, BudgetError, cache_bytes, free_bytes_for_cache, model_bits
from kvlab.models import ModelSpec
from kvlab.workload import CtxDistribution, parse_distribution


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation, as numpy's default)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution_budget(spec: ModelSpec, lengths: list[int], label: str, batch: int = 1, bits: int = 16,
                        group_size: int | None = 64, residual: int = 128, keep: float = 1.0,
                        new_tokens: int = 0, memory_bytes: float | None = None,
                        reserve_bytes: float = DEFAULT_RESERVE_BYTES) -> dict:
    """Expected cache bytes per request and for ``batch`` requests in flight, the tail, the share of
    memory the cache takes and what this format frees against the full 16-bit cache (bytes, share of
    memory, requests that fit), as one JSON-safe dict."""
    if not lengths:
        raise BudgetError("the distribution has no lengths")
    if batch < 1:
        raise BudgetError(f"batch must be a positive integer, got {batch}")
    full_bits = model_bits(spec)
    if bits >= full_bits:
        group_size, residual = None, 0
    kw = dict(bits=bits, group_size=group_size, residual=residual, keep=keep, new_tokens=new_tokens)
    per_len = [cache_bytes(spec, n, **kw) for n in lengths]
    per_len_full = [cache_bytes(spec, n, bits=full_bits, new_tokens=new_tokens) for n in lengths]
    mean = sum(per_len) / len(per_len)
    mean_full = sum(per_len_full) / len(per_len_full)
    out = {
        "model": spec.name, "dtype": spec.dtype, "ctx_dist": label, "lengths": len(lengths),
        "ctx_mean": sum(lengths) / len(lengths), "ctx_p50": quantile(lengths, 0.5),
        "ctx_p90": quantile(lengths, 0.9), "ctx_p99": quantile(lengths, 0.99), "ctx_max": max(lengths),
        "batch": batch, "bits": bits, "group_size": group_size, "residual": residual, "keep": keep,
        "new_tokens": new_tokens,
        "cache_bytes_per_request": mean, "cache_bytes_per_request_full": mean_full,
        "cache_bytes_p99_request": quantile(per_len, 0.99),
        "cache_bytes": batch * mean, "cache_bytes_full": batch * mean_full,
        "compression_ratio": mean_full / mean,
        "freed_bytes": batch * (mean_full - mean),
    }
    if memory_bytes is not None:
        if not memory_bytes > 0:
            raise BudgetError(f"memory must be positive, got {memory_bytes:g}")
        free = free_bytes_for_cache(spec, memory_bytes, reserve_bytes)
        out.update(
            memory_bytes=memory_bytes, reserve_bytes=reserve_bytes, free_for_cache_bytes=free,
            cache_share=batch * mean / memory_bytes, cache_share_full=batch * mean_full / memory_bytes,
            freed_share=batch * (mean_full - mean) / memory_bytes,
            requests_in_flight=max(0, math.floor(free / mean)),
            requests_in_flight_full=max(0, math.floor(free / mean_full)),
        )
        out["fits"] = out["requests_in_flight"] >= batch
    return out


def format_distribution(r: dict) -> str:
    """``kvlab budget --ctx-dist`` as text."""
    def gb(b: float) -> str:
        return f"{b / 1e9:,.2f} GB"

    fmt = "bf16/fp16" if r["bits"] >= 16 else f"{r['bits']}-bit, group {r['group_size']}, residual {r['residual']}"
    lines = [
        f"model                {r['model']} ({r['dtype']})",
        f"contexts             {r['ctx_dist']}: {r['lengths']:,} lengths, mean {r['ctx_mean']:,.0f}, "
        f"p50 {r['ctx_p50']:,.0f}, p90 {r['ctx_p90']:,.0f}, p99 {r['ctx_p99']:,.0f}, max {r['ctx_max']:,}",
        f"setting              batch {r['batch']}, keep {r['keep']}, {fmt}",
        f"cache per request    expected {gb(r['cache_bytes_per_request'])} (16-bit: "
        f"{gb(r['cache_bytes_per_request_full'])}); p99 {gb(r['cache_bytes_p99_request'])}",
        f"cache for the batch  expected {gb(r['cache_bytes'])} (16-bit: {gb(r['cache_bytes_full'])}), "
        f"{r['compression_ratio']:.2f}x smaller",
        f"compression frees    {gb(r['freed_bytes'])} for the batch",
    ]
    if "memory_bytes" in r:
        lines += [
            f"share of memory      cache {r['cache_share']:.1%} of {gb(r['memory_bytes'])} (16-bit: "
            f"{r['cache_share_full']:.1%}); frees {r['freed_share']:.1%}",
            f"requests in flight   {r['requests_in_flight']:,} expected-size requests fit after the weights and "
            f"reserve (16-bit: {r['requests_in_flight_full']:,}): batch {r['batch']} "
            + ("fits" if r["fits"] else "does NOT fit"),
        ]
    return "\n".join(lines)


def formats_over_distribution(spec: ModelSpec, dist, bits: tuple[int, ...] = (8, 4, 2), group_size: int | None = 64,
                              residual: int = 128, batch: int = 1, memory_bytes: float | None = None,
                              reserve_bytes: float = DEFAULT_RESERVE_BYTES, new_tokens: int = 0):
    """The full cache and each quantized width over a distribution (a :class:`kvlab.workload.
    CtxDistribution` or a mapping), one row each: expected GB per request and for the batch, the share
    of memory, what it frees and how many expected-size requests fit (the byte-budget notebook)."""
    import pandas as pd

    if not isinstance(dist, CtxDistribution):
        dist = parse_distribution(dict(dist))
    lengths = dist.population(spec.max_context - new_tokens)
    rows = []
    for b in (model_bits(spec), *sorted(set(bits) - {model_bits(spec)}, reverse=True)):
        r = distribution_budget(spec, lengths, dist.label, batch=batch, bits=b, group_size=group_size,
                                residual=residual, new_tokens=new_tokens, memory_bytes=memory_bytes,
                                reserve_bytes=reserve_bytes)
        row = {"format": spec.dtype if b >= model_bits(spec) else f"int{b}",
               "GB per request (expected)": r["cache_bytes_per_request"] / 1e9,
               "GB per request (p99)": r["cache_bytes_p99_request"] / 1e9,
               f"GB for batch {batch}": r["cache_bytes"] / 1e9, "frees GB": r["freed_bytes"] / 1e9}
        if memory_bytes is not None:
            row.update({"share of memory": r["cache_share"], "frees (share of memory)": r["freed_share"],
                        "requests in flight": r["requests_in_flight"]})
        rows.append(row)
    return pd.DataFrame(rows)
