"""The measured group of runs in one process: one model load per model, then per (ctx, batch)
shape every method variant's warm-ups and its measured runs.

Every variant with pending runs is first warmed up by replaying that exact shape (same ctx, batch
and new tokens: on the H200 cuDNN builds an SDPA plan per KV length, so a cold pass is 2-3x
slower). A run that raises (CUDA OOM or anything else) is recorded as failed with its error, its
memory is released, and the group goes on. :func:`run_group` is the seam every executor
(:mod:`kvlab.runner`) calls, in the driver, a child process or a Ray worker; everything measured
goes to its ``sink``.
"""

from __future__ import annotations

import random
import socket
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from itertools import groupby
from typing import Any

from tqdm import tqdm

from kvlab import measure
from kvlab.card import CARD_FIELDS, device_card
from kvlab.columns import model_columns, policy_columns
from kvlab.engine.engines import EngineSet, release_memory
from kvlab.policies import make_policy
from kvlab.records import utc_now
from kvlab.sweep.params import MethodVariant, SweepParams
from kvlab.sweep.plan import (
    FAILED_ENERGY_SOURCE,
    Budget,
    RunSpec,
    failure_record,
    identity_record,
    short_error,
)
from kvlab.weights_quant import quantize_weights, weights_label


class ModelSession:
    """A loaded model plus its per-variant policies (checked, prepared and warmed once) and its engines."""

    def __init__(self, loaded, sampler, idle_w: float | None):
        self.loaded = loaded
        self.sampler = sampler
        self.idle_w = idle_w
        self.gpu = dict(getattr(sampler, "gpu", None) or {})  # the sampler's GPU, found by UUID
        self.host = socket.gethostname()
        self.policies: dict[tuple, Any] = {}
        self.broken: dict[tuple, str] = {}  # variant key (+ shape) -> error
        self.warmed: set[tuple] = set()  # (variant key, engine) whose one-off warm-up ran
        self.probes: dict[tuple, dict[str, Any]] = {}
        self.attached = ExitStack()  # policies stay attached while the model is loaded
        self.engines = EngineSet(loaded)  # one engine per name; getting one releases the others

    def policy(self, variant: MethodVariant, engine: str = "hf"):
        """The checked, prepared and warmed policy of a variant (built once per model load; warmed once
        per engine, for what that engine runs: on ``fast`` a quantized policy's prefill policy, so a
        sweep whose quanto runs are all on ``fast`` never pays quanto's CUDA build, 95 s on a fresh H200)."""
        key = variant.key()
        if key in self.broken:
            raise RuntimeError(self.broken[key])
        try:
            if key not in self.policies:
                self.policies[key] = self.attached.enter_context(
                    make_policy(variant.method, **variant.kwargs).attach(self.loaded.model, warm=False))
            policy = self.policies[key]
            if (key, engine) not in self.warmed:
                started = time.perf_counter()
                # one-off costs (e.g. quanto's CUDA build: minutes once), never measured
                self.engines.get(engine).storage_policy(policy).warmup(self.loaded.model)
                self.warmed.add((key, engine))
                took = time.perf_counter() - started
                if took > 5:
                    tqdm.write(f"kvlab sweep: {policy.label} one-off warm-up (kernel builds) took {took:.0f} s",
                               file=sys.stderr)
        except Exception as err:
            self.broken[key] = f"policy setup failed: {short_error(err)}"
            raise RuntimeError(self.broken[key]) from None
        return policy

    def close(self, device: str) -> None:
        """Detach the policies and drop the model, its engines and their memory."""
        self.attached.close()
        self.loaded = None
        self.engines = None
        self.policies.clear()
        release_memory(device)


def run_group(params: SweepParams, runs: list[RunSpec], sink, budget: Budget, *, loader: Callable[..., Any],
              sampler, sweep_name: str) -> None:
    """Measure ``runs`` (pending, in plan order) in this process: one model load per model, then per
    (ctx, batch) shape its warm-ups and measured runs. Everything measured goes to ``sink``
    (:mod:`kvlab.runner.sink`)."""
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
            session.close(params.device)


def _open_model(params, model_name, loader, sampler, model_runs, sink, sweep_name,
                weights_quant: str = "none") -> ModelSession | None:
    """Load a model (its weights quantized if asked) and take its idle baseline; on failure record
    every pending run of it."""
    sink.begin("load", model_runs[0].run_id)
    started = time.monotonic()
    try:
        loaded = loader(model_name, weights=params.weights, device=params.device, dtype=params.dtype,
                        seed=params.seed, attn_implementation=params.attn_implementation)
        quantize_weights(loaded.model, weights_quant)
    except Exception as err:
        message = f"model load failed: {short_error(err)}"
        sink.log(f"kvlab sweep: {model_name}: {message}")
        card = device_card(params.device, gpu=getattr(sampler, "gpu", None))
        for run in model_runs:
            sink.record(failure_record(run, sweep_name, message, card))
        release_memory(params.device)
        return None
    sink.log(f"kvlab sweep: loaded {model_name} in {time.monotonic() - started:.1f} s")
    idle_w = sampler.measure_idle(params.idle_s) if params.idle_s > 0 else None
    sink.idle(model_name, idle_w)
    return ModelSession(loaded, sampler, idle_w)


def _measure(session: ModelSession, run: RunSpec, policy, probe: bool):
    return measure.measure_generation(  # looked up per call: tests stand in for it
        session.loaded, policy, ctx=run.ctx, batch=run.batch, new_tokens=run.new_tokens,
        prompt_id=run.prompt_id, seed=run.seed, sampler=session.sampler, sdpa_backend=run.sdpa_backend,
        idle_w=session.idle_w, probe=probe, engine=session.engines.get(run.engine), prefill_rows=run.prefill_rows,
    )


def _base_record(session: ModelSession, run: RunSpec, sweep_name: str, kind: str, policy) -> dict[str, Any]:
    """The run's identity, then the shared model and policy columns (:mod:`kvlab.columns`)."""
    rec = identity_record(run, sweep_name, kind)
    model = model_columns(session.loaded, gpu=session.gpu)
    rec.update({k: model.get(k) for k in ("weights", "dtype", *CARD_FIELDS)}, host=session.host)
    cols = policy_columns(policy, run.engine)
    rec.update(cols, label=weights_label(cols["label"], run.weights_quant))
    return rec


def _run_shape(params, session: ModelSession, runs: list[RunSpec], sink, budget, sweep_name) -> None:
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


def _warm_up(params, session: ModelSession, run: RunSpec, key, index, sink, budget, sweep_name) -> None:
    sink.begin("warmup", run.run_id)
    started = time.monotonic()
    rec: dict[str, Any] = {}
    error = None
    try:
        policy = session.policy(run.variant, run.engine)
        rec = _base_record(session, run, sweep_name, "warmup", policy)
        # The kernel probe (torch.profiler) names the SDPA kernel and times GPU kernels; on a CPU it
        # has no kernel time to give and made the smoke sweep's warm-ups 4x slower than its runs
        # (378 s for 20 warm-ups vs 271 s for 60 runs), so CPU sweeps skip it.
        probe = index == 0 and str(session.loaded.device).startswith("cuda")
        m = _measure(session, run, policy, probe=probe)
        rec.update(m.record)
        if index == 0:
            session.probes[(key, run.shape)] = {k: m.record.get(k) for k in ("sdpa_kernel", "decode_kernel_ms")}
        del m
    except Exception as err:
        error = short_error(err)
        rec = rec or identity_record(run, sweep_name, "warmup")
        session.broken[(key, run.shape)] = f"warm-up failed: {error}"
    if error:
        release_memory(params.device)
        rec["energy_source"] = rec.get("energy_source") or FAILED_ENERGY_SOURCE
    rec.update(warmup_index=index, status="failed" if error else "ok", error=error)
    sink.warmup(rec)
    budget.spent(time.monotonic() - started, measured=False)


def _measured_run(params, session: ModelSession, run: RunSpec, sink, budget, sweep_name) -> None:
    sink.begin("run", run.run_id)
    started = time.monotonic()
    key = run.unit()
    rec = identity_record(run, sweep_name)
    error = None
    timeline = None
    try:
        if (key, run.shape) in session.broken:
            raise RuntimeError(session.broken[(key, run.shape)])
        policy = session.policy(run.variant, run.engine)
        rec = _base_record(session, run, sweep_name, "perf", policy)
        m = _measure(session, run, policy, probe=False)
        rec.update(m.record)
        rec.update(session.probes.get((key, run.shape), {}))
        if params.timelines and m.window.timeline is not None:
            timeline = {"run_id": run.run_id, "t0": 0.0, "phases": m.window.phase_s(),
                        **m.window.timeline.relative_to(m.window.t0)}
        del m
    except Exception as err:
        error = short_error(err)
        sink.error_log(f"--- {utc_now()} run {run.run_id} ({run.method} ctx={run.ctx} batch={run.batch})\n"
                       + traceback.format_exc())
    if error:
        release_memory(params.device)
        rec["energy_source"] = rec.get("energy_source") or FAILED_ENERGY_SOURCE
    rec.update(status="failed" if error else "ok", error=error, created_at=utc_now())
    sink.record(rec)
    if timeline is not None:
        sink.timeline(timeline)
    budget.spent(time.monotonic() - started, measured=True)

