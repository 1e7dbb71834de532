"""The run plan: every run a sweep does, in order, with its stable id; the run budget; and the
identity and failure records that every executor writes for a run.

Order: per model, per (ctx, batch) shape, the measured runs come in randomized complete blocks:
each block is one (repeat, prompt) and runs every (variant, engine) pair once in a seeded random
order, so drift in temperature or host noise does not line up with a method.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvlab.card import unmeasured_card
from kvlab.engine import prefill_rows
from kvlab.records import make_run_id, recorded_run_ids, utc_now
from kvlab.sweep.checks import check_params
from kvlab.sweep.params import MethodVariant, SweepParams
from kvlab.workload import workload_points

MAX_ERROR_CHARS = 2000  # a record's ``error`` (the traceback goes to errors.log)
FAILED_ENERGY_SOURCE = "none: the run failed before its energy was measured"
IDENTITY_DEFAULTS = {"ctx_dist": None, "ctx_sample": None, "weights_quant": "none", "budget_gb": None,
                     "prefill_rows": None}
EXECUTION_KEYS = ("executor", "ray_address")


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
    budget_gb: float | str | None = None  # an at-budget run: batch is the admitted batch (kvlab.sweep.admission)
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
    (repeat, prompt) blocks > shuffled (variant, engine) pairs; none with ``perf: false``."""
    if not params.perf:
        return []
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


def planned_runs(params: SweepParams, out_dir: str | Path | None = None,
                 check_device: bool = False) -> list[RunSpec]:
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


def warmups_planned(pending: list[RunSpec], warmup_runs: int) -> int:
    """Warm-up runs a sweep will do for its pending runs: ``warmup_runs`` per variant and shape
    (as :mod:`kvlab.sweep.group` warms up), so the progress bar's ETA covers them (minutes on a CPU)."""
    return warmup_runs * len({(r.shape, r.variant.key()) for r in pending})


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


# --------------------------------------------------------------------------------------------
# Records every executor writes for a run
# --------------------------------------------------------------------------------------------


def clip_error(text: str) -> str:
    """An error as a record keeps it: at most :data:`MAX_ERROR_CHARS` characters."""
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def short_error(err: BaseException) -> str:
    """``Type: message`` of an exception, clipped for a record."""
    return clip_error(f"{type(err).__name__}: {err}")


def identity_record(run: RunSpec, sweep: str, kind: str = "perf") -> dict[str, Any]:
    """The columns a run's record has whatever happened to it: its identity and plan."""
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


def failure_record(run: RunSpec, sweep: str, error: str, card: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The record of a run that never got measured (its model failed to load, its worker died), with
    the card it was to run on (``card``: the fields its worker named; :func:`kvlab.card.unmeasured_card`)."""
    rec = identity_record(run, sweep)
    rec.update(status="failed", error=clip_error(error), energy_source=FAILED_ENERGY_SOURCE,
               **unmeasured_card(run.device, card))
    return rec
