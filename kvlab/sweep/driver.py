"""The driver: run (or resume) a sweep into its folder, under its lock, as the one writer.

Resumability: each run has a stable id (:mod:`kvlab.sweep.plan`); runs already recorded ok in
``records.jsonl`` are skipped, so a sweep killed at any point and rerun finishes with no duplicate
and no lost run. Runs recorded as failed are retried by a rerun (``retry_failed: false`` keeps
them). The quality pass resumes the same way, per item. A lock file stops two sweeps from writing
one folder (:mod:`kvlab.sweep.lock`).

Status (manifest ``status``, and the CLI's exit code): ``complete`` only when every planned run (and
the quality pass) is recorded ok; ``failed_runs`` when all are recorded but some failed;
``incomplete`` while some are not recorded yet (stopped by a budget or killed).

Where runs execute (this process, a child process per group, Ray workers) is the executor's job
(:mod:`kvlab.runner`); they all call :func:`kvlab.sweep.group.run_group` and report to the one
writer here (:class:`kvlab.runner.sink.DriverSink`).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvlab import env, models
from kvlab.energy import make_sampler
from kvlab.engine.engines import release_memory
from kvlab.errors import StorageError, UserError
from kvlab.hostload import cpu_threads
from kvlab.policies import make_policy
from kvlab.quality import TaskSpec, quality_notes, run_quality
from kvlab.quality.spec import items_problem
from kvlab.records import (
    RECORDS_FILE,
    RecordWriter,
    latest_status,
    read_manifest,
    read_records,
    recorded_run_ids,
    utc_now,
    write_manifest,
    write_parquet,
)
from kvlab.runner import make_executor
from kvlab.runner.sink import DriverSink
from kvlab.sweep.checks import check_params
from kvlab.sweep.lock import SweepLock
from kvlab.sweep.params import SweepParams
from kvlab.sweep.plan import (
    Budget,
    RunSpec,
    expand,
    is_part_of_plan,
    plan_params,
    short_error,
    warmups_planned,
)

WARMUP_FILE = "warmup.jsonl"
TIMELINES_FILE = "timelines.jsonl"
ERRORS_FILE = "errors.log"


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


def pinned_threads(params: SweepParams) -> int | None:
    """torch's thread count for a sweep: ``threads`` if set, else on CPU a stable number
    (:func:`kvlab.hostload.cpu_threads`), so runs of one folder compare like with like; on a GPU
    torch's default (the host thread mostly launches kernels)."""
    if params.threads is not None:
        return params.threads
    return None if str(params.device).startswith("cuda") else cpu_threads()


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
    replaces the params' grid (kvlab.sweep.admission adds at-budget runs to it). ``log`` defaults to
    ``tqdm.write``: a line printed under a live progress bar, not into it."""
    log = log or tqdm.write
    variants = check_params(params, check_device=check_device,  # raises before any model loads
                            own_loader=loader is not None)
    if params.quality is not None and params.weights != "synthetic" and loader is None:
        check_quality_items(params, log)
    loader = loader or models.load_model  # looked up per call: tests refuse any load
    sampler_factory = sampler_factory or make_sampler
    threads = pinned_threads(params)
    if threads is not None:
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
            # new methods (perf: false plans no run ids, so the params say it): their quality items are
            # pending too (items already recorded ok are skipped per item)
            if (set(manifest.get("run_ids") or plan_ids) != set(plan_ids)
                    or manifest.get("params", plan_params(params)) != plan_params(params)):
                manifest.pop("quality_done", None)
            manifest.update(params=plan_params(params), n_runs=len(runs), run_ids=plan_ids)
        manifest.update(sweep=sweep_name, schema=1, status="incomplete")  # until this invocation ends
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
            no_room = isinstance(sys.exc_info()[1], StorageError)  # its one line says it all
            summary.stopped = budget.reason
            with warnings.catch_warnings():
                if no_room:  # the line the failed write tore; a resume skips it with this warning
                    warnings.simplefilter("ignore")
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
            try:
                write_manifest(out, manifest)
            except StorageError:
                if not no_room:
                    raise  # else the first failed write's line stands; the manifest on disk says incomplete
            if not no_room:
                _write_parquet(out, log)
    return summary


def check_quality_items(params: SweepParams, log: Callable[[str], None]) -> None:
    """Build every model's quality items with its tokenizer alone (no model load, no run): a task the
    tokenizer cannot build is refused now, not after the perf runs."""
    spec = TaskSpec(**params.quality)
    for model_name in params.models:
        started = time.monotonic()
        problem = items_problem(spec, models.load_tokenizer(model_name), model_name)
        if problem:
            raise UserError(problem)
        log(f"kvlab sweep: quality items of {model_name} built with its tokenizer "
            f"({time.monotonic() - started:.1f} s)")


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
    if not (out / RECORDS_FILE).is_file():
        return
    try:
        write_parquet(out)
    except Exception as err:  # noqa: BLE001 - a convenience copy must not fail a finished sweep
        log(f"kvlab sweep: records.parquet not written ({short_error(err)}); records.jsonl has every run")


def _quality_pass(params, variants, loader, writer, sweep_name, manifest, out, log, progress=True) -> None:
    """Quality records for every model and method, resumed per item like the performance runs.

    ``manifest["quality_done"][model]`` is True once a model's pass has every record ok (the rerun
    then loads nothing), else ``{"failed": n, "error": ...}``: a rerun retries the failed items
    unless ``retry_failed`` is false. Items already recorded ok are never run or written again, so
    a pass killed midway (even between its last record and this mark) resumes with no duplicate.
    """
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
            message = short_error(err)
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
            release_memory(params.device)
        write_manifest(out, manifest)


