"""Memory-budgeted concurrency: the admitted batch from measured peaks, confirmed by a run."""

import json

import pytest

import kvlab.measure
from kvlab.capacity import fit_peaks
from kvlab.records import load_records
from kvlab.reporting.admission import budget_lines, budget_summary, budget_table
from kvlab.sweep.admission import ADMISSION_FILE, admission_plan, admit, at_budget, run_budgeted
from kvlab.sweep.checks import budget_problems, check_params
from kvlab.sweep.params import ParamsError, parse_params
from kvlab.sweep.plan import expand

GB = 1e9
TINY = {"models": "tiny-llama", "weights": "synthetic", "device": "cpu", "threads": 1, "ctx": [32],
        "new_tokens": 3, "warmup_runs": 0, "methods": ["full", "streamingllm"], "keep": 0.5,
        "batch": [1, 2], "budget_gb": 1.55}
BASE, PER_SEQ = {"full": 1.0 * GB, "streamingllm": 1.0 * GB}, {"full": 0.1 * GB, "streamingllm": 0.04 * GB}


def test_fit_and_admit_are_plain_arithmetic():
    line = fit_peaks([(1, 11.0), (2, 13.0), (4, 17.0)])
    assert (line.intercept, line.slope) == pytest.approx((9.0, 2.0))
    assert admit(9.0, 2.0, 20.0) == 5 and admit(9.0, 2.0, 20.0, cap=3) == 3 and admit(9.0, 2.0, 8.0) == 0
    with pytest.raises(ValueError, match="two batch sizes"):
        fit_peaks([(1, 5.0), (1, 6.0)])
    with pytest.raises(ValueError, match="does not grow"):
        admit(9.0, -1.0, 20.0)


def probes_and_records(**kw):
    p = parse_params({**TINY, **kw})
    probes = expand(p, check_params(p))
    records = {r.run_id: {"status": "ok", "label": r.method,
                          "peak_mem_bytes": BASE[r.method] + PER_SEQ[r.method] * r.batch} for r in probes}
    return p, probes, records


def test_the_admitted_batch_is_computed_from_the_probe_records():
    p, probes, records = probes_and_records()
    plan = {a.label: a for a in admission_plan(probes, records, p.budget_gb, int(p.budget_gb * GB))}
    for method in ("full", "streamingllm"):
        want = int((p.budget_gb * GB - BASE[method]) // PER_SEQ[method])
        assert plan[method].batch == plan[method].fitted_batch == want and not plan[method].confirmed
        assert plan[method].per_sequence_bytes == pytest.approx(PER_SEQ[method])
    capped = admission_plan(probes, records, p.budget_gb, int(p.budget_gb * GB), cap=4)
    assert {a.batch for a in capped} == {4} and all(a.capped for a in capped)


def test_an_attempt_that_failed_or_overran_the_budget_steps_down_and_an_ok_one_confirms():
    p, probes, records = probes_and_records()
    budget = int(p.budget_gb * GB)
    single = {r.method: r for r in probes if r.batch == 1}
    records[at_budget(single["full"], 5, p.budget_gb, budget).run_id] = {"status": "failed", "error": "CUDA OOM"}
    over = at_budget(single["streamingllm"], 13, p.budget_gb, budget)
    records[over.run_id] = {"status": "ok", "peak_mem_bytes": budget + 0.1 * GB}  # 2.5 sequences over
    plan = {a.label: a for a in admission_plan(probes, records, p.budget_gb, budget)}
    assert plan["full"].batch == 4 and plan["full"].attempts == [{"batch": 5, "why": "CUDA OOM"}]
    assert plan["streamingllm"].batch == 13 - 3 and "over" in plan["streamingllm"].attempts[0]["why"]
    records[at_budget(single["full"], 4, p.budget_gb, budget).run_id] = {"status": "ok", "peak_mem_bytes": 1.4 * GB}
    again = {a.label: a for a in admission_plan(probes, records, p.budget_gb, budget)}
    assert again["full"].confirmed and again["full"].batch == 4 and not again["streamingllm"].confirmed


def test_budget_params_are_checked_before_any_model_loads():
    assert budget_problems(parse_params(TINY)) == []
    with pytest.raises(ParamsError, match="at least one"):
        check_params(parse_params({**TINY, "batch": [1]}))
    with pytest.raises(ParamsError, match="device: cuda"):
        check_params(parse_params({**TINY, "budget_gb": "gpu"}))
    with pytest.raises(ParamsError, match="budget_max_batch: only used with budget_gb"):
        check_params(parse_params({**TINY, "budget_gb": None, "budget_max_batch": 4}))


def test_a_budgeted_sweep_runs_each_method_at_its_admitted_batch_and_records_it(tmp_path, monkeypatch):
    """Peaks are set per method (a CPU's peak RSS does not grow with a tiny model's batch); an OOM at
    full's first admitted batch steps it down one sequence, and the rerun confirms it."""
    measure = kvlab.measure.measure_generation

    def with_peaks(loaded, policy, *, batch, **kw):
        if policy.name == "full" and batch == 5:
            raise RuntimeError("CUDA out of memory (fake)")
        m = measure(loaded, policy, batch=batch, **kw)
        m.record["peak_mem_bytes"] = BASE[policy.name] + PER_SEQ[policy.name] * batch
        return m

    monkeypatch.setattr(kvlab.measure, "measure_generation", with_peaks)
    p = parse_params(TINY)
    summary = run_budgeted(p, tmp_path, progress=False, log=lambda m: None)
    df = load_records(tmp_path)
    at = df[df.budget_gb.notna()]
    ok = at[at.status == "ok"].set_index("method")
    assert ok.loc["full", "admitted_batch"] == 4 and ok.loc["streamingllm", "admitted_batch"] == 13
    assert (ok.batch == ok.admitted_batch).all() and (ok.budget_bytes == 1.55 * GB).all()
    assert (ok.cache_bytes > 0).all() and ok.loc["streamingllm", "cache_bytes"] < 13 * ok.loc["full", "cache_bytes"] / 4
    assert list(at[at.status == "failed"].batch) == [5]
    assert ok.loc["full", "admission_fitted_batch"] == 5 and ok.loc["full", "admission_attempts"] == 1
    assert ok.loc["streamingllm", "admission_per_sequence_bytes"] == pytest.approx(PER_SEQ["streamingllm"])
    admission = json.loads((tmp_path / ADMISSION_FILE).read_text())
    assert all(u["confirmed"] for u in admission["units"]) and summary.status == "complete"

    report = budget_summary(df.assign(contended=False)).set_index("label")
    assert report.loc["full", "admitted_batch"] == 4 and report.loc["streamingllm 50%", "batch_vs_baseline"] == 13 / 4
    single = df[(df.batch == 1) & df.budget_gb.isna() & (df.method == "full")]
    want = ok.loc["full", "tokens_per_s"] / single.tokens_per_s.mean()
    assert report.loc["full", "tokens_per_s_ratio"] == pytest.approx(want)
    assert report.loc["full", "cache_share"] == pytest.approx(ok.loc["full", "cache_bytes"] / (1.55 * GB))
    lines = budget_lines(report.reset_index())
    assert len(lines) == 2 and "admits 4 sequences" in lines[0] and "vs full at the same budget" in lines[1]
    assert len(budget_table(report.reset_index())) == 2
