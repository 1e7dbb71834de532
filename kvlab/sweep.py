"""The sweep runner: expand params into runs, warm up, measure, record; resumable and locked.

Order: per model, per (ctx, batch) shape, every method variant with pending runs is first warmed
up by replaying that exact shape (same ctx, batch and new tokens: on the H200 cuDNN builds an SDPA
plan per KV length, so a cold pass is 2-3x slower), then the measured runs follow in randomized
complete blocks: each block is one (repeat, prompt) and runs every variant once in a seeded random
order, so drift in temperature or host noise does not line up with a method.

Resumability: each run has a stable id; runs already in ``records.jsonl`` are skipped, so a sweep
killed at any point and rerun finishes with no duplicate and no lost run. A lock file stops two
sweeps from writing one folder; a lock left by a dead process is detected and replaced. A run that
raises (CUDA OOM or anything else) is recorded as failed with its error, its memory is released,
and the sweep goes on.
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
from dataclasses import asdict, dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any

from kvlab.params import MethodVariant, SweepParams, check_params
from kvlab.records import (
    RECORDS_FILE,
    RecordWriter,
    make_run_id,
    read_manifest,
    recorded_run_ids,
    utc_now,
    write_manifest,
)

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

    def identity(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("repeat")
        return d

    @property
    def run_id(self) -> str:
        return make_run_id(self.identity(), self.repeat)

    @property
    def variant(self) -> MethodVariant:
        return MethodVariant(self.method, dict(self.policy_kwargs))

    @property
    def shape(self) -> tuple[str, int, int]:
        return (self.model, self.ctx, self.batch)


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
    """All runs in execution order: model > ctx > batch > (repeat, prompt) blocks > shuffled variants."""
    vs = [v for _, v in variants]
    runs = []
    for model in params.models:
        for ctx in params.ctx:
            for batch in params.batch:
                for repeat in range(params.repeats):
                    for prompt_id in range(params.prompts):
                        for k in block_order(len(vs), params.seed, model, ctx, batch, repeat, prompt_id):
                            runs.append(RunSpec(
                                model=model, weights=params.weights, device=params.device, dtype=params.dtype,
                                attn_implementation=params.attn_implementation,
                                sdpa_backend=params.sdpa_backend, method=vs[k].method,
                                policy_kwargs=dict(vs[k].kwargs), ctx=ctx, batch=batch,
                                new_tokens=params.new_tokens, prompt_id=prompt_id, seed=params.seed,
                                repeat=repeat,
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


@dataclass
class SweepSummary:
    folder: str
    total: int
    already_done: int
    ok: int = 0
    failed: int = 0
    pending: int = 0
    stopped: str | None = None
    stale_lock: dict[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return self.pending == 0

    def line(self) -> str:
        text = (f"{self.folder}: {self.total} runs; {self.already_done} already recorded, {self.ok} ok and "
                f"{self.failed} failed now, {self.pending} pending")
        if self.stopped:
            text += f" (stopped: {self.stopped}; rerun the same command to continue)"
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
        "ctx": run.ctx, "batch": run.batch, "new_tokens": run.new_tokens, "prompt_id": run.prompt_id,
        "repeat": run.repeat, "seed": run.seed, "sdpa_backend": run.sdpa_backend,
        "attn_implementation": run.attn_implementation,
    }


class _ModelSession:
    """A loaded model plus its per-variant policies (checked, prepared and warmed once)."""

    def __init__(self, loaded, sampler, idle_w: float | None, gpu_name: str | None):
        self.loaded = loaded
        self.sampler = sampler
        self.idle_w = idle_w
        self.gpu_name = gpu_name
        self.policies: dict[tuple, Any] = {}
        self.broken: dict[tuple, str] = {}  # variant key (+ shape) -> error
        self.probes: dict[tuple, dict[str, Any]] = {}


def run_sweep(
    params: SweepParams,
    out_dir: str | Path,
    *,
    check_device: bool = True,
    progress: bool = True,
    loader: Callable[..., Any] | None = None,
    sampler_factory: Callable[..., Any] | None = None,
    log: Callable[[str], None] = print,
) -> SweepSummary:
    """Run (or resume) a sweep into ``out_dir``; returns what was done and what is left."""
    from tqdm.auto import tqdm

    from kvlab import env
    from kvlab.energy import make_sampler
    from kvlab.models import load_model

    loader = loader or load_model
    sampler_factory = sampler_factory or make_sampler
    variants = check_params(params, check_device=check_device)  # raises before any model loads
    threads = pinned_threads(params)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)  # recorded per run (``threads``) by kvlab.measure
    runs = expand(params, variants)
    out = Path(out_dir)
    sweep_name = params.name or out.name

    with SweepLock(out) as lock:
        if lock.stale:
            log(f"kvlab sweep: replaced a stale lock left by pid {lock.stale.get('pid')} (not running)")
        skip_statuses = {"ok"} if params.retry_failed else None
        done = recorded_run_ids(out, statuses=skip_statuses)
        pending = [r for r in runs if r.run_id not in done]
        summary = SweepSummary(str(out), total=len(runs), already_done=len(runs) - len(pending),
                               pending=len(pending), stale_lock=lock.stale)
        manifest = read_manifest(out) or {"sweep": sweep_name, "created_at": utc_now(), "invocations": []}
        plan_ids = [r.run_id for r in runs]
        part = is_part_of_plan(plan_ids, manifest.get("run_ids"))
        if part:
            log(f"kvlab sweep: running {len(runs)} of the {len(manifest['run_ids'])} runs planned in {out}; "
                f"its manifest keeps the whole plan")
        elif manifest.get("run_ids") and not set(manifest["run_ids"]) <= set(plan_ids):  # a superset extends it
            log(f"kvlab sweep: {out} held a different plan; its records stay, and load_records reads both "
                f"(use another -o to keep sweeps apart)")
        if not part:
            manifest.update(params=params.model_dump(mode="json"), n_runs=len(runs), run_ids=plan_ids)
        manifest.update(sweep=sweep_name, schema=1)
        invocation: dict[str, Any] = {"started_at": utc_now(), "pid": os.getpid(),
                                      "pending_at_start": len(pending), "env_start": env.snapshot(params.device)}
        if part:
            invocation["part_of_plan"] = {"n_runs": len(runs), "params": params.model_dump(mode="json")}
        manifest["invocations"].append(invocation)
        write_manifest(out, manifest)

        budget = Budget(max_runs=params.max_runs, time_budget_s=params.time_budget_s)
        writers = {name: RecordWriter(out / name) for name in (RECORDS_FILE, WARMUP_FILE, TIMELINES_FILE)}
        bar = tqdm(total=len(pending) + warmups_planned(pending, params.warmup_runs), desc="sweep",
                   disable=not progress or not pending, unit="run", dynamic_ncols=True)  # warm-ups count too
        sampler = None
        try:
            if pending:
                sampler = sampler_factory(params.device, interval_s=params.energy_interval_ms / 1000.0)
                invocation["energy_source"] = sampler.source
            for model_name, model_runs in groupby(pending, key=lambda r: r.model):
                if not budget.allows():
                    break
                model_runs = list(model_runs)
                session = _open_model(params, model_name, loader, sampler, model_runs, writers, summary, bar,
                                      sweep_name, invocation, log)
                if session is None:
                    continue
                try:
                    for _shape, shape_runs in groupby(model_runs, key=lambda r: r.shape):
                        _run_shape(params, session, list(shape_runs), writers, summary, bar, budget,
                                   sweep_name, out)
                        if budget.reason:
                            break
                finally:
                    session.loaded = None
                    session.policies.clear()
                    _release_memory(params.device)
            if params.quality is not None and not budget.reason:
                bar.close()  # the quality pass draws its own bar
                _quality_pass(params, variants, loader, writers[RECORDS_FILE], sweep_name, manifest, out, log,
                              progress)
        finally:
            bar.close()
            for w in writers.values():
                w.close()
            summary.stopped = budget.reason
            left = recorded_run_ids(out, statuses=skip_statuses)
            summary.pending = sum(1 for r in runs if r.run_id not in left)
            plan_pending = sum(1 for i in manifest["run_ids"] if i not in left)
            invocation.update(finished_at=utc_now(), ok=summary.ok, failed=summary.failed,
                              pending_at_end=summary.pending, stopped=budget.reason,
                              env_end=env.snapshot(params.device))
            if sampler is not None:
                sampler.close()
            manifest["status"] = "complete" if plan_pending == 0 else "incomplete"
            write_manifest(out, manifest)
            _write_parquet(out, log)
    return summary


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
    """Quality records for every model and method, once per model (marked done in the manifest).

    A pass killed midway reruns whole; its records have stable run ids, so ``load_records`` keeps
    one copy of each.
    """
    from kvlab.policies import make_policy
    from kvlab.quality import TaskSpec, quality_notes, run_quality

    done = manifest.setdefault("quality_done", {})
    spec = TaskSpec(**params.quality)
    for model_name in params.models:
        if done.get(model_name):
            continue
        log(f"kvlab sweep: quality pass on {model_name} ({', '.join(spec.tasks)} at {spec.lengths})")
        if params.weights == "synthetic":
            log("kvlab sweep: quality on synthetic weights is meaningless (mechanics only); "
                "its records say weights: synthetic")
        loaded = loader(model_name, weights=params.weights, device=params.device, dtype=params.dtype,
                        seed=params.seed, attn_implementation=params.attn_implementation)
        try:
            policies = [make_policy(v.method, **v.kwargs) for _, v in variants]
            records = run_quality(loaded, policies, spec, out_writer=writer, base={"sweep": sweep_name},
                                  progress_bar=progress)
            for note in quality_notes(records):
                log(f"kvlab sweep: note: {note}")
        finally:
            del loaded
            _release_memory(params.device)
        done[model_name] = True
        write_manifest(out, manifest)


def _open_model(params, model_name, loader, sampler, model_runs, writers, summary, bar, sweep_name,
                invocation, log) -> _ModelSession | None:
    """Load a model and take its idle baseline; on failure record every pending run of it."""
    try:
        loaded = loader(model_name, weights=params.weights, device=params.device, dtype=params.dtype,
                        seed=params.seed, attn_implementation=params.attn_implementation)
    except Exception as err:
        message = f"model load failed: {_short_error(err)}"
        log(f"kvlab sweep: {model_name}: {message}")
        for run in model_runs:
            _write_failure(writers, run, sweep_name, message, summary, bar, {})
        _release_memory(params.device)
        return None
    idle_w = sampler.measure_idle(params.idle_s) if params.idle_s > 0 else None
    invocation.setdefault("idle_w", {})[model_name] = idle_w
    gpu_name = getattr(sampler, "gpu", {}).get("gpu_name")
    if gpu_name is None and str(params.device).startswith("cuda"):
        import torch

        gpu_name = torch.cuda.get_device_name(torch.device(params.device))
    return _ModelSession(loaded, sampler, idle_w, gpu_name)


def _write_failure(writers, run, sweep_name, message, summary, bar, extra) -> None:
    rec = _identity_record(run, sweep_name)
    rec.update(extra)
    rec.update(status="failed", error=message)
    writers[RECORDS_FILE].append(rec)
    summary.failed += 1
    bar.update(1)


def _policy_for(session: _ModelSession, variant: MethodVariant):
    """The checked, prepared and warmed policy of a variant (built once per model load)."""
    from kvlab.policies import make_policy

    key = variant.key()
    if key in session.broken:
        raise RuntimeError(session.broken[key])
    if key not in session.policies:
        try:
            policy = make_policy(variant.method, **variant.kwargs)
            policy.check(session.loaded.model)
            policy.prepare(session.loaded.model)
            started = time.perf_counter()
            policy.warmup(session.loaded.model)  # e.g. quanto's CUDA build: minutes once, never measured
            took = time.perf_counter() - started
            if took > 5:
                print(f"kvlab sweep: {policy.label} one-off warm-up (kernel builds) took {took:.0f} s",
                      file=sys.stderr, flush=True)
        except Exception as err:
            session.broken[key] = f"policy setup failed: {_short_error(err)}"
            raise RuntimeError(session.broken[key]) from None
        session.policies[key] = policy
    return session.policies[key]


def _measure(params, session, run: RunSpec, policy, probe: bool):
    from kvlab.measure import measure_generation

    return measure_generation(
        session.loaded, policy, ctx=run.ctx, batch=run.batch, new_tokens=run.new_tokens,
        prompt_id=run.prompt_id, seed=run.seed, sampler=session.sampler, sdpa_backend=run.sdpa_backend,
        idle_w=session.idle_w, probe=probe,
    )


def _base_record(session, run, sweep_name, kind, policy) -> dict[str, Any]:
    rec = _identity_record(run, sweep_name, kind)
    prov = session.loaded.provenance()
    rec.update(weights=prov.get("weights"), dtype=prov.get("dtype"), gpu_name=session.gpu_name)
    if policy is not None:
        rec.update(label=policy.label, policy_params=policy.params(), keep=policy.keep, bits=policy.bits)
    return rec


def _run_shape(params, session, runs: list[RunSpec], writers, summary, bar, budget, sweep_name, out) -> None:
    """Warm up every variant of one (model, ctx, batch) shape, then measure its runs in order."""
    first_of: dict[tuple, RunSpec] = {}
    for run in runs:
        first_of.setdefault(run.variant.key(), run)
    for key, run in first_of.items():
        for w in range(params.warmup_runs):
            if not budget.allows():
                return
            bar.set_postfix_str(f"warm-up {run.method} ctx={run.ctx} b={run.batch}", refresh=False)
            _warm_up(params, session, run, key, w, writers, budget, sweep_name)
            bar.update(1)
            if (key, run.shape) in session.broken:
                bar.update(params.warmup_runs - w - 1)  # the skipped warm-ups of a broken variant
                break
    for run in runs:
        if not budget.allows():
            return
        if params.jitter_ms > 0:
            time.sleep(random.Random(run.run_id).uniform(0, params.jitter_ms / 1000.0))
        _measured_run(params, session, run, writers, summary, bar, budget, sweep_name, out)


def _warm_up(params, session, run, key, index, writers, budget, sweep_name) -> None:
    started = time.monotonic()
    rec: dict[str, Any] = {}
    error = None
    try:
        policy = _policy_for(session, run.variant)
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
    rec.update(warmup_index=index, status="failed" if error else "ok", error=error)
    writers[WARMUP_FILE].append(rec)
    budget.spent(time.monotonic() - started, measured=False)


def _measured_run(params, session, run, writers, summary, bar, budget, sweep_name, out) -> None:
    started = time.monotonic()
    key = run.variant.key()
    rec = _identity_record(run, sweep_name)
    error = None
    timeline = None
    try:
        if (key, run.shape) in session.broken:
            raise RuntimeError(session.broken[(key, run.shape)])
        policy = _policy_for(session, run.variant)
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
        with open(out / ERRORS_FILE, "a", encoding="utf-8") as f:
            f.write(f"--- {utc_now()} run {run.run_id} ({run.method} ctx={run.ctx} batch={run.batch})\n")
            f.write(traceback.format_exc())
    if error:
        _release_memory(params.device)
    rec.update(status="failed" if error else "ok", error=error, created_at=utc_now())
    writers[RECORDS_FILE].append(rec)
    if timeline is not None:
        writers[TIMELINES_FILE].append(timeline)
    if error:
        summary.failed += 1
    else:
        summary.ok += 1
    bar.set_postfix_str(f"{run.method} ctx={run.ctx} b={run.batch}", refresh=False)
    bar.update(1)
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
