"""The report's engine section on FAKE records (generated numbers, not measurements)."""

import math

import pandas as pd
import pytest

from kvlab import report


def fake_engine_records(repeats=3):
    """decode J/token: full hf 6.0, fast 3.0; snapkv 0.9x full on hf, 0.85x on fast (exact means)."""
    means = {("full", "hf"): 6.0, ("full", "fast"): 3.0, ("snapkv", "hf"): 5.4, ("snapkv", "fast"): 2.55}
    rows = []
    for (method, engine), mean in means.items():
        for r in range(repeats):
            rows.append({"kind": "perf", "status": "ok", "model": "m", "method": method, "engine": engine,
                         "label": "full" if method == "full" else "snapkv keep 0.1", "ctx": 16384, "batch": 1,
                         "repeat": r, "decode_j_per_token": mean * (1 + 0.01 * (r - (repeats - 1) / 2)),
                         "j_per_token": mean, "contended": False})
    return pd.DataFrame(rows)


def test_engine_comparison_ratios_each_engine_to_its_own_full_cache():
    table = report.engine_comparison(fake_engine_records())
    snap = table[table["method"] == "snapkv"].iloc[0]
    assert snap["vs_full_hf"] == pytest.approx(0.9)
    assert snap["vs_full_fast"] == pytest.approx(0.85)
    assert snap["fast_over_hf"] == pytest.approx(2.55 / 5.4)
    assert snap["vs_full_fast_lo"] <= 0.85 <= snap["vs_full_fast_hi"]
    full = table[table["method"] == "full"].iloc[0]
    assert math.isnan(full["vs_full_hf"]) and full["fast_over_hf"] == pytest.approx(0.5)
    lines = report.engine_lines(table)
    assert any("0.85x" in line and "on fast" in line for line in lines)
    assert set(report.engine_table(table)["method"]) == {"full", "snapkv keep 0.1"}


def test_one_engine_gives_an_empty_comparison_and_unchanged_labels():
    hf_only = fake_engine_records()
    hf_only = hf_only[hf_only["engine"] == "hf"]
    assert report.engine_comparison(hf_only).empty
    assert set(report.perf_records(hf_only)["label"]) == {"full", "snapkv keep 0.1"}


def test_mixed_engines_keep_their_baselines_apart():
    records = fake_engine_records()
    assert set(report.perf_records(records)["label"]) == {"full · hf", "full · fast", "snapkv keep 0.1 · hf",
                                                          "snapkv keep 0.1 · fast"}
    rel = report.relative_to_baseline(report.perf_records(records), "decode_j_per_token")
    by_engine = dict(zip(rel["engine"], rel["ratio"], strict=True))
    assert by_engine["hf"] == pytest.approx(0.9) and by_engine["fast"] == pytest.approx(0.85)


def test_a_quantized_store_on_fast_says_what_it_ran():
    from kvlab.reporting.frames import engine_tag

    assert engine_tag({"engine": "fast", "kv_format": "int4-g64", "fast_attention": "fused"}) == "fast int4-g64 fused"
    assert engine_tag({"engine": "fast", "kv_format": "model dtype", "fast_attention": "flash"}) == "fast"
    assert engine_tag({"engine": None}) == "hf"


def test_a_method_on_quantized_weights_is_compared_with_the_full_cache_on_the_same_weights():
    """The H200 stack sweep (2026-12-03c) compared every cache with the full cache of all three weight
    formats pooled; each is now compared within its weights (the weights' own cost: the stack section)."""
    # decode J/token: float weights full 8, quanto 12 (1.5x); int8 weights full 18, quanto 24 (1.33x)
    means = {("none", "full"): 8.0, ("none", "quanto"): 12.0, ("int8", "full"): 18.0, ("int8", "quanto"): 24.0}
    rows = [{"kind": "perf", "status": "ok", "model": "m", "engine": "hf", "method": method, "weights_quant": w,
             "label": ("full" if method == "full" else "quanto int4") + ("" if w == "none" else f" · w-{w}"),
             "ctx": 16384, "batch": 1, "repeat": r, "decode_j_per_token": mean * (1 + 0.01 * (r - 1)),
             "contended": False}
            for (w, method), mean in means.items() for r in range(3)]
    perf = report.perf_records(pd.DataFrame(rows))
    rel = report.relative_to_baseline(perf, "decode_j_per_token")
    assert dict(zip(rel["label"], rel["ratio"], strict=True)) == pytest.approx(
        {"quanto int4": 1.5, "quanto int4 · w-int8": 24 / 18})
    pays = report.compression_pays(perf)
    assert dict(zip(pays["label"], pays["n_base"], strict=True)) == {"quanto int4": 3, "quanto int4 · w-int8": 3}
