"""The report's methods table on FAKE records and a fake parity file (generated numbers, not
measurements): each expected value below is computed from the inputs the test builds."""

import json
import math

import pandas as pd
import pytest
from synthetic_records import write_fake_sweep

from kvlab import report
from kvlab.cli import EXIT_USAGE, main, report_cmd
from kvlab.policies import make_policy

FULL_PERF = {"cache_bytes": 8e9, "peak_mem_bytes": 80e9, "decode_j_per_token": 0.6, "ttft_s": 10.0, "prefill_j": 7000.0}
# per method: its policy and a fraction of the full cache's value for every perf metric
PERF_FRACTIONS = {"snapkv": ("snapkv", {}, 0.4), "ea": ("expected_attention", {}, 0.5)}
KEEP = 0.1


def policy_columns(policy):
    return {"method": policy.name, "label": policy.label, "policy_params": policy.params(),
            "keep": policy.params().get("keep")}


def perf_rows(ctx=16384, batch=16, scale=1.0, repeats=3, extra=None):
    """Full-cache runs and one run set per PERF_FRACTIONS method in one (ctx, batch) cell; the repeats
    spread +-1% around each mean so the means stay exact."""
    rows = []
    policies = [(make_policy("full"), 1.0)] + [(make_policy(name, keep=KEEP, **kw), frac)
                                               for name, kw, frac in PERF_FRACTIONS.values()]
    for policy, frac in policies:
        for r in range(repeats):
            jitter = 1 + 0.01 * (2 * r - (repeats - 1)) / max(repeats - 1, 1)
            rows.append({"kind": "perf", "status": "ok", "model": "m", "engine": "fast", "ctx": ctx, "batch": batch,
                         "repeat": r, "contended": False, **policy_columns(policy),
                         **{k: v * frac * scale * jitter for k, v in FULL_PERF.items()}, **(extra or {})})
    return rows


def quality_rows():
    """Needle scores and continuation KL / top-1 per item for full, snapkv and adakv(snapkv)."""
    scores = {"full": [1.0, 1.0], "snapkv": [0.0, 1.0], "adakv": [1.0, 1.0]}
    kls = {"full": [0.0, 0.0], "snapkv": [0.2, 0.4], "adakv": [0.1, 0.3]}
    policies = {"full": make_policy("full"), "snapkv": make_policy("snapkv", keep=0.25),
                "adakv": make_policy("adakv", keep=0.25, scorer="snapkv")}
    rows = []
    for name, policy in policies.items():
        for i, length in enumerate((1024, 4096)):
            common = {"kind": "quality", "status": "ok", "model": "smollm2-135m", "device": "cpu", "length": length,
                      "depth": 0.5, "sample": 0, **policy_columns(policy)}
            cache = length * (1.0 if name == "full" else 0.25 if name == "snapkv" else 0.4)
            rows.append({**common, "task": "niah_single", "score": scores[name][i], "kl": 9.0, "no_signal": False,
                         "cache_bytes": cache})
            rows.append({**common, "task": "continuation", "score": math.nan, "kl": kls[name][i],
                         "top1_agree": 1 - kls[name][i], "no_signal": False, "cache_bytes": cache})
    return rows


def parity_frame(tmp_path):
    rows = []
    for tokens in (1024, 5120):
        for keep in (0.5, 0.25):
            jaccard = 1.0 if tokens == 1024 else 0.9
            rows.append({"tokens": tokens, "keep": keep, "method": "snapkv", "mean_jaccard": jaccard,
                         "min_jaccard": jaccard - 0.1, "kvlab_params": make_policy("snapkv", keep=keep).params()})
    path = tmp_path / "parity.json"
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_perf_columns_are_each_method_against_the_full_cache_in_its_cell():
    table = report.methods_table(pd.DataFrame(perf_rows()), n_boot=200).set_index("method")
    for name, _kw, frac in PERF_FRACTIONS.values():
        row = table.loc[name]
        assert row["kv_freed"] == pytest.approx(1 - frac)
        assert row["peak_freed_gb"] == pytest.approx(FULL_PERF["peak_mem_bytes"] * (1 - frac) / 1e9)
        for col in ("decode_j_vs_full", "ttft_vs_full", "prefill_j_vs_full"):
            assert row[col] == pytest.approx(frac)
            assert row[f"{col}_lo"] <= frac <= row[f"{col}_hi"]
        assert row["perf_runs"] == 3 and "16k" in row["perf_at"] and "batch 16" in row["perf_at"]
    assert table.loc["full", "decode_j_vs_full"] == pytest.approx(1.0)


def test_the_largest_context_is_the_cell_and_contended_runs_are_left_out():
    records = pd.DataFrame(perf_rows(ctx=4096, scale=0.5) + perf_rows(ctx=16384)
                           + perf_rows(ctx=16384, scale=100.0, extra={"contended": True}))
    table = report.methods_table(records, n_boot=200).set_index("method")
    assert "16k" in table.loc["snapkv", "perf_at"]
    assert table.loc["snapkv", "perf_runs"] == 3  # the contended repeats are not counted
    assert table.loc["snapkv", "ttft_s"] == pytest.approx(FULL_PERF["ttft_s"] * PERF_FRACTIONS["snapkv"][2])
    n_busy = len(perf_rows())
    assert any(f"{n_busy} perf runs" in line for line in report.methods_lines(table.reset_index(), None, records))


def test_quality_columns_read_needles_and_continuation_fidelity():
    records = pd.DataFrame(quality_rows())
    table = report.methods_table(records).set_index("label")
    snap = table.loc[make_policy("snapkv", keep=0.25).label]
    assert snap["needle"] == pytest.approx(0.5) and snap["needle_items"] == 2
    assert snap["kl"] == pytest.approx(0.3)  # the continuation items only (the needle's 9.0 is not KL here)
    assert snap["top1_agree"] == pytest.approx(0.7)
    assert snap["kv_freed_quality"] == pytest.approx(0.75)
    ada = table.loc[make_policy("adakv", keep=0.25, scorer="snapkv").label]
    assert ada["kv_freed_quality"] == pytest.approx(0.6) and ada["needle"] == pytest.approx(1.0)
    assert math.isnan(snap["decode_j_vs_full"])  # no perf records: empty, not zero


def test_a_needle_cell_without_signal_is_left_out_of_the_needle_score():
    rows = [{**r, "no_signal": r["task"] == "niah_single" and r["length"] == 1024} for r in quality_rows()]
    snap = report.methods_table(pd.DataFrame(rows)).set_index("label").loc[make_policy("snapkv", keep=0.25).label]
    assert snap["needle_items"] == 1 and snap["needle"] == pytest.approx(1.0)


def test_parity_matches_a_method_at_every_keep_by_its_parameters(tmp_path):
    path = parity_frame(tmp_path)
    assert report.find_parity(tmp_path) == path
    records = pd.DataFrame(perf_rows() + quality_rows())
    table = report.methods_table(records, report.load_parity(path), n_boot=200)
    snap = table[table["method"] == "snapkv"]
    assert len(snap) == 2  # snapkv 10% (perf) and 25% (quality): both get the method's parity
    assert list(snap["parity_jaccard"]) == pytest.approx([0.9, 0.9])
    assert list(snap["parity_min"]) == pytest.approx([0.8, 0.8])
    assert snap["parity_cases"].str.startswith("4: 1k, 5k · keep 50%, 25%").all()
    assert table.loc[table["method"] == "expected_attention", "parity_jaccard"].isna().all()
    shown = report.methods_display(table)
    assert len(shown) == len(table) and shown.loc[snap.index[0], "kvpress Jaccard (min head)"] == "0.900 (0.800)"
    lines = report.methods_lines(table, path)
    assert str(path) in lines[0] and any("16k" in line for line in lines)


def test_method_key_ignores_the_axis_and_unset_values():
    a = make_policy("adakv", keep=0.5, scorer="expected_attention").params()
    b = make_policy("adakv", keep=0.1, scorer="expected_attention").params()
    c = make_policy("adakv", keep=0.1, scorer="snapkv").params()
    assert report.method_key(a) == report.method_key(b) != report.method_key(c)
    assert report.method_key(json.dumps(a)) == report.method_key(a)
    assert report.method_key({"keep": 0.5}) is None and report.method_key(None) is None


def test_no_records_and_a_bad_parity_file_say_so(tmp_path):
    empty = report.methods_table(pd.DataFrame())
    assert empty.empty and "No performance or quality records" in report.methods_lines(empty)[0]
    bad = tmp_path / "parity.json"
    bad.write_text("{")
    with pytest.raises(report.ReportError, match="kvpress_parity"):
        report.load_parity(bad)
    assert report.load_parity(None).empty and report.find_parity(tmp_path / "missing") is None


def test_kvlab_report_hands_the_notebook_a_parity_path_relative_to_the_folder(tmp_path, monkeypatch):
    folder = write_fake_sweep(tmp_path / "sweep")
    path = parity_frame(tmp_path)
    seen = {}

    def render(records_dir, out=None, notebook=None, index=True, parameters=None, **kwargs):
        seen.update(parameters)
        html = tmp_path / "report.html"
        html.write_text("<html></html>")
        return html

    monkeypatch.setattr(report_cmd, "render_report", render)
    assert main(["report", str(folder), "--parity", str(path), "--no-index"]) == 0
    assert seen["parity"] == "../parity.json"  # the notebook runs in the folder: no absolute path in it
    assert main(["report", str(folder), "--parity", str(tmp_path / "nope.json")]) == EXIT_USAGE
