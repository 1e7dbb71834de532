"""Memory-budgeted concurrency: how many sequences each method admits in a memory budget, measured.

Why: a smaller cache only pays at scale if the freed memory becomes scheduled work, and the verdict
at production concurrency can differ from single-stream (throughput rises while each request gets
slower). With ``budget_gb: 40`` (or ``budget_gb: gpu``, the GPU's free memory less a margin) a sweep:

1. measures every method at the ``batch`` values listed (the probes; batch 1 is the single-stream
   view), as any sweep;
2. fits each method's measured peak memory against batch (``peak = base + per_sequence x batch``,
   least squares over the probe batches) and admits ``floor((budget - base) / per_sequence)``
   sequences (:func:`admit`; ``budget_max_batch`` caps it, for a command's time limit);
3. runs every method at its admitted batch and checks the run: recorded ok with its peak within the
   budget confirms it; an OOM or a peak over the budget steps the batch down by the excess (or 10%)
   and runs again, up to :data:`MAX_ROUNDS` rounds.

At-budget records carry ``budget_gb``, ``budget_bytes``, ``admitted_batch`` (their ``batch``) and
the fit (``admission_fitted_batch``, ``admission_per_sequence_bytes``, ``admission_base_bytes``,
``admission_capped``),
next to the allocated cache bytes every record has (``cache_bytes``; on the fast engine also
``cache_bytes_allocated``), so "freed memory became scheduled work" is checked from records. The fit
and every attempt are written to ``admission.json`` in the sweep folder.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvlab.capacity import fit_peaks
from kvlab.records import RECORDS_FILE, canonical_json, read_records
from kvlab.sweep.checks import check_params
from kvlab.sweep.driver import SweepSummary, run_sweep
from kvlab.sweep.params import SweepParams
from kvlab.sweep.plan import RunSpec, expand

ADMISSION_FILE = "admission.json"
GPU_MARGIN = 0.05  # of the free memory, left for the allocator's fragmentation and other processes
MAX_ROUNDS = 3  # admit, run, step down: at most this many rounds per invocation
OOM_STEP = 0.1  # an at-budget run that ran out of memory retries with this fraction fewer sequences


def resolve_budget_bytes(budget_gb: float | str, device: str) -> int:
    """The budget in bytes: GB as given (decimal), or the GPU's free memory less :data:`GPU_MARGIN`."""
    if budget_gb != "gpu":
        return int(float(budget_gb) * 1e9)
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free * (1 - GPU_MARGIN))


def admit(base: float, per_sequence: float, budget_bytes: float, cap: int | None = None) -> int:
    """Sequences that fit: ``floor((budget - base) / per_sequence)``, at most ``cap``; 0 if none does."""
    if per_sequence <= 0:
        raise ValueError(f"peak memory does not grow with batch ({per_sequence:.0f} B per sequence): probe larger "
                         f"batches or longer contexts")
    n = max(0, math.floor((budget_bytes - base) / per_sequence))
    return min(n, cap) if cap is not None else n


# --------------------------------------------------------------------------------------------
# The plan: from records to at-budget runs
# --------------------------------------------------------------------------------------------


def unit_key(run: RunSpec) -> str:
    """What admission is decided for: a run's identity without batch, prompt and repeat."""
    ident = run.identity()
    for key in ("batch", "prompt_id", "budget_gb", "budget_bytes"):
        ident.pop(key, None)
    return canonical_json(ident)


@dataclass
class Admission:
    """One method's (at one context, engine, weights) admitted batch and how it was decided."""

    unit: str
    label: str
    per_sequence_bytes: float | None = None
    base_bytes: float | None = None
    fitted_batch: int | None = None
    batch: int = 0  # the batch to run (or confirmed); 0: none admitted
    confirmed: bool = False
    capped: bool = False
    reason: str | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)

    def fit(self) -> dict[str, Any]:
        """What at-budget records carry (as ``admission_*``): the fit and whether a cap cut it."""
        return {"fitted_batch": self.fitted_batch, "per_sequence_bytes": self.per_sequence_bytes,
                "base_bytes": self.base_bytes, "capped": self.capped, "attempts": len(self.attempts)}


def at_budget(run: RunSpec, batch: int, budget_gb: float | str, budget_bytes: int) -> RunSpec:
    return replace(run, batch=batch, budget_gb=budget_gb, budget_bytes=budget_bytes)


def admission_plan(probes: list[RunSpec], records: dict[str, dict[str, Any]], budget_gb: float | str,
                   budget_bytes: int, cap: int | None = None) -> list[Admission]:
    """Per unit of the probe runs: the fitted batch from its ok probe records' peaks, stepped down
    past at-budget attempts recorded failed or over the budget; confirmed when the attempt at that
    batch is recorded ok within the budget. ``records`` maps run id to its latest record."""
    units: dict[str, list[RunSpec]] = {}
    for run in probes:
        units.setdefault(unit_key(run), []).append(run)
    out = []
    for key, runs in units.items():
        single = [r for r in runs if r.batch == 1]
        adm = Admission(unit=key, label=_label(runs, records))
        points = [(r.batch, float(records[r.run_id]["peak_mem_bytes"])) for r in runs
                  if records.get(r.run_id, {}).get("status") == "ok" and records[r.run_id].get("peak_mem_bytes")]
        peaks: dict[int, list[float]] = {}
        for b, p in points:
            peaks.setdefault(b, []).append(p)
        try:
            line = fit_peaks([(b, statistics.median(v)) for b, v in peaks.items()])
            adm.base_bytes, adm.per_sequence_bytes = line.intercept, line.slope
            fitted = admit(adm.base_bytes, adm.per_sequence_bytes, budget_bytes)
        except ValueError as err:
            adm.reason = f"no fit from the probe records: {err}"
            out.append(adm)
            continue
        adm.fitted_batch = fitted
        adm.capped = cap is not None and fitted > cap
        b = min(fitted, cap) if cap is not None else fitted
        while b >= 1:
            recs = [records[r.run_id] for r in (at_budget(s, b, budget_gb, budget_bytes) for s in single)
                    if r.run_id in records]
            bad = [r for r in recs if r.get("status") != "ok"]
            over = [float(r["peak_mem_bytes"]) - budget_bytes for r in recs
                    if r.get("status") == "ok" and (r.get("peak_mem_bytes") or 0) > budget_bytes]
            if not bad and not over:
                adm.batch = b
                adm.confirmed = len(recs) == len(single)
                break
            why = (f"peak {max(over) / 1e9 + budget_bytes / 1e9:.2f} GB over the {budget_bytes / 1e9:.2f} GB budget"
                   if over else str(bad[0].get("error") or "failed")[:200])
            adm.attempts.append({"batch": b, "why": why})
            step = math.ceil(max(over) / adm.per_sequence_bytes) if over else math.ceil(b * OOM_STEP)
            b -= max(1, step)
        if adm.batch == 0 and adm.reason is None:
            adm.reason = (f"the {budget_bytes / 1e9:.2f} GB budget admits no sequence (base "
                          f"{adm.base_bytes / 1e9:.2f} GB + {adm.per_sequence_bytes / 1e9:.3f} GB per sequence)")
        out.append(adm)
    return out


def _label(runs: list[RunSpec], records: dict[str, dict[str, Any]]) -> str:
    for r in runs:
        if records.get(r.run_id, {}).get("label"):
            return str(records[r.run_id]["label"])
    return runs[0].method


def budget_runs(probes: list[RunSpec], plan: list[Admission], budget_gb: float | str,
                budget_bytes: int) -> list[RunSpec]:
    """The at-budget runs of a plan: each unit's single-stream runs (every prompt and repeat) at its
    admitted batch, grouped by shape so each (model, ctx, batch) loads and warms up once."""
    admitted = {a.unit: a for a in plan if a.batch >= 1}
    order = {key: i for i, key in enumerate(dict.fromkeys(unit_key(r) for r in probes))}
    runs = [replace(at_budget(r, admitted[unit_key(r)].batch, budget_gb, budget_bytes),
                    budget_fit=admitted[unit_key(r)].fit()) for r in probes
            if r.batch == 1 and unit_key(r) in admitted]
    first = {}
    for r in probes:
        first.setdefault((r.model, r.weights_quant, r.ctx, r.ctx_sample), len(first))
    return sorted(runs, key=lambda r: (first[(r.model, r.weights_quant, r.ctx, r.ctx_sample)], r.batch,
                                       r.repeat, r.prompt_id, order[unit_key(r)]))


def write_admission(out: Path, budget_gb, budget_bytes: int, plan: list[Admission]) -> None:
    data = {"budget_gb": budget_gb, "budget_bytes": budget_bytes, "gpu_margin": GPU_MARGIN if budget_gb == "gpu"
            else None, "units": [asdict(a) for a in plan]}
    (out / ADMISSION_FILE).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def stored_budget_bytes(out: Path, budget_gb) -> int | None:
    """A folder's resolved budget, so a resumed ``budget_gb: gpu`` sweep keeps its run ids."""
    path = out / ADMISSION_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return data.get("budget_bytes") if data.get("budget_gb") == budget_gb else None


# --------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------


def run_budgeted(params: SweepParams, out_dir: str | Path, log=print, **sweep_kw) -> SweepSummary:
    """Probes (the listed batches), then each method at its admitted batch, confirmed by its run;
    resumable like any sweep (rerun the same command)."""
    started = time.monotonic()
    out = Path(out_dir)
    summary = run_sweep(params, out, log=log, **sweep_kw)
    if summary.stopped:
        return summary
    probes = expand(params, check_params(params, check_device=False, own_loader="loader" in sweep_kw))
    budget_bytes = stored_budget_bytes(out, params.budget_gb) or resolve_budget_bytes(params.budget_gb, params.device)
    for _ in range(MAX_ROUNDS):
        latest = {r["run_id"]: r for r in read_records(out / RECORDS_FILE) if r.get("kind") == "perf"}
        plan = admission_plan(probes, latest, params.budget_gb, budget_bytes, params.budget_max_batch)
        write_admission(out, params.budget_gb, budget_bytes, plan)
        for a in plan:
            if a.reason:
                log(f"kvlab sweep: at budget: {a.label}: {a.reason}")
        runs = budget_runs(probes, plan, params.budget_gb, budget_bytes)
        if all(a.confirmed for a in plan if a.batch >= 1):
            break
        log("kvlab sweep: at budget " + ", ".join(f"{a.label} x{a.batch}" for a in plan if a.batch >= 1
                                                   and not a.confirmed))
        left = None
        if params.time_budget_s is not None:
            left = params.time_budget_s - (time.monotonic() - started)
            if left <= 0:
                summary.stopped = f"time_budget_s={params.time_budget_s:g} nearly spent"
                break
        summary = run_sweep(params.model_copy(update={"time_budget_s": left}), out, runs=probes + runs, log=log,
                            **sweep_kw)
        if summary.stopped:
            break
    return summary
