"""Drive a workload through a serving engine on the engine's clock, and record it as it goes.

Requests are added when their arrival time comes (open loop) or when a user's previous request
finishes (closed loop). Each finished request's record is appended to ``requests.jsonl`` at once,
and ``run.json`` says ``"status": "running"`` until the run ends: a run killed mid-way keeps every
finished request's record and reads back as incomplete (:func:`load_run`); one interrupted in
Python (an exception, Ctrl-C) writes ``"incomplete"`` with the metrics of what finished. Both
files name the card the run measured on (:mod:`kvlab.card`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvlab.card import CARD_FIELDS, device_card
from kvlab.serve.engine import Request, ServingEngine
from kvlab.serve.layout import predicted_concurrency
from kvlab.serve.metrics import run_metrics
from kvlab.serve.workload import Workload


def cpu_seconds() -> float:
    """The CPU-time equivalent of an energy counter: this process's CPU seconds (all threads)."""
    return time.process_time()


def energy_counter(device: str):
    """``(read, unit)``: NVML's cumulative energy counter in joules for a CUDA device it can read,
    else this process's CPU seconds (``"cpu_s"``, the CPU-time equivalent)."""
    if str(device).startswith("cuda"):
        try:
            import pynvml  # from the nvidia-ml-py distribution

            from kvlab.energy.device import find_handle, torch_device_uuid

            pynvml.nvmlInit()
            handle = find_handle(pynvml, torch_device_uuid(str(device)))
            if handle is not None:
                pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
                return (lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0), "J"
        except Exception:  # no NVML or no counter: the CPU-time equivalent, and the unit says so
            pass
    return cpu_seconds, "cpu_s"


class RunLog:
    """The run's files: ``run.json`` (status, the card, metrics), ``requests.jsonl`` (each request's
    record with the card's fields), ``timeline.jsonl``. ``card``: :mod:`kvlab.card`'s fields of what
    measured (unknown: every field null)."""

    def __init__(self, out_dir, meta: dict, card: Mapping[str, Any] | None = None):
        self.dir = Path(out_dir) if out_dir else None
        self.card = {k: (card or {}).get(k) for k in CARD_FIELDS}
        self.meta = meta
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "requests.jsonl").write_text("")
            self.write_status("running", None)

    def request(self, rec: dict) -> None:
        if self.dir:
            with open(self.dir / "requests.jsonl", "a") as f:
                f.write(json.dumps({**rec, **self.card}) + "\n")
                f.flush()

    def write_status(self, status: str, metrics: dict | None, timeline: list | None = None) -> None:
        if not self.dir:
            return
        if timeline is not None:
            (self.dir / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline))
        tmp = self.dir / "run.json.tmp"
        tmp.write_text(json.dumps({"status": status, **self.meta, **self.card, "metrics": metrics}, indent=1))
        tmp.replace(self.dir / "run.json")


def run_workload(engine: ServingEngine, workload: Workload, out_dir=None, *, slo: dict | None = None,
                 counter=None, meta: dict | None = None, on_event=None) -> dict:
    """Run every request of ``workload``; returns ``{"status", "records", "metrics", "timeline"}``.
    Record times are seconds from the run's start. ``counter``: ``(read, unit)`` of a cumulative
    energy counter (default :func:`energy_counter` of the engine's device); read after every step."""
    counter, energy_unit = counter or energy_counter(engine.loaded.device)
    predicted = predicted_concurrency(engine.layout, engine.allocator.total,
                                      [(len(it.prompt_ids), it.output_len) for it in workload.items])
    log = RunLog(out_dir, {"model": engine.model_name, "method": engine.layout.method,
                           "block_size": engine.layout.block_size, "bytes_per_block": engine.layout.bytes_per_block,
                           "blocks_total": engine.allocator.total, **workload.meta, **(meta or {})},
                 card=device_card(engine.loaded.device))
    start = time.perf_counter()
    open_loop = sorted(((it.arrival_s, k) for k, it in enumerate(workload.items) if it.arrival_s is not None))
    closed = [k for k, it in enumerate(workload.items) if it.arrival_s is None]
    live: dict[str, dict] = {}
    records: list[dict] = []
    counter_log: list[tuple[float, float]] = [(0.0, counter())]
    status = "incomplete"

    def send(k: int, at: float) -> None:
        item = workload.items[k]
        rid = f"r{k}"
        live[rid] = {"request_id": rid, "arrival_s": at, "input_tokens": len(item.prompt_ids),
                     "max_new_tokens": item.output_len, "token_times": [], "token_ids": []}
        engine.add(Request(rid, item.prompt_ids, item.output_len, start + at))

    for _ in range(min(workload.users or 0, len(closed))):
        send(closed.pop(0), 0.0)
    try:
        while open_loop or closed or engine.has_work():
            now = time.perf_counter() - start
            while open_loop and open_loop[0][0] <= now:
                at, k = open_loop.pop(0)
                send(k, at)
            if not engine.has_work():
                if not open_loop:
                    break  # closed-loop users with nothing in flight: nothing will send again
                time.sleep(max(0.0, open_loop[0][0] - (time.perf_counter() - start)))
                continue
            for ev in engine.step():
                rec = live[ev.request_id]
                rec["token_times"].append(ev.time_s - start)
                rec["token_ids"].append(ev.token_id)
                if ev.finished:
                    records.append(finish(rec, engine.finished.get(ev.request_id, {}), start, ev.finish_reason))
                    log.request(records[-1])
                    del live[ev.request_id]
                    if closed:
                        send(closed.pop(0), ev.time_s - start)
                if on_event:  # after the event is recorded
                    on_event(ev)
            counter_log.append((time.perf_counter() - start, counter()))
        status = "complete"
    finally:
        duration = time.perf_counter() - start
        peak_running = max((row["running"] for row in engine.timeline), default=0)
        metrics = run_metrics(records, duration, slo=slo, batch=peak_running, counter=counter_log)
        metrics.update(peak_running=peak_running, predicted_peak=predicted, energy_unit=energy_unit, preemptions_total=engine.scheduler.preemptions_total,
                       unfinished=len(live) + len(open_loop) + len(closed))
        timeline = [{**row, "time_s": row["time_s"] - start} for row in engine.timeline]
        step_s = sum(row["step_s"] for row in timeline)
        metrics["bookkeeping_share"] = (step_s - sum(row["forward_s"] for row in timeline)) / step_s if step_s else None
        log.write_status(status, metrics, timeline)
    return {"status": status, "records": records, "metrics": metrics, "timeline": timeline}


def finish(rec: dict, engine_side: dict, start: float, reason: str | None) -> dict:
    first = engine_side.get("first_scheduled_s")
    return {**rec, "finish_s": rec["token_times"][-1], "output_tokens": len(rec["token_times"]),
            "finish_reason": reason, "first_scheduled_s": None if first is None else first - start,
            **{k: v for k, v in engine_side.items() if k not in ("first_scheduled_s", "finish_reason")}}


def load_run(run_dir) -> dict:
    """A run's files read back: ``status`` is ``"complete"`` only if the run said so at its end."""
    run_dir = Path(run_dir)
    info = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    path = run_dir / "requests.jsonl"
    records = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by the kill
    status = info.get("status", "incomplete")
    return {**info, "status": status if status == "complete" else "incomplete", "records": records}
