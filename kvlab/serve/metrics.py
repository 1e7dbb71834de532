"""Serving metrics from per-request records: pure functions, vLLM's ``vllm bench serve`` formulas.

Per request (times in seconds): TTFT = first token - arrival; E2E = last token - arrival;
TPOT = (E2E - TTFT) / (output - 1) for output > 1 (0 for one token, as vLLM's goodput counts it);
ITL = the gaps between its consecutive tokens, pooled over requests. Per run: request and output
token throughput over the run's duration (ramp-up and drain included, as vLLM), goodput (requests
per second meeting every given SLO), peak concurrency (vLLM's sweep line over [arrival, finish)),
and energy per request and per output token over ML.ENERGY's steady-state window.
"""

from __future__ import annotations

import numpy as np

PERCENTILES = (50, 90, 99)


def ttft(rec: dict) -> float:
    return rec["token_times"][0] - rec["arrival_s"]


def e2e(rec: dict) -> float:
    return rec["token_times"][-1] - rec["arrival_s"]


def tpot(rec: dict) -> float:
    n = len(rec["token_times"])
    return (e2e(rec) - ttft(rec)) / (n - 1) if n > 1 else 0.0


def itls(records: list[dict]) -> list[float]:
    return [float(g) for r in records for g in np.diff(r["token_times"])]


def summary(values: list[float], percentiles=PERCENTILES) -> dict:
    """mean, median and the percentiles (numpy's linear interpolation, as vLLM); None when empty."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in percentiles}}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in percentiles}}


def good(rec: dict, slo: dict) -> bool:
    """Meets every SLO given (seconds): keys ``ttft``, ``tpot``, ``e2el``."""
    got = {"ttft": ttft(rec), "tpot": tpot(rec), "e2el": e2e(rec)}
    return all(got[k] <= v for k, v in slo.items())


def peak_concurrency(records: list[dict]) -> int:
    """Most requests in flight at once, each over [arrival, last token) (vLLM's sweep line)."""
    events = sorted([(r["arrival_s"], 1) for r in records] + [(r["token_times"][-1], -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak


def steady_window(records: list[dict], batch: int) -> tuple[float, float] | None:
    """ML.ENERGY's steady state: from the time ``batch`` requests have their first token to the time
    ``N - batch`` have it (the batch is full in between); None when ``N <= 2 * batch``."""
    firsts = sorted(r["token_times"][0] for r in records)
    n = len(firsts)
    if batch < 1 or n - batch <= batch:
        return None
    return firsts[batch - 1], firsts[n - batch - 1]


def energy_per_work(records: list[dict], window: tuple[float, float] | None, counter: list[tuple[float, float]]):
    """``(per output token, per request)`` over the window from a cumulative counter's
    ``(time, reading)`` samples (NVML joules on GPU, process CPU seconds on CPU). Per request is
    per token times the mean output length (ML.ENERGY's attribution). None without a window."""
    if window is None or len(counter) < 2:
        return None, None
    t0, t1 = window
    times = np.array([t for t, _ in counter])
    readings = np.array([v for _, v in counter])
    spent = float(np.interp(t1, times, readings) - np.interp(t0, times, readings))
    tokens = sum(1 for r in records for t in r["token_times"] if t0 < t <= t1)
    if tokens == 0:
        return None, None
    per_token = spent / tokens
    return per_token, per_token * float(np.mean([len(r["token_times"]) for r in records]))


def run_metrics(records: list[dict], duration_s: float, *, slo: dict | None = None, batch: int | None = None,
                counter: list[tuple[float, float]] | None = None) -> dict:
    """Everything a run reports, from its finished requests' records."""
    done = [r for r in records if r.get("token_times")]
    out = {"completed": len(done), "duration_s": duration_s,
           "input_tokens": sum(r["input_tokens"] for r in done),
           "output_tokens": sum(len(r["token_times"]) for r in done)}
    out["request_throughput"] = len(done) / duration_s if duration_s > 0 else None
    out["output_throughput"] = out["output_tokens"] / duration_s if duration_s > 0 else None
    for name, values in (("ttft", [ttft(r) for r in done]), ("tpot", [tpot(r) for r in done]),
                         ("itl", itls(done)), ("e2el", [e2e(r) for r in done])):
        out.update({f"{name}_{k}_s": v for k, v in summary(values).items()})
    if slo:
        out["goodput"] = sum(good(r, slo) for r in done) / duration_s if duration_s > 0 else None
    out["peak_concurrency"] = peak_concurrency(done) if done else 0
    window = steady_window(done, batch or 0) if batch else None
    out["steady_window_s"] = list(window) if window else None
    out["energy_per_output_token"], out["energy_per_request"] = energy_per_work(done, window, counter or [])
    return out
