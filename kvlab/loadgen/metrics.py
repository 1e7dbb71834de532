"""Per-request latencies from a replay's raw records, a run's summary, and the steady-state window's
energy (or CPU time) per request and per output token. Pure functions over records.

Definitions are vLLM's serving benchmark's (client side): TTFT = first chunk - send; E2E = last
chunk - send; TPOT = (E2E - TTFT) / (output tokens - 1); ITL = the gaps between chunks, pooled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


def request_latencies(rec: dict[str, Any]) -> dict[str, Any]:
    """``ttft_s``, ``e2e_s``, ``tpot_s`` and ``itl_s`` (list) of one ok record; None where undefined."""
    times, send = rec.get("token_times_s") or [], rec.get("send_s")
    if rec.get("status") != "ok" or not times or send is None:
        return {"ttft_s": None, "e2e_s": None, "tpot_s": None, "itl_s": []}
    ttft, e2e = times[0] - send, times[-1] - send
    out = rec.get("output_tokens") or len(times)
    return {"ttft_s": ttft, "e2e_s": e2e, "tpot_s": (e2e - ttft) / (out - 1) if out > 1 else None,
            "itl_s": [b - a for a, b in zip(times, times[1:], strict=False)]}


def _stats_ms(values: Sequence[float], name: str) -> dict[str, float | None]:
    arr = np.asarray([v for v in values if v is not None], dtype=float) * 1000.0
    out: dict[str, float | None] = {f"{name}_mean_ms": float(arr.mean()) if arr.size else None}
    for p in PERCENTILES:
        out[f"{name}_p{p}_ms"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def summarize(records: Sequence[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """Counts by status, throughputs over the whole replay, latency percentiles in ms."""
    ok = [r for r in records if r.get("status") == "ok"]
    lat = [request_latencies(r) for r in ok]
    out_tokens = sum(int(r.get("output_tokens") or len(r["token_times_s"])) for r in ok)
    summary: dict[str, Any] = {
        "requests": len(records), "completed": len(ok),
        "refused": sum(r.get("status") == "refused" for r in records),
        "failed": sum(r.get("status") == "failed" for r in records),
        "duration_s": duration_s, "output_tokens": out_tokens,
        "input_tokens": sum(int(r.get("input_tokens") or 0) for r in ok),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else None,
    }
    for name in ("ttft", "tpot", "e2e"):
        summary.update(_stats_ms([x[f"{name}_s"] for x in lat], name))
    summary.update(_stats_ms([g for x in lat for g in x["itl_s"]], "itl"))
    return summary


def steady_window(records: Sequence[dict[str, Any]], trim: float = 0.1) -> tuple[float, float] | None:
    """The steady state of an arrival trace: from the first token of the request that arrived
    ``k = ceil(trim * N)``-th to the last token of the one that arrived ``k``-th from the end
    (ramp-up and drain left out); None when fewer than 3 requests completed or the window is empty."""
    ok = sorted((r for r in records if r.get("status") == "ok" and r.get("token_times_s")),
                key=lambda r: r["send_s"])
    if len(ok) < 3:
        return None
    k = max(1, math.ceil(trim * len(ok)))
    if len(ok) - k - 1 < k:
        k = 0
    start, end = ok[k]["token_times_s"][0], ok[len(ok) - 1 - k]["token_times_s"][-1]
    return (start, end) if end > start else None


def tokens_in(records: Sequence[dict[str, Any]], start: float, end: float) -> float:
    """Output tokens generated in ``[start, end]``: chunk arrivals in it, each chunk weighted by its
    request's tokens per chunk (1 where the server streams a token per chunk)."""
    total = 0.0
    for r in records:
        times = r.get("token_times_s") or []
        if r.get("status") != "ok" or not times:
            continue
        per_chunk = (r.get("output_tokens") or len(times)) / len(times)
        total += per_chunk * sum(start <= t <= end for t in times)
    return total


def window_cost(records: Sequence[dict[str, Any]], counter_delta: float | None, window: tuple[float, float],
                unit: str) -> dict[str, Any]:
    """The counter's growth over the window per output token in it, and per request as ML.ENERGY
    attributes it (per-token cost x the mean output length of the completed requests)."""
    start, end = window
    tokens = tokens_in(records, start, end)
    outs = [r.get("output_tokens") or len(r["token_times_s"]) for r in records if r.get("status") == "ok"]
    per_token = counter_delta / tokens if counter_delta is not None and tokens > 0 else None
    suffix = "j" if unit == "J" else "cpu_s"
    return {"window_start_s": start, "window_s": end - start, "window_tokens": tokens,
            f"window_{suffix}": counter_delta,
            f"{suffix}_per_output_token": per_token,
            f"{suffix}_per_request": per_token * float(np.mean(outs)) if per_token is not None and outs else None}
