"""One load-generator run: replay a trace against a URL beside a counter (the local GPU's energy,
else the server's CPU time), then write the per-request records, the run's summary and a manifest.
Callable from a notebook (``run_load``) and from ``kvlab loadgen``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.loadgen.client import COMPLETIONS, TimedRequest, replay
from kvlab.loadgen.meter import CounterReader, CounterTrace, cpu_time_reader, nvml_reader
from kvlab.loadgen.metrics import request_latencies, steady_window, summarize, window_cost
from kvlab.records import RECORDS_FILE, RecordWriter, make_run_id, utc_now, write_manifest

REQUESTS_FILE = "requests.jsonl"


@dataclass
class LoadResult:
    records: list[dict[str, Any]]  # one per request, trace order, latencies added
    summary: dict[str, Any]


def pick_counter(server_pid: int | None, gpu_device: str | None) -> CounterReader | None:
    """The local GPU's NVML counter when ``gpu_device`` is given and readable, else the server's
    CPU time when its pid is known, else None (no cost column)."""
    if gpu_device:
        reader = nvml_reader(gpu_device)
        if reader is not None:
            return reader
    return cpu_time_reader(server_pid) if server_pid else None


async def run_load_async(target: str, items: Sequence[TimedRequest], *, model: str | None = None,
                         endpoint: str = COMPLETIONS, counter: CounterReader | None = None,
                         max_concurrency: int | None = None, trim: float = 0.1,
                         timeout_s: float = 3600.0) -> LoadResult:
    """Replay ``items`` against ``target`` with ``counter`` sampled alongside."""
    trace = CounterTrace(counter) if counter is not None else None
    sampling = asyncio.create_task(trace.run()) if trace is not None else None
    try:
        records, t0 = await replay(target, items, model=model, endpoint=endpoint,
                                   max_concurrency=max_concurrency, timeout_s=timeout_s)
    finally:
        if sampling is not None:
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
    if trace is not None:
        trace.sample()  # a reading after the last token, so the window's end lies inside
    ends = [r["end_s"] for r in records if r.get("end_s") is not None]
    summary = summarize(records, max(ends) if ends else 0.0)
    summary.update({"target": target, "endpoint": endpoint, "model": records[0]["model"] if records else model})
    window = steady_window(records, trim)
    if counter is not None:
        summary["cost_source"] = counter.source
    if window is not None and trace is not None:
        delta = trace.delta(t0 + window[0], t0 + window[1])
        summary.update(window_cost(records, delta, window, counter.unit))
    for rec in records:
        rec.update(request_latencies(rec))
    return LoadResult(records, summary)


def run_load(target: str, items: Sequence[TimedRequest], out_dir: str | Path | None = None, *,
             name: str = "loadgen", repeat: int = 0, **kwargs) -> LoadResult:
    """:func:`run_load_async` from synchronous code (a script, a notebook cell without a running
    loop); with ``out_dir``, write ``requests.jsonl`` (kind ``request``), ``records.jsonl`` (kind
    ``serving``: the summary) and ``manifest.json``."""
    result = asyncio.run(run_load_async(target, items, **kwargs))
    if out_dir is not None:
        write_run(Path(out_dir), result, name=name, repeat=repeat,
                  trace=[(i.arrival_s, len(i.prompt), i.max_tokens) for i in items])
    return result


def write_run(folder: Path, result: LoadResult, *, name: str, repeat: int, trace: list) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    identity = {"target": result.summary["target"], "endpoint": result.summary["endpoint"],
                "model": result.summary["model"], "trace": trace}
    run_id = make_run_id(identity, repeat)
    with RecordWriter(folder / REQUESTS_FILE) as requests:
        for rec in result.records:
            requests.append({"kind": "request", "run_id": run_id, "sweep": name, **rec})
    with RecordWriter(folder / RECORDS_FILE) as runs:
        runs.append({"kind": "serving", "run_id": run_id, "sweep": name, "created_at": utc_now(),
         "status": "ok" if result.summary["completed"] == result.summary["requests"] else "failed",
                     "repeat": repeat, **result.summary})
    write_manifest(folder, {"sweep": name, "kind": "loadgen", "target": identity["target"],
                            "model": identity["model"], "endpoint": identity["endpoint"],
                            "requests": len(trace), "created_at": utc_now()})
