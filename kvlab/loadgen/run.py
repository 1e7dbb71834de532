"""One load-generator run: replay a trace against a URL beside a counter (the local GPU's energy,
else the server's CPU time), then the serving metrics of :mod:`kvlab.serve.metrics` over the
records, in the in-process run's files (``requests.jsonl`` appended as requests end, ``run.json``
with status, meta and metrics: :class:`kvlab.serve.run.RunLog`). Callable from a notebook
(``run_load``) and from ``kvlab loadgen``.

The card (:mod:`kvlab.card`) is the counter's: the local GPU's, ``cpu`` for a server's CPU time, and
null fields without a counter (the client cannot see a remote server's hardware).

The steady-state window is ML.ENERGY's (:func:`kvlab.serve.metrics.steady_window`) with the batch
taken as the client's peak concurrency (requests in flight, vLLM's sweep line): the server's own
batch is not visible over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.loadgen.client import COMPLETIONS, TimedRequest, replay
from kvlab.loadgen.meter import CounterReader, CounterTrace, cpu_time_reader, nvml_reader
from kvlab.serve.metrics import e2e, peak_concurrency, run_metrics, summary, ttft
from kvlab.serve.run import RunLog


@dataclass
class LoadResult:
    status: str  # "complete" when every request got an answer (ok or refused), else "incomplete"
    records: list[dict[str, Any]]  # one per request, trace order
    metrics: dict[str, Any]
    card: dict[str, Any] = field(default_factory=dict)  # kvlab.card's fields of the counter's card (null: unknown)


def pick_counter(server_pid: int | None, gpu_device: str | None) -> CounterReader | None:
    """The local GPU's NVML counter when ``gpu_device`` is given and readable, else the server's
    CPU time when its pid is known, else None (no cost columns)."""
    if gpu_device:
        reader = nvml_reader(gpu_device)
        if reader is not None:
            return reader
    return cpu_time_reader(server_pid) if server_pid else None


def load_metrics(records: list[dict[str, Any]], duration_s: float, counter: CounterTrace | None, t0: float,
                 slo: dict | None = None) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == "ok"]
    readings = [(t - t0, v) for t, v in zip(counter.ts, counter.values, strict=True)] if counter else None
    metrics = run_metrics(ok, duration_s, slo=slo, batch=peak_concurrency(ok) if ok else None, counter=readings)
    metrics.update(requests=len(records), refused=sum(r["status"] == "refused" for r in records),
                   failed=sum(r["status"] == "failed" for r in records), chunks=metrics["output_tokens"])
    if any(r["output_tokens"] != len(r["token_times"]) for r in ok):
        # a server that put several tokens in a chunk: tokens and TPOT from its usage, as vLLM's
        # benchmark counts them (ITL stays per chunk, TTFT is the first chunk's)
        out = sum(r["output_tokens"] for r in ok)
        metrics.update(output_tokens=out, output_throughput=out / duration_s if duration_s > 0 else None)
        per_request = [(e2e(r) - ttft(r)) / (r["output_tokens"] - 1) if r["output_tokens"] > 1 else 0.0 for r in ok]
        metrics.update({f"tpot_{k}_s": v for k, v in summary(per_request).items()})
    if counter is not None:
        metrics.update(energy_source=counter.reader.source, energy_unit=counter.reader.unit)
    return metrics


async def run_load_async(target: str, items: Sequence[TimedRequest], out_dir=None, *, model: str | None = None,
                         endpoint: str = COMPLETIONS, counter: CounterReader | None = None,
                         max_concurrency: int | None = None, slo: dict | None = None, meta: dict | None = None,
                         timeout_s: float = 3600.0) -> LoadResult:
    """Replay ``items`` against ``target`` with ``counter`` sampled alongside; with ``out_dir``,
    the run's files."""
    log = RunLog(out_dir, {"target": target, "endpoint": endpoint, "model": model, "requests_planned": len(items),
                           **(meta or {})}, card=counter.card if counter is not None else None)
    trace = CounterTrace(counter) if counter is not None else None
    sampling = asyncio.create_task(trace.run()) if trace is not None else None
    records: list[dict[str, Any]] = []
    status, t0 = "incomplete", 0.0
    try:
        records, t0 = await replay(target, items, model=model, endpoint=endpoint, max_concurrency=max_concurrency,
                                   timeout_s=timeout_s, on_record=log.request)
        status = "complete" if all(r["status"] != "failed" for r in records) else "incomplete"
    finally:
        if sampling is not None:
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
            trace.sample()  # a reading after the last token, so the window's end lies inside
        ends = [r["finish_s"] for r in records if r["finish_s"] is not None]
        metrics = load_metrics(records, max(ends, default=0.0), trace, t0, slo)
        if records:
            log.meta["model"] = records[0]["model"]
        log.write_status(status, metrics)
    return LoadResult(status, records, metrics, dict(log.card))


def run_load(target: str, items: Sequence[TimedRequest], out_dir=None, **kwargs) -> LoadResult:
    """:func:`run_load_async` from synchronous code (a script; in a notebook cell, where a loop
    runs, ``await run_load_async(...)``)."""
    return asyncio.run(run_load_async(target, items, out_dir, **kwargs))
