"""The serving sweep: every model x method x rate x repeat of a params file's ``traffic:`` block.

Checks everything before a model loads (``kvlab.sweep.checks.check_params(serving=True)``: models,
methods and their parameters, the traffic block). Repeats are the outer loop and methods the inner
one, so the methods alternate (ABAB) at every rate. Each run's engine is warmed up first (compiles and
CUDA graph captures, :meth:`ServingEngine.warm_up`), outside its clock. Each run writes its own folder
(``run.json``, ``requests.jsonl``, ``timeline.jsonl``) and one row to ``serve_runs.jsonl``; a run
that fails is recorded with its error and the sweep goes on. Rerun into the same folder, it measures
only the runs not yet complete there (an unfinished run's folder is set aside, not overwritten).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvlab.card import device_card
from kvlab.records import canonical_json
from kvlab.serve.engine import make_serving_engine
from kvlab.serve.run import run_workload
from kvlab.serve.sweep_rows import append_row, failure, finished_rows, set_aside
from kvlab.serve.workload import build_workload
from kvlab.sweep.checks import check_params
from kvlab.sweep.params import SweepParams


def run_label(model: str, method: str, kwargs: dict, rate, repeat: int) -> str:
    knobs = "-".join(f"{k}{v}" for k, v in sorted(kwargs.items()) if k != "prefill_chunk")
    name = "-".join(p for p in (Path(model).name, method, knobs) if p)
    return f"{name}-rate{rate if rate is not None else 'na'}-rep{repeat}".replace("/", "_")


def run_serving_sweep(params: SweepParams, out_dir, *, loader=None, log=print) -> list[dict]:
    """Run every point; returns the summary rows (also in ``out_dir/serve_runs.jsonl``)."""
    from kvlab.models import load_model

    if params.traffic is None:
        raise ValueError("run_serving_sweep needs params with a traffic: block")
    variants = check_params(params, serving=True)  # one ParamsError before any model loads
    traffic, server = params.traffic, params.traffic.server
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if params.threads is not None:
        torch.set_num_threads(params.threads)
    rows = finished_rows(out)  # a rerun continues: runs already complete are kept, not measured again
    done = {row["run"] for row in rows}
    for model_name in params.models:
        loaded = (loader or load_model)(model_name, weights=params.weights, device=params.device,
                                        dtype=params.dtype, seed=params.seed)
        for repeat in range(params.repeats):
            spec = traffic.model_copy(update={"seed": traffic.seed + repeat})
            for rate in traffic.rates():
                workload = build_workload(spec, rate, loaded.tokenizer, loaded.spec.vocab_size)
                for _, v in variants:
                    label = run_label(model_name, v.method, v.kwargs, rate, repeat)
                    if label in done:
                        continue
                    set_aside(out / label)
                    row = {"run": label, "model": model_name, "method": v.method,
                           "params": canonical_json(v.kwargs), "rate": rate, "repeat": repeat,
                           "device": params.device, "weights": loaded.weights, **device_card(loaded.device)}
                    try:
                        engine = make_serving_engine(
                            loaded, v.method, pool_gb=server.pool_gb, block_size=server.block_size,
                            device=params.device, max_num_seqs=server.max_num_seqs,
                            max_num_batched_tokens=server.max_num_batched_tokens,
                            **({"num_blocks": server.num_blocks} if server.num_blocks else {}), **v.kwargs)
                        engine.warm_up()  # compiles and graph captures stay out of the measured run
                        res = run_workload(engine, workload, out / label, meta=row,
                                           slo=traffic.slo.as_dict() if traffic.slo else None)
                        row.update(status=res["status"], blocks_total=engine.allocator.total,
                                   bytes_per_block=engine.layout.bytes_per_block, **res["metrics"])
                        del engine
                    except Exception as err:  # a failed run is recorded, the sweep goes on
                        row.update(failure(err))
                    append_row(out, rows, row, log)
    return rows

