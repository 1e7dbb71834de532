"""The driver loop of the isolating executors: groups out to workers, messages back to one sink.

Each group (the pending runs of one (model, ctx, batch) shape: one model load) goes to a worker
through a *transport*: a callable that starts the worker and yields its messages, raising
:class:`WorkerDied` when the worker ends without finishing. A reader thread per worker feeds one
queue; only this loop (the sweep's thread) touches the sink, so there is one writer.

A worker that dies is charged for what it was doing (its last ``begin``): the measured run in
flight, or every run of the variant whose warm-up it was, or the whole group when it died loading
the model. Those runs are recorded as failed with the cause; the rest of the group goes to a
fresh worker. A death either records a run as failed or comes after a run was recorded, so the
group shrinks every time and a crash that repeats cannot loop.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import groupby

from kvlab.card import CARD_FIELDS
from kvlab.records import utc_now
from kvlab.runner.sink import SINK_METHODS
from kvlab.runner.worker import GroupJob
from kvlab.sweep.plan import RunSpec, failure_record


class WorkerDied(RuntimeError):
    """A worker ended before finishing its group; the message is the cause."""


Transport = Callable[[GroupJob], Iterator[tuple]]


def shape_groups(runs: list[RunSpec]) -> list[list[RunSpec]]:
    """Pending runs split per (model, ctx, batch) shape, in plan order: the unit a worker loads for."""
    return [list(g) for _, g in groupby(runs, key=lambda r: r.shape)]


@dataclass
class InFlightGroup:
    """A group on a worker: its runs, those recorded so far, and the step (``begin``) it is in."""

    runs: list[RunSpec]
    recorded: set[str] = field(default_factory=set)
    stage: tuple[str, str | None] | None = None
    card: dict | None = None  # the card fields its worker named (kvlab.card), for failure records


def _pump(gid: int, transport: Transport, job: GroupJob, out: queue.Queue) -> None:
    try:
        for msg in transport(job):
            out.put((gid, msg))
        out.put((gid, ("end",)))
    except WorkerDied as err:
        out.put((gid, ("died", str(err))))
    except BaseException as err:  # a transport bug must not hang the sweep
        out.put((gid, ("died", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")))


def charged_runs(group: InFlightGroup) -> tuple[list[RunSpec], list[RunSpec], str]:
    """(runs to record as failed, runs to hand to a fresh worker, what the worker was doing)."""
    left = [r for r in group.runs if r.run_id not in group.recorded]
    stage, run_id = group.stage or ("start", None)
    by_id = {r.run_id: r for r in group.runs}
    current = by_id.get(run_id) if run_id else None
    if stage == "run" and current is not None:
        doing = f"the measured run {current.method} ctx={current.ctx} batch={current.batch}"
        failed = [r for r in left if r.run_id == current.run_id]
    elif stage == "warmup" and current is not None:
        doing = f"the warm-up of {current.method} at ctx={current.ctx} batch={current.batch}"
        failed = [r for r in left if r.variant.key() == current.variant.key() and r.shape == current.shape]
    else:
        doing = "model load" if stage == "load" else "worker start-up"
        failed = left
    failed_ids = {r.run_id for r in failed}
    return failed, [r for r in left if r.run_id not in failed_ids], doing


def drive(groups: list[list[RunSpec]], transport: Transport, *, slots: int, params, sink, budget,
          sweep_name: str, loader, sampler_factory) -> None:
    """Run every group on workers, at most ``slots`` at a time, until done or the budget stops it."""
    todo = deque(groups)
    inbox: queue.Queue = queue.Queue()
    active: dict[int, InFlightGroup] = {}
    threads: list[threading.Thread] = []
    next_id = 0
    while todo or active:
        while todo and len(active) < slots and budget.allows():
            runs = todo.popleft()
            left_s = (None if params.time_budget_s is None
                      else params.time_budget_s - (time.monotonic() - budget.started))
            job = GroupJob(params=params, runs=runs, sweep_name=sweep_name,
                           max_runs=None if budget.max_runs is None else budget.max_runs - budget.runs,
                           time_left_s=left_s, loader=loader, sampler_factory=sampler_factory)
            active[next_id] = InFlightGroup(runs)
            t = threading.Thread(target=_pump, args=(next_id, transport, job, inbox), daemon=True,
                                 name=f"kvlab-worker-{next_id}")
            t.start()
            threads.append(t)
            next_id += 1
        if not active:
            break
        gid, msg = inbox.get()
        group = active[gid]
        kind, args = msg[0], msg[1:]
        if kind == "end":
            del active[gid]
        elif kind == "died":
            del active[gid]
            failed, rest, doing = charged_runs(group)
            cause = f"worker died during {doing}: {args[0]}"
            sink.log(f"kvlab sweep: {cause}")
            sink.error_log(f"--- {utc_now()} worker died ({len(failed)} run(s) recorded as failed)\n{args[0]}")
            for run in failed:
                sink.record(failure_record(run, sweep_name, cause, group.card))
            if rest:
                todo.appendleft(rest)
        elif kind == "spent":
            budget.spent(*args)
        elif kind in SINK_METHODS:
            if kind == "begin":
                group.stage = (args[0], args[1])
            elif kind == "worker":
                group.card = {k: args[0].get(k) for k in CARD_FIELDS}
            elif kind == "record":
                group.recorded.add(args[0].get("run_id"))
            getattr(sink, kind)(*args)
        else:
            sink.log(f"kvlab sweep: ignored an unknown worker message {kind!r}")
    for t in threads:
        t.join(timeout=1.0)
