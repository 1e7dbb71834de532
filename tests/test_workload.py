"""Context-length distributions: seeded draws, files, sweep points, the budget and the report."""

import json

import pandas as pd
import pytest

from kvlab.cli import main
from kvlab.models import get_spec
from kvlab.records import load_records
from kvlab.reporting.workload import distribution_lines, distribution_summary, distribution_table
from kvlab.sweep.checks import check_params
from kvlab.sweep.driver import run_sweep
from kvlab.sweep.params import ParamsError, parse_params
from kvlab.sweep.plan import expand
from kvlab.workload import WorkloadError, context_points, observed_lengths, parse_distribution
from kvlab.workload_budget import distribution_budget

LOGNORMAL = {"dist": "lognormal", "median": 4096, "sigma": 0.6, "samples": 8}


def test_draws_are_seeded_reproducible_and_prefix_stable():
    d = parse_distribution(LOGNORMAL)
    a, b = d.draw(seed=0), d.draw(seed=0)
    assert a == b and len(a) == 8 and len(set(a)) > 1
    assert d.draw(seed=1) != a
    more = parse_distribution({**LOGNORMAL, "samples": 16}).draw(seed=0)
    assert more[:8] == a  # more samples keep the first draws (and so their run ids)


def test_draws_are_clipped_to_min_max_and_the_window():
    d = parse_distribution({**LOGNORMAL, "sigma": 3.0, "samples": 64, "min": 100, "max": 20000})
    raw = d.raw_draws(0, 64)
    clipped = d.draw(0, window=8000)
    assert min(raw) < 100 and max(raw) > 8000  # the spread reaches both clips
    assert min(clipped) == 100 and max(clipped) == 8000


def test_file_and_jsonl_lengths(tmp_path):
    txt = tmp_path / "lengths.txt"
    txt.write_text("# observed\n120\n\n3000\n450\n")
    assert observed_lengths(txt) == [120, 3000, 450]
    jl = tmp_path / "requests.jsonl"
    jl.write_text("\n".join(json.dumps({"prompt_tokens": n, "id": i}) for i, n in enumerate([10, 20, 30])))
    d = parse_distribution({"file": str(jl), "field": "prompt_tokens", "samples": 5})
    assert set(d.draw(0)) <= {10, 20, 30} and d.draw(0) == d.draw(0)
    assert d.label == "file:requests.jsonl[prompt_tokens]" and sorted(d.population()) == [10, 20, 30]
    with pytest.raises(WorkloadError, match="field: KEY"):
        observed_lengths(jl)
    with pytest.raises(WorkloadError, match="not found"):
        observed_lengths(tmp_path / "missing.txt")
    (tmp_path / "bad.txt").write_text("12\n0\n")
    with pytest.raises(WorkloadError, match="line 2"):
        observed_lengths(tmp_path / "bad.txt")


@pytest.mark.parametrize("ctx, message", [
    ({"dist": "lognormal", "median": 4096}, "needs median"),
    ({"dist": "lognormal", "median": -5, "sigma": 1}, "median"),
    ({"dist": "zipf", "median": 5, "sigma": 1}, "dist"),
    ({"dist": "lognormal", "median": 5, "sigma": 1, "file": "x.txt"}, "not both"),
    ({"dist": "lognormal", "median": 5, "sigma": 1, "sample": 3}, "sample"),
])
def test_bad_distributions_name_the_key(ctx, message):
    with pytest.raises(ParamsError, match=message):
        parse_params({"models": "tiny-llama", "methods": ["full"], "ctx": ctx})


def test_a_missing_lengths_file_is_refused_before_any_model_loads(tmp_path):
    p = parse_params({"models": "tiny-llama", "weights": "synthetic", "methods": ["full"],
                      "ctx": {"file": str(tmp_path / "nope.txt")}})
    with pytest.raises(ParamsError, match="nope.txt not found"):
        check_params(p)


def test_sweep_points_carry_the_draw_and_run_ids_are_stable():
    raw = {"models": "tiny-llama", "weights": "synthetic", "methods": ["full", "streamingllm"], "keep": 0.5,
           "ctx": {"dist": "lognormal", "median": 60, "sigma": 0.8, "samples": 4}, "new_tokens": 3}
    p = parse_params(raw)
    runs = expand(p, check_params(p))
    window = get_spec("tiny-llama").max_context - 3
    draws = parse_distribution(raw["ctx"]).draw(0, window)
    assert sorted((r.ctx_sample, r.ctx) for r in runs if r.method == "full") == sorted(enumerate(draws))
    assert {r.ctx_dist for r in runs} == {"lognormal(median=60,sigma=0.8)"}
    assert [r.ctx for r in runs] == sorted(r.ctx for r in runs)  # shapes in ascending length
    again = expand(parse_params(raw), check_params(parse_params(raw)))
    assert [r.run_id for r in runs] == [r.run_id for r in again]
    other_seed = expand(parse_params({**raw, "seed": 1}), check_params(parse_params({**raw, "seed": 1})))
    assert {r.run_id for r in runs}.isdisjoint(r.run_id for r in other_seed)
    listed = expand(parse_params({**raw, "ctx": [32]}), check_params(parse_params({**raw, "ctx": [32]})))
    assert all("ctx_dist" not in r.identity() for r in listed)  # lists keep their old ids


def test_context_points_keep_equal_draws_apart(tmp_path):
    (tmp_path / "one.txt").write_text("50\n")
    points = context_points(parse_distribution({"file": str(tmp_path / "one.txt"), "samples": 3}), seed=0)
    assert [(p.ctx, p.sample) for p in points] == [(50, 0), (50, 1), (50, 2)]


def test_distribution_budget_averages_bytes_and_says_what_compression_frees():
    spec = get_spec("llama-3.1-8b")
    lengths = [1000, 2000, 9000]
    full = distribution_budget(spec, lengths, "x", batch=4)
    int4 = distribution_budget(spec, lengths, "x", batch=4, bits=4, memory_bytes=141e9)
    per_token = 131072  # llama-3.1-8b bf16: 32 layers x 8 heads x 128 x 2 x 2 bytes
    assert full["cache_bytes_per_request"] == pytest.approx(per_token * 4000)
    assert full["cache_bytes"] == pytest.approx(4 * per_token * 4000) and full["freed_bytes"] == 0
    assert int4["freed_bytes"] == pytest.approx(int4["cache_bytes_full"] - int4["cache_bytes"])
    assert int4["cache_share"] == pytest.approx(int4["cache_bytes"] / 141e9)
    assert int4["requests_in_flight"] > int4["requests_in_flight_full"] > 0


def test_formats_over_a_distribution_list_the_full_cache_then_each_width():
    from kvlab.workload_budget import formats_over_distribution

    spec = get_spec("llama-3.1-8b")
    table = formats_over_distribution(spec, LOGNORMAL, bits=(4, 8), batch=8, memory_bytes=141e9)
    assert list(table["format"]) == ["bfloat16", "int8", "int4"]
    assert table["frees GB"].iloc[0] == 0 and table["frees GB"].is_monotonic_increasing
    assert table["requests in flight"].is_monotonic_increasing


def test_budget_cli_answers_for_a_distribution(capsys, tmp_path):
    (tmp_path / "l.txt").write_text("1000\n2000\n9000\n")
    assert main(["budget", "--model", "llama-3.1-8b", "--ctx-dist", f"{{file: {tmp_path / 'l.txt'}}}",
                 "--bits", "4", "--gpu", "h200", "--batch", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lengths"] == 3 and out["ctx_mean"] == 4000 and 0 < out["freed_share"] < out["cache_share_full"]
    assert main(["budget", "--model", "llama-3.1-8b", "--ctx-dist", "{dist: lognormal, median: 4096, sigma: 0.6}",
                 "--gpu", "h200"]) == 0
    assert "requests in flight" in capsys.readouterr().out
    assert main(["budget", "--model", "llama-3.1-8b"]) == 2
    assert "--ctx-dist" in capsys.readouterr().err


def test_a_sweep_over_a_distribution_records_the_draws_and_the_report_aggregates_them(tmp_path):
    p = parse_params({"models": "tiny-llama", "weights": "synthetic", "device": "cpu", "threads": 1,
                      "methods": ["full", "streamingllm"], "keep": 0.5, "warmup_runs": 0,
                      "ctx": {"dist": "lognormal", "median": 48, "sigma": 0.5, "samples": 3},
                      "new_tokens": 4, "repeats": 2})
    s = run_sweep(p, tmp_path, progress=False, log=lambda m: None)
    assert s.complete and s.total == 2 * 3 * 2
    df = load_records(tmp_path)
    assert set(df.ctx_dist) == {"lognormal(median=48,sigma=0.5)"} and set(df.ctx_sample) == {0, 1, 2}
    df = df.assign(contended=False, energy_j=df.ctx * 0.01 * (1 + (df.method != "full")),  # a known energy
                   decode_j=df.ctx * 0.005)
    summary = distribution_summary(df, n_boot=200)
    assert len(summary) == 2
    full = summary[summary.label == "full"].iloc[0]
    tokens = (df[df.method == "full"].batch * df[df.method == "full"].new_tokens).sum()
    assert full.j_per_token == pytest.approx(df[df.method == "full"].energy_j.sum() / tokens)
    other = summary[summary.label != "full"].iloc[0]
    assert other.j_ratio == pytest.approx(2.0) and other.verdict == "costs" and other.draws == 3
    itl = sorted(sum(df[df.method == "full"].itl_ms.tolist(), []))
    assert full.itl_p50_ms == pytest.approx(pd.Series(itl).quantile(0.5))
    assert len(distribution_table(summary)) == 2
    assert "2.000" in distribution_lines(summary)[0]


@pytest.mark.parametrize("name", ["cpu-ctx-dist", "cpu-weights-stack", "cpu-budget", "h200-workloads-dist",
                                  "h200-workloads-stack", "h200-workloads-budget"])
def test_the_workload_params_files_validate_without_a_gpu(name):
    from pathlib import Path

    from kvlab.sweep.params import load_params
    from kvlab.sweep.plan import planned_runs

    p = load_params(Path(__file__).resolve().parent.parent / "params" / f"{name}.yaml")
    assert planned_runs(p)  # check_device=False: validated against models and policies, not this machine


def test_the_example_lengths_file_drives_a_sweep():
    from pathlib import Path

    from kvlab.sweep.params import load_params
    from kvlab.sweep.plan import planned_runs

    params = Path(__file__).resolve().parent.parent / "params"
    p = load_params(params / "cpu-ctx-dist.yaml",
                    [f"ctx={{file: {params / 'lengths' / 'example-prompts.txt'}, samples: 4, max: 1024}}"])
    runs = planned_runs(p)
    assert p.ctx.label == "file:example-prompts.txt" and len({r.ctx_sample for r in runs}) == 4
    assert {r.ctx for r in runs} <= set(observed_lengths(params / "lengths" / "example-prompts.txt")) | {1024}
