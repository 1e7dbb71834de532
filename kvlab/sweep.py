"""The sweep runner: expand params into runs, warm up, measure, record; resumable and locked.

Order: per model, per (ctx, batch) shape, every method variant with pending runs is first warmed
up by replaying that exact shape (same ctx, batch and new tokens: on the H200 cuDNN builds an SDPA
plan per KV length, so a cold pass is 2-3x slower), then the measured runs follow in randomized
complete blocks: each block is one (repeat, prompt) and runs every variant once in a seeded random
order, so drift in temperature or host noise does not line up with a method.

Resumability: each run has a stable id; runs already recorded ok in ``records.jsonl`` are skipped,
so a sweep killed at any point and rerun finishes with no duplicate and no lost run. Runs recorded
as failed are retried by a rerun (``retry_failed: false`` keeps them). The quality pass resumes the
same way, per item. A lock file stops two sweeps from writing one folder; a lock left by a dead
process is detected and replaced. A run that raises (CUDA OOM or anything else) is recorded as failed
with its error, its memory is released, and the sweep goes on.

Status (manifest ``status``, and the CLI's exit code): ``complete`` only when every planned run (and
the quality pass) is recorded ok; ``failed_runs`` when all are recorded but some failed;
``incomplete`` while some are not recorded yet (stopped by a budget or killed).

Where runs execute (this process, a child process per group, Ray workers) is the executor's job
(:mod:`kvlab.runner`); they all call :func:`run_group` and report to the one writer here.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import random
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any

from kvlab.params import MethodVariant, SweepParams, check_params
from kvlab.records import (
    RECORDS_FILE,
    RecordWriter,
    latest_status,
    make_run_id,
    read_manifest,
    read_records,
    recorded_run_ids,
    utc_now,
    write_manifest,
)
from kvlab.runner import make_executor
from kvlab.runner.sink import DriverSink

LOCK_FILE = "sweep.lock"
WARMUP_FILE = "warmup.jsonl"
TIMELINES_FILE = "timelines.jsonl"
ERRORS_FILE = "errors.log"
MAX_ERROR_CHARS = 2000


class SweepLocked(RuntimeError):
    """Another live sweep is writing this folder."""


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One measured run. Everything but ``repeat`` is its identity; the id hashes both."""

    model: str
    weights: str | None
    device: str
    dtype: str | None
    attn_implementation: str
    sdpa_backend: str
    method: str
    policy_kwargs: dict[str, Any]
    ctx: int
    batch: int
    new_tokens: int
    prompt_id: int
    seed: int
    repeat: int
    engine: str = "hf"
    ctx_dist: str | None = None  # the distribution ctx was drawn from (kvlab.workload), and the draw
    ctx_sample: int | None = None
    weights_quant: str = "none"  # kvlab.weights_quant
    budget_gb: float | str | None = None  # an at-budget run: batch is the admitted batch (kvlab.admission)
    budget_bytes: int | None = None  # the budget resolved (not identity: "gpu" resolves per machine)
    budget_fit: dict[str, Any] | None = None  # how the batch was admitted (not identity; recorded)
    prefill_rows: int | None = None  # fast engine: sequences prefilled at a time (None: the whole batch)

    def identity(self) -> dict[str, Any]:
        """Everything but ``repeat``; ``engine`` only when not ``hf`` and the workload fields and
        ``prefill_rows`` only when set, so runs recorded before these existed keep their ids."""
        d = asdict(self)
        d.pop("repeat")
        d.pop("budget_bytes")
        d.pop("budget_fit")
        if d["engine"] == "hf":
            d.pop("engine")
        for key, unset in IDENTITY_DEFAULTS.items():
            if d[key] == unset:
                d.pop(key)
        return d

    @property
    def run_id(self) -> str:
        return make_run_id(self.identity(), self.repeat)

    @property
    def variant(self) -> MethodVariant:
        return MethodVariant(self.method, dict(self.policy_kwargs))

    @property
    def shape(self) -> tuple:
        """What one worker loads for: (model, ctx, batch), plus the weight quantization if any."""
        if self.weights_quant != "none":
            return (self.model, self.ctx, self.batch, self.weights_quant)
        return (self.model, self.ctx, self.batch)

    def unit(self) -> tuple:
        """What is warmed up (and can break) as one: the method variant on its engine."""
        return (self.variant.key(), self.engine)


IDENTITY_DEFAULTS = {"ctx_dist": None, "ctx_sample": None, "weights_quant": "none", "budget_gb": None,
                     "prefill_rows": None}
EXECUTION_KEYS = ("executor", "ray_address")


def plan_params(params: SweepParams) -> dict[str, Any]:
    """The params a manifest keeps: all but where the runs executed (each invocation records that),
    so a folder's manifest is the same whatever executor measured it."""
    return params.model_dump(mode="json", exclude=set(EXECUTION_KEYS))


def is_part_of_plan(run_ids: list[str], planned: list[str] | None) -> bool:
    """Whether a run list is a strict part of a folder's recorded plan (e.g. ``--set methods=[...]``
    over a sweep's params): such an invocation must not replace the plan in the manifest, or the
    folder would say "complete" with runs of the whole plan never measured."""
    return bool(planned) and set(run_ids) < set(planned)


def block_order(n: int, seed: int, *key: Any) -> list[int]:
    """A seeded permutation of ``range(n)``, stable across processes and Python versions."""
    rng = random.Random(json.dumps([seed, *key]))
    order = list(range(n))
    rng.shuffle(order)
    return order


def expand(params: SweepParams, variants: list[tuple[int, MethodVariant]]) -> list[RunSpec]:
    """All runs in execution order: model > weights_quant > ctx (or a distribution's draws) > batch >
    (repeat, prompt) blocks > shuffled (variant, engine) pairs."""
    from kvlab.engine import prefill_rows
    from kvlab.workload import workload_points

    vs = [(v, engine) for _, v in variants for engine in params.engine]
    runs = []
    for model in params.models:
        for wq, point in workload_points(params, model):
            for batch in params.batch:
                for repeat in range(params.repeats):
                    for prompt_id in range(params.prompts):
                        for k in block_order(len(vs), params.seed, model, point.ctx, batch, repeat, prompt_id,
                                             *point.block_key(wq)):
                            runs.append(RunSpec(
                                model=model, weights=params.weights, device=params.device, dtype=params.dtype,
                                attn_implementation=params.attn_implementation,
                                sdpa_backend=params.sdpa_backend, method=vs[k][0].method,
                                policy_kwargs=dict(vs[k][0].kwargs), ctx=point.ctx, batch=batch,
                                new_tokens=params.new_tokens, prompt_id=prompt_id, seed=params.seed,
                                repeat=repeat, engine=vs[k][1], ctx_dist=point.dist, ctx_sample=point.sample,
                                weights_quant=wq, prefill_rows=prefill_rows(params.prefill_rows, batch, vs[k][1]),
                            ))
    return runs


# --------------------------------------------------------------------------------------------
# Lock
# --------------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SweepLock:
    """An exclusive ``flock`` on ``<folder>/sweep.lock`` holding the owner's pid and host.

    The kernel drops a flock when its process dies, so a lock left by ``kill -9`` is free to take;
    ``stale`` then says whose it was. The file is emptied, not deleted, on release, so no second
    process can lock a deleted inode.
    """

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / LOCK_FILE
        self.stale: dict[str, Any] | None = None
        self._fd: int | None = None

    def _read(self, fd: int) -> dict[str, Any] | None:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096).decode(errors="replace").strip()
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return {"raw": raw}

    def acquire(self) -> SweepLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read(fd) or {}
            os.close(fd)
            who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started_at')}"
            raise SweepLocked(
                f"{self.path.parent} is being written by another sweep ({who}); wait for it to finish, "
                f"or write to another folder with -o"
            ) from None
        previous = self._read(fd)
        if previous and previous.get("pid"):
            same_host = previous.get("host") == socket.gethostname()
            if not (same_host and _pid_alive(int(previous["pid"])) and int(previous["pid"]) != os.getpid()):
                self.stale = previous
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started_at": utc_now()}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> SweepLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------------------------
# Budget and summary
# --------------------------------------------------------------------------------------------


@dataclass
class Budget:
    """Stops a sweep cleanly after ``max_runs`` measured runs or before ``time_budget_s`` runs out.

    The time check is conservative: a unit of work starts only if the longest one seen so far
    still fits (so one device command can end before its wall-clock limit).
    """

    max_runs: int | None = None
    time_budget_s: float | None = None
    started: float = field(default_factory=time.monotonic)
    runs: int = 0
    longest_s: float = 0.0
    reason: str | None = None

    def allows(self, units: int = 1) -> bool:
        if self.reason:
            return False
        if self.max_runs is not None and self.runs >= self.max_runs:
            self.reason = f"max_runs={self.max_runs} reached"
        elif self.time_budget_s is not None:
            left = self.time_budget_s - (time.monotonic() - self.started)
            if left < units * self.longest_s or left <= 0:
                self.reason = f"time_budget_s={self.time_budget_s:g} nearly spent"
        return self.reason is None

    def spent(self, seconds: float, measured: bool) -> None:
        self.longest_s = max(self.longest_s, seconds)
        self.runs += int(measured)


def sweep_status(run_ids: Iterable[str], statuses: dict[str, str | None], quality_pending: int = 0,
                 quality_failed: int = 0) -> str:
    """``complete`` if every run is recorded ok (and no quality pass is pending or failed),
    ``failed_runs`` if every run is recorded but some failed, ``incomplete`` if any is unrecorded."""
    run_ids = list(run_ids)
    if quality_pending or any(i not in statuses for i in run_ids):
        return "incomplete"
    if quality_failed or any(statuses[i] != "ok" for i in run_ids):
        return "failed_runs"
    return "complete"


@dataclass
class SweepSummary:
    """What one invocation did (``ok``, ``failed``) and where its runs stand at the end."""

    folder: str
    total: int
    already_done: int
    ok: int = 0
    failed: int = 0
    pending: int = 0  # runs with no record at all
    failed_recorded: int = 0  # runs whose latest record failed
    quality_failed: int = 0  # models whose quality pass failed or has failed records
    stopped: str | None = None
    stale_lock: dict[str, Any] | None = None
    status: str = "incomplete"

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    def line(self) -> str:
        text = (f"{self.folder}: {self.total} runs; {self.already_done} already recorded, {self.ok} ok and "
                f"{self.failed} failed now, {self.pending} pending; status {self.status}")
        if self.stopped:
            text += f" (stopped: {self.stopped}; rerun the same command to continue)"
        if self.failed_recorded or self.quality_failed:
            what = [f"{self.failed_recorded} run(s)"] if self.failed_recorded else []
            what += [f"the quality pass of {self.quality_failed} model(s)"] if self.quality_failed else []
            text += f"; {' and '.join(what)} recorded as failed: fix the cause and rerun to retry"
        return text


# --------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------


def _short_error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _release_memory(device: str) -> None:
    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _identity_record(run: RunSpec, sweep: str, kind: str = "perf") -> dict[str, Any]:
    v = run.variant
    return {
        "run_id": run.run_id, "sweep": sweep, "kind": kind, "created_at": utc_now(),
        "status": None, "error": None, "model": run.model, "weights": run.weights or "real",
        "device": run.device, "dtype": run.dtype, "method": run.method,
        "policy_params": dict(run.policy_kwargs), "keep": v.keep, "bits": v.bits,
        "prefill_chunk": v.prefill_chunk, "prefill_rows": run.prefill_rows,
        "ctx": run.ctx, "batch": run.batch, "new_tokens": run.new_tokens, "prompt_id": run.prompt_id,
        "repeat": run.repeat, "seed": run.seed, "sdpa_backend": run.sdpa_backend,
        "attn_implementation": run.attn_implementation, "engine": run.engine,
        "ctx_dist": run.ctx_dist, "ctx_sample": run.ctx_sample, "weights_quant": run.weights_quant,
        **({"budget_gb": run.budget_gb, "budget_bytes": run.budget_bytes, "admitted_batch": run.batch,
            **{f"admission_{k}": v for k, v in (run.budget_fit or {}).items()}} if run.budget_gb is not None else {}),
    }


class _ModelSession:
    """A loaded model plus its per-variant policies (checked, prepared and warmed once)."""

    def __init__(self, loaded, sampler, idle_w: float | None, gpu_name: str | None, gpu_uuid: str | None = None):
        self.loaded = loaded
        self.sampler = sampler
        self.idle_w = idle_w
        self.gpu_name = gpu_name
        self.gpu_uuid = gpu_uuid
        self.host = socket.gethostname()
        self.policies: dict[tuple, Any] = {}
        self.broken: dict[tuple, str] = {}  # variant key (+ shape) -> error
        self.warmed: set[tuple] = set()  # (variant key, engine) whose one-off warm-up ran
        self.probes: dict[tuple, dict[str, Any]] = {}
        self.attached = ExitStack()  # policies stay attached while the model is loaded
        self._fast = None

    def engine(self, name: str):
        """None for ``hf``; the model's :class:`~kvlab.engine.fast.FastEngine` (made once) for ``fast``.

        A run's peak memory must be its own: the engine keeps one decoder (its static buffers and
        graph) at a time, and an ``hf`` run first drops it. In the H200 campaign of 2026-12-03c the
        engine kept the other methods' stores for reuse, which put them into every later run's peak
        (hf full at batch 16: 120.5 GB) and ran the full cache out of memory. Rebuilding a decoder
        (allocating its buffers, capturing its graph) happens before a run's window opens."""
        if name == "hf":
            if self._fast is not None and self._fast.clear():
                _release_memory(str(self.loaded.device))
            return None
        if self._fast is None:
            from kvlab.engine.fast import FastEngine

            self._fast = FastEngine(self.loaded, max_decoders=1)
        return self._fast


def run_sweep(
    params: SweepParams,
    out_dir: str | Path,
    *,
    check_device: bool = True,
    progress: bool = True,
    loader: Callable[..., Any] | None = None,
    sampler_factory: Callable[..., Any] | None = None,
    log: Callable[[str], None] | None = None,
    runs: list[RunSpec] | None = None,
) -> SweepSummary:
    """Run (or resume) a sweep into ``out_dir``; returns what was done and what is left. ``runs``
    replaces the params' grid (kvlab.admission adds at-budget runs to it). ``log`` defaults to
    ``tqdm.write``: a line printed under a live progress bar, not into it."""
    from tqdm.auto import tqdm

    from kvlab import env
    from kvlab.energy import make_sampler
    from kvlab.models import load_model

    log = log or tqdm.write
    loader = loader or load_model
    sampler_factory = sampler_factory or make_sampler
    variants = check_params(params, check_device=check_device)  # raises before any model loads
    threads = pinned_threads(params)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)  # recorded per run (``threads``) by kvlab.measure
    runs = expand(params, variants) if runs is None else runs
    out = Path(out_dir)
    sweep_name = params.name or out.name
    executor = make_executor(params.executor, ray_address=params.ray_address, log=log)
    executor.check(loader=loader, sampler_factory=sampler_factory)

    with SweepLock(out) as lock:
        if lock.stale:
            log(f"kvlab sweep: replaced a stale lock left by pid {lock.stale.get('pid')} (not running)")
        skip_statuses = {"ok"} if params.retry_failed else None
        done = recorded_run_ids(out, statuses=skip_statuses)
        pending = [r for r in runs if r.run_id not in done]
        summary = SweepSummary(str(out), total=len(runs), already_done=len(runs) - len(pending),
                               pending=len(pending), stale_lock=lock.stale)
        manifest = read_manifest(out) or {"sweep": sweep_name, "created_at": utc_now(), "invocations": []}
        manifest.setdefault("invocations", [])
        plan_ids = [r.run_id for r in runs]
        part = is_part_of_plan(plan_ids, manifest.get("run_ids"))
        if part:
            log(f"kvlab sweep: running {len(runs)} of the {len(manifest['run_ids'])} runs planned in {out}; "
                f"its manifest keeps the whole plan")
        elif manifest.get("run_ids") and not set(manifest["run_ids"]) <= set(plan_ids):  # a superset extends it
            log(f"kvlab sweep: {out} held a different plan; its records stay, and load_records reads both "
                f"(use another -o to keep sweeps apart)")
        if not part:
            manifest.update(params=plan_params(params), n_runs=len(runs), run_ids=plan_ids)
        manifest.update(sweep=sweep_name, schema=1)
        invocation: dict[str, Any] = {"started_at": utc_now(), "pid": os.getpid(), "executor": params.executor,
                                      "pending_at_start": len(pending), "env_start": env.snapshot(params.device)}
        if part:
            invocation["part_of_plan"] = {"n_runs": len(runs), "params": plan_params(params)}
        manifest["invocations"].append(invocation)
        write_manifest(out, manifest)

        budget = Budget(max_runs=params.max_runs, time_budget_s=params.time_budget_s)
        writers = {name: RecordWriter(out / name) for name in (RECORDS_FILE, WARMUP_FILE, TIMELINES_FILE)}
        bar = tqdm(total=len(pending) + warmups_planned(pending, params.warmup_runs), desc="sweep",
                   disable=not progress or not pending, unit="run", dynamic_ncols=True)  # warm-ups count too
        sink = DriverSink(records=writers[RECORDS_FILE], warmups=writers[WARMUP_FILE],
                          timelines=writers[TIMELINES_FILE], errors_path=out / ERRORS_FILE, summary=summary,
                          bar=bar, invocation=invocation, log=log)
        try:
            if pending:
                executor.run(params, pending, sink, budget, sweep_name=sweep_name, loader=loader,
                             sampler_factory=sampler_factory)
            if params.quality is not None and not budget.reason:
                bar.close()  # the quality pass draws its own bar
                _quality_pass(params, variants, loader, writers[RECORDS_FILE], sweep_name, manifest, out, log,
                              progress)
        finally:
            bar.close()
            for w in writers.values():
                w.close()
            summary.stopped = budget.reason
            statuses = latest_status(read_records(out / RECORDS_FILE))
            own = [r.run_id for r in runs]
            summary.pending = sum(1 for i in own if i not in statuses)
            summary.failed_recorded = sum(1 for i in own if statuses.get(i) not in (None, "ok"))
            q_pending, summary.quality_failed = _quality_state(params, manifest)
            summary.status = sweep_status(own, statuses, q_pending, summary.quality_failed)
            invocation.update(finished_at=utc_now(), ok=summary.ok, failed=summary.failed,
                              pending_at_end=summary.pending, failed_at_end=summary.failed_recorded,
                              status=summary.status, stopped=budget.reason, env_end=env.snapshot(params.device))
            manifest["status"] = sweep_status(manifest["run_ids"], statuses, q_pending, summary.quality_failed)
            write_manifest(out, manifest)
            _write_parquet(out, log)
    return summary


def _quality_state(params: SweepParams, manifest: dict[str, Any]) -> tuple[int, int]:
    """(models whose quality pass has not finished, models whose pass finished with failures)."""
    if params.quality is None:
        return 0, 0
    done = manifest.get("quality_done", {})
    return (sum(1 for m in params.models if m not in done),
            sum(1 for m in params.models if m in done and done[m] is not True))


def _write_parquet(out: Path, log) -> None:
    """``records.parquet`` next to ``records.jsonl``, rewritten whole at the end of every sweep
    invocation (JSONL stays the source of truth: it survives a kill mid-run; Parquet is for pandas)."""
    from kvlab.records import write_parquet

    if not (out / RECORDS_FILE).is_file():
        return
    try:
        write_parquet(out)
    except Exception as err:  # noqa: BLE001 - a convenience copy must not fail a finished sweep
        log(f"kvlab sweep: records.parquet not written ({_short_error(err)}); records.jsonl has every run")


def _quality_pass(params, variants, loader, writer, sweep_name, manifest, out, log, progress=True) -> None:
    """Quality records for every model and method, resumed per item like the performance runs.

    ``manifest["quality_done"][model]`` is True once a model's pass has every record ok (the rerun
    then loads nothing), else ``{"failed": n, "error": ...}``: a rerun retries the failed items
    unless ``retry_failed`` is false. Items already recorded ok are never run or written again, so
    a pass killed midway (even between its last record and this mark) resumes with no duplicate.
    """
    from kvlab.policies import make_policy
    from kvlab.quality import TaskSpec, quality_notes, run_quality

    done = manifest.setdefault("quality_done", {})
    spec = TaskSpec(**params.quality)
    for model_name in params.models:
        if done.get(model_name) is True or (model_name in done and not params.retry_failed):
            continue
        log(f"kvlab sweep: quality pass on {model_name} ({', '.join(spec.tasks)} at {spec.lengths})")
        if params.weights == "synthetic":
            log("kvlab sweep: quality on synthetic weights is meaningless (mechanics only); "
                "its records say weights: synthetic")
        skip = recorded_run_ids(out, statuses={"ok"})
        started = time.monotonic()
        loaded = None
        try:
            loaded = loader(model_name, weights=params.weights, device=params.device, dtype=params.dtype,
                            seed=params.seed, attn_implementation=params.attn_implementation)
            policies = [make_policy(v.method, **v.kwargs) for _, v in variants]
            records = run_quality(loaded, policies, spec, out_writer=writer, base={"sweep": sweep_name},
                                  skip=skip, progress_bar=progress)
            for note in quality_notes(records):
                log(f"kvlab sweep: note: {note}")
        except Exception as err:  # noqa: BLE001 - recorded in the manifest; the sweep says failed_runs
            message = _short_error(err)
            log(f"kvlab sweep: quality pass on {model_name} failed: {message}")
            with open(out / ERRORS_FILE, "a", encoding="utf-8") as f:
                f.write(f"--- {utc_now()} quality pass on {model_name}\n{traceback.format_exc()}")
            done[model_name] = {"failed": None, "error": message}
        else:
            failed = sum(1 for r in records if r.get("status") != "ok")
            done[model_name] = True if not failed else {"failed": failed, "error": None}
            log(f"kvlab sweep: quality pass on {model_name}: {len(records)} records in "
                f"{time.monotonic() - started:.0f} s")
        finally:
            del loaded
            _release_memory(params.device)
        write_manifest(out, manifest)


def run_group(params: SweepParams, runs: list[RunSpec], sink, budget: Budget, *, loader: Callable[..., Any],
              sampler, sweep_name: str) -> None:
    """Measure ``runs`` (pending, in plan order) in this process: one model load per model, then per
    (ctx, batch) shape its warm-ups and measured runs. The seam every executor calls (in the driver,
    a child process or a Ray worker); everything measured goes to ``sink`` (see kvlab.runner.sink)."""
    for (model_name, weights_quant), model_runs in groupby(runs, key=lambda r: (r.model, r.weights_quant)):
        if not budget.allows():
            break
        model_runs = list(model_runs)
        session = _open_model(params, model_name, loader, sampler, model_runs, sink, sweep_name, weights_quant)
        if session is None:
            continue
        try:
            for _shape, shape_runs in groupby(model_runs, key=lambda r: r.shape):
                _run_shape(params, session, list(shape_runs), sink, budget, sweep_name)
                if budget.reason:
                    break
        finally:
            session.attached.close()
            session.loaded = None
            session._fast = None
            session.policies.clear()
            _release_memory(params.device)


def _open_model(params, model_name, loader, sampler, model_runs, sink, sweep_name,
                weights_quant: str = "none") -> _ModelSession | None:
    """Load a model (its weights quantized if asked) and take its idle baseline; on failure record
    every pending run of it."""
    from kvlab.weights_quant import quantize_weights

    sink.begin("load", model_runs[0].run_id)
    started = time.monotonic()
    try:
        loaded = loader(model_name, weights=params.weights, device=params.device, dtype=params.dtype,
                        seed=params.seed, attn_implementation=params.attn_implementation)
        quantize_weights(loaded.model, weights_quant)
    except Exception as err:
        message = f"model load failed: {_short_error(err)}"
        sink.log(f"kvlab sweep: {model_name}: {message}")
        for run in model_runs:
            _write_failure(sink, run, sweep_name, message, {})
        _release_memory(params.device)
        return None
    sink.log(f"kvlab sweep: loaded {model_name} in {time.monotonic() - started:.1f} s")
    idle_w = sampler.measure_idle(params.idle_s) if params.idle_s > 0 else None
    sink.idle(model_name, idle_w)
    gpu_name = getattr(sampler, "gpu", {}).get("gpu_name")
    if gpu_name is None and str(params.device).startswith("cuda"):
        import torch

        gpu_name = torch.cuda.get_device_name(torch.device(params.device))
    return _ModelSession(loaded, sampler, idle_w, gpu_name, getattr(sampler, "gpu", {}).get("gpu_uuid"))


FAILED_ENERGY_SOURCE = "none: the run failed before its energy was measured"


def _write_failure(sink, run, sweep_name, message, extra) -> None:
    rec = _identity_record(run, sweep_name)
    rec.update(extra)
    rec.update(status="failed", error=message, energy_source=FAILED_ENERGY_SOURCE)
    sink.record(rec)


def _policy_for(session: _ModelSession, variant: MethodVariant, engine: str = "hf"):
    """The checked, prepared and warmed policy of a variant (built once per model load; warmed once
    per engine, for what that engine runs: on ``fast`` a quantized policy's prefill policy, so a sweep
    whose quanto runs are all on ``fast`` never pays quanto's CUDA build, 95 s on a fresh H200)."""
    from kvlab.policies import make_policy

    key = variant.key()
    if key in session.broken:
        raise RuntimeError(session.broken[key])
    try:
        if key not in session.policies:
            session.policies[key] = session.attached.enter_context(
                make_policy(variant.method, **variant.kwargs).attach(session.loaded.model, warm=False))
        policy = session.policies[key]
        if (key, engine) not in session.warmed:
            started = time.perf_counter()
            # one-off costs (e.g. quanto's CUDA build: minutes once), never measured
            (policy.fast_storage()[0] if engine == "fast" else policy).warmup(session.loaded.model)
            session.warmed.add((key, engine))
            took = time.perf_counter() - started
            if took > 5:
                from tqdm import tqdm

                tqdm.write(f"kvlab sweep: {policy.label} one-off warm-up (kernel builds) took {took:.0f} s",
                           file=sys.stderr)
    except Exception as err:
        session.broken[key] = f"policy setup failed: {_short_error(err)}"
        raise RuntimeError(session.broken[key]) from None
    return policy


def _measure(params, session, run: RunSpec, policy, probe: bool):
    from kvlab.measure import measure_generation

    return measure_generation(
        session.loaded, policy, ctx=run.ctx, batch=run.batch, new_tokens=run.new_tokens,
        prompt_id=run.prompt_id, seed=run.seed, sampler=session.sampler, sdpa_backend=run.sdpa_backend,
        idle_w=session.idle_w, probe=probe, engine=session.engine(run.engine), prefill_rows=run.prefill_rows,
    )


def _base_record(session, run, sweep_name, kind, policy) -> dict[str, Any]:
    """The run's identity, then the shared model and policy columns (:mod:`kvlab.columns`)."""
    from kvlab.columns import model_columns, policy_columns

    rec = _identity_record(run, sweep_name, kind)
    model = model_columns(session.loaded)
    rec.update(weights=model.get("weights"), dtype=model.get("dtype"),
               gpu_name=session.gpu_name or model["gpu_name"],  # the sampler's GPU, found by UUID
               gpu_uuid=session.gpu_uuid, host=session.host)
    if policy is not None:
        from kvlab.weights_quant import weights_label

        cols = policy_columns(policy)
        rec.update(cols, label=weights_label(cols["label"], run.weights_quant))
    return rec


def _run_shape(params, session, runs: list[RunSpec], sink, budget, sweep_name) -> None:
    """Warm up every variant of one (model, ctx, batch) shape, then measure its runs in order."""
    first_of: dict[tuple, RunSpec] = {}
    for run in runs:
        first_of.setdefault(run.unit(), run)
    for key, run in first_of.items():
        for w in range(params.warmup_runs):
            if not budget.allows():
                return
            _warm_up(params, session, run, key, w, sink, budget, sweep_name)
            if (key, run.shape) in session.broken:
                sink.skip_warmups(params.warmup_runs - w - 1)  # a broken variant's other warm-ups
                break
    for run in runs:
        if not budget.allows():
            return
        if params.jitter_ms > 0:
            time.sleep(random.Random(run.run_id).uniform(0, params.jitter_ms / 1000.0))
        _measured_run(params, session, run, sink, budget, sweep_name)


def _warm_up(params, session, run, key, index, sink, budget, sweep_name) -> None:
    sink.begin("warmup", run.run_id)
    started = time.monotonic()
    rec: dict[str, Any] = {}
    error = None
    try:
        policy = _policy_for(session, run.variant, run.engine)
        rec = _base_record(session, run, sweep_name, "warmup", policy)
        # The kernel probe (torch.profiler) names the SDPA kernel and times GPU kernels; on a CPU it
        # has no kernel time to give and made the smoke sweep's warm-ups 4x slower than its runs
        # (378 s for 20 warm-ups vs 271 s for 60 runs, 2026-12-03), so CPU sweeps skip it.
        probe = index == 0 and str(session.loaded.device).startswith("cuda")
        m = _measure(params, session, run, policy, probe=probe)
        rec.update(m.record)
        if index == 0:
            session.probes[(key, run.shape)] = {k: m.record.get(k) for k in ("sdpa_kernel", "decode_kernel_ms")}
        del m
    except Exception as err:
        error = _short_error(err)
        rec = rec or _identity_record(run, sweep_name, "warmup")
        session.broken[(key, run.shape)] = f"warm-up failed: {error}"
    if error:
        _release_memory(params.device)
        rec["energy_source"] = rec.get("energy_source") or FAILED_ENERGY_SOURCE
    rec.update(warmup_index=index, status="failed" if error else "ok", error=error)
    sink.warmup(rec)
    budget.spent(time.monotonic() - started, measured=False)


def _measured_run(params, session, run, sink, budget, sweep_name) -> None:
    sink.begin("run", run.run_id)
    started = time.monotonic()
    key = run.unit()
    rec = _identity_record(run, sweep_name)
    error = None
    timeline = None
    try:
        if (key, run.shape) in session.broken:
            raise RuntimeError(session.broken[(key, run.shape)])
        policy = _policy_for(session, run.variant, run.engine)
        rec = _base_record(session, run, sweep_name, "perf", policy)
        m = _measure(params, session, run, policy, probe=False)
        rec.update(m.record)
        rec.update(session.probes.get((key, run.shape), {}))
        if params.timelines and m.window.timeline is not None:
            timeline = {"run_id": run.run_id, "t0": 0.0, "phases": m.window.phase_s(),
                        **m.window.timeline.relative_to(m.window.t0)}
        del m
    except Exception as err:
        error = _short_error(err)
        sink.error_log(f"--- {utc_now()} run {run.run_id} ({run.method} ctx={run.ctx} batch={run.batch})\n"
                       + traceback.format_exc())
    if error:
        _release_memory(params.device)
        rec["energy_source"] = rec.get("energy_source") or FAILED_ENERGY_SOURCE
    rec.update(status="failed" if error else "ok", error=error, created_at=utc_now())
    sink.record(rec)
    if timeline is not None:
        sink.timeline(timeline)
    budget.spent(time.monotonic() - started, measured=True)


def warmups_planned(pending: list[RunSpec], warmup_runs: int) -> int:
    """Warm-up runs a sweep will do for its pending runs: ``warmup_runs`` per variant and shape
    (:func:`_run_shape`), so the progress bar's ETA covers them (minutes on a CPU)."""
    return warmup_runs * len({(r.shape, r.variant.key()) for r in pending})


def pinned_threads(params: SweepParams) -> int | None:
    """torch's thread count for a sweep: ``threads`` if set, else on CPU a stable number
    (:func:`kvlab.hostload.cpu_threads`), so runs of one folder compare like with like; on a GPU
    torch's default (the host thread mostly launches kernels)."""
    from kvlab.hostload import cpu_threads

    if params.threads is not None:
        return params.threads
    return None if str(params.device).startswith("cuda") else cpu_threads()


def plan(params: SweepParams, out_dir: str | Path | None = None, check_device: bool = False) -> list[RunSpec]:
    """The runs a sweep would do (validated), minus those already recorded in ``out_dir``."""
    runs = expand(params, check_params(params, check_device=check_device))
    if out_dir is None:
        return runs
    done = recorded_run_ids(out_dir, statuses={"ok"} if params.retry_failed else None)
    return [r for r in runs if r.run_id not in done]


def count_by(runs: Iterable[RunSpec], attr: str) -> dict[Any, int]:
    counts: dict[Any, int] = {}
    for r in runs:
        counts[getattr(r, attr)] = counts.get(getattr(r, attr), 0) + 1
    return counts
