"""Where measured things go: the driver's one writer, and the worker's end of the stream to it.

A group of runs reports through a *sink* with these methods (each call is one message):
``begin(stage, run_id)`` before a model load, warm-up or measured run (so a worker that dies is
known to have died *in* that step), ``record(rec)``, ``warmup(rec)``, ``timeline(tl)``,
``error_log(text)``, ``idle(model, watts)``, ``worker(info)`` and ``log(message)``.

:class:`DriverSink` is the only writer of a sweep folder: it appends through the sweep's
``RecordWriter`` objects (fsync per line) while the sweep holds its lock. :class:`ForwardingSink`
turns the same calls into ``(method, *args)`` tuples for a transport (a pipe, a Ray stream).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlab.errors import StorageError

SINK_METHODS = ("begin", "record", "warmup", "skip_warmups", "timeline", "error_log", "idle", "worker", "log")


class DriverSink:
    """Appends records, updates the summary and progress bar, and notes workers in the invocation."""

    def __init__(self, *, records, warmups, timelines, errors_path: Path, summary, bar,
                 invocation: dict[str, Any], log: Callable[[str], None]):
        self.records = records
        self.warmups = warmups
        self.timelines = timelines
        self.errors_path = Path(errors_path)
        self.summary = summary
        self.bar = bar
        self.invocation = invocation
        self._log = log

    def begin(self, stage: str, run_id: str | None) -> None:
        """Nothing to write: executors watch ``begin`` to attribute a worker's death."""

    def record(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        if rec.get("status") == "ok":
            self.summary.ok += 1
        else:
            self.summary.failed += 1
        self.bar.set_postfix_str(f"{rec.get('method')} ctx={rec.get('ctx')} b={rec.get('batch')}", refresh=False)
        self.bar.update(1)

    def warmup(self, rec: dict[str, Any]) -> None:
        self.warmups.append(rec)
        self.bar.set_postfix_str(f"warm-up {rec.get('method')} ctx={rec.get('ctx')} b={rec.get('batch')}",
                                 refresh=False)
        self.bar.update(1)  # the bar counts warm-ups too (kvlab.sweep.plan.warmups_planned)

    def skip_warmups(self, n: int) -> None:
        self.bar.update(n)

    def timeline(self, timeline: dict[str, Any]) -> None:
        self.timelines.append(timeline)

    def error_log(self, text: str) -> None:
        try:
            with open(self.errors_path, "a", encoding="utf-8") as f:
                f.write(text if text.endswith("\n") else text + "\n")
        except OSError as err:
            raise StorageError.from_os(err, self.errors_path) from None

    def idle(self, model: str, watts: float | None) -> None:
        self.invocation.setdefault("idle_w", {})[model] = watts

    def worker(self, info: dict[str, Any]) -> None:
        """One entry per worker process (host, pid, GPU UUID, ...), counting the groups it ran."""
        workers = self.invocation.setdefault("workers", [])
        for known in workers:
            if (known.get("host"), known.get("pid")) == (info.get("host"), info.get("pid")):
                known["groups"] = known.get("groups", 1) + 1
                break
        else:
            workers.append({**info, "groups": 1})
        sources = sorted({str(w.get("energy_source")) for w in workers})
        self.invocation["energy_source"] = "; ".join(sources)

    def log(self, message: str) -> None:
        self._log(message)


class ForwardingSink:
    """The worker's sink: every call becomes one ``(method, *args)`` message through ``send``."""

    def __init__(self, send: Callable[[tuple], None]):
        self._send = send

    def begin(self, stage: str, run_id: str | None) -> None:
        self._send(("begin", stage, run_id))

    def record(self, rec: dict[str, Any]) -> None:
        self._send(("record", rec))

    def warmup(self, rec: dict[str, Any]) -> None:
        self._send(("warmup", rec))

    def skip_warmups(self, n: int) -> None:
        self._send(("skip_warmups", n))

    def timeline(self, timeline: dict[str, Any]) -> None:
        self._send(("timeline", timeline))

    def error_log(self, text: str) -> None:
        self._send(("error_log", text))

    def idle(self, model: str, watts: float | None) -> None:
        self._send(("idle", model, watts))

    def worker(self, info: dict[str, Any]) -> None:
        self._send(("worker", info))

    def log(self, message: str) -> None:
        self._send(("log", message))
