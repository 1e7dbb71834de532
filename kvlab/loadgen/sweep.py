"""A serving sweep's ``traffic:`` block sent to a running server (``target: URL``): every rate and
repeat replayed by the load generator, one folder per run (``run.json``, ``requests.jsonl``) and one
row per run in ``serve_runs.jsonl``, as the in-process serving sweep writes them. The server runs
one cache method; which one is the server's business (its ``/metrics`` says for kvlab serve).
Prompts are seeded token ids of the drawn lengths (no tokenizer needed on the client)."""

from __future__ import annotations

from pathlib import Path

from kvlab.errors import UserError
from kvlab.loadgen.run import run_load
from kvlab.loadgen.trace import items_from_workload
from kvlab.models import get_spec
from kvlab.serve.sweep_rows import append_row, failure
from kvlab.serve.workload import build_workload


def run_target_sweep(params, out_dir, *, log=print) -> list[dict]:
    """Every rate x repeat of ``params.traffic`` against ``params.traffic.target``; returns the rows."""
    traffic = params.traffic
    if traffic is None or traffic.target is None:
        raise UserError("run_target_sweep needs a traffic: block with target: URL")
    if traffic.lengths.kind == "sharegpt":
        raise UserError("traffic.target: ShareGPT prompts need the model's tokenizer on the client; give token "
                        "lengths (fixed, lognormal, trace, mooncake)")
    vocab = get_spec(params.models[0]).vocab_size
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for repeat in range(params.repeats):
        spec = traffic.model_copy(update={"seed": traffic.seed + repeat})
        for rate in traffic.rates():
            label = f"target-rate{rate if rate is not None else 'na'}-rep{repeat}"
            row = {"run": label, "model": params.models[0], "method": "external", "target": traffic.target,
                   "rate": rate, "repeat": repeat}
            try:
                items = items_from_workload(build_workload(spec, rate, None, vocab))
                res = run_load(traffic.target, items, out / label, meta=row,
                               slo=traffic.slo.as_dict() if traffic.slo else None)
                row.update(status=res.status, **res.card, **res.metrics)
            except Exception as err:  # a failed run is recorded, the sweep goes on
                row.update(failure(err))
            append_row(out, rows, row, log)
    return rows
