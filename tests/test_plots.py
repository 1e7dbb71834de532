"""Figures from synthetic (fake) records and budget tables: right traces, right numbers, and an
explanatory empty figure when data are missing."""

import math

import pandas as pd
import plotly.graph_objects as go
import pytest
from synthetic_records import fake_records

from kvlab import plots, report
from kvlab.reporting.text import ci_text


@pytest.fixture(scope="module")
def records():
    return fake_records()


@pytest.fixture(scope="module")
def perf(records):
    return report.perf_records(records)


def trace_names(fig):
    return [t.name for t in fig.data]


def is_empty_note(fig, contains):
    return len(fig.data) == 0 and any(contains in a.text for a in fig.layout.annotations)


def test_energy_vs_memory_one_trace_per_method_in_gb(perf):
    fig = plots.energy_vs_memory(perf)
    assert trace_names(fig) == ["full", "quanto int4", "streamingllm keep 0.5"]
    full = fig.data[0]
    assert len(full.x) == 9  # 3 contexts x 3 repeats
    assert min(full.x) == pytest.approx(perf.loc[perf["method"] == "full", "peak_mem_bytes"].min() / 1e9)


def test_energy_plots_say_why_when_there_is_no_energy():
    cpu = report.perf_records(fake_records(energy=False))
    assert is_empty_note(plots.energy_vs_memory(cpu), "no j_per_token")
    assert is_empty_note(plots.energy_counter_vs_10hz(cpu), "no energy")
    rel = report.relative_to_baseline(cpu)
    assert is_empty_note(plots.relative_to_baseline(rel), "no J/token")


def test_relative_bars_label_the_change(perf):
    rel = report.relative_to_baseline(perf, ctx=16384)
    fig = plots.relative_to_baseline(rel)
    bar = fig.data[0]
    texts = dict(zip(bar.x, bar.text, strict=True))
    assert texts["quanto int4"] == "+35%"
    assert texts["streamingllm keep 0.5"] == "-3%"
    assert bar.error_y.array is not None  # CIs drawn


def test_relative_bars_name_the_context_when_several(perf):
    fig = plots.relative_to_baseline(report.relative_to_baseline(perf))
    assert "quanto int4 @16k" in fig.data[0].x
    assert "quanto int4 @1k" in fig.data[0].x


def test_itl_vs_context_lines_sorted_by_context(perf):
    summary = report.method_summary(perf, ["itl_median_ms"], by=["label", "ctx"], n_boot=200)
    fig = plots.itl_vs_context(summary)
    assert trace_names(fig) == ["full", "quanto int4", "streamingllm keep 0.5"]
    for t in fig.data:
        assert list(t.x) == [1024, 4096, 16384]
        assert len(t.error_y.array) == 3
    assert fig.layout.xaxis.type == "log"


def test_token_latency_series_shows_one_run_per_method_with_flush_spikes(perf):
    fig = plots.token_latency_series(perf, 16384)
    assert trace_names(fig) == ["full", "quanto int4", "streamingllm keep 0.5"]
    quanto = fig.data[1]
    assert len(quanto.y) == 48
    median = sorted(quanto.y)[len(quanto.y) // 2]
    spikes = [i + 1 for i, y in enumerate(quanto.y) if y > 2 * median]
    assert spikes == [16, 32, 48]  # every residual-length step


def test_token_latency_series_without_lists_is_empty(perf):
    assert is_empty_note(plots.token_latency_series(perf.drop(columns=["itl_ms"])), "no latency")
    assert is_empty_note(plots.token_latency_series(perf, ctx=999), "no per-token")


def test_quality_vs_keep_one_panel_per_task(records):
    q = report.quality_summary(report.quality_records(records), n_boot=200)
    fig = plots.quality_vs_keep(q)
    assert set(trace_names(fig)) == {"full", "streamingllm"}
    stream = next(t for t in fig.data if t.name == "streamingllm")
    assert list(stream.x) == [0.1, 0.25, 0.5, 1.0]
    full = next(t for t in fig.data if t.name == "full")
    assert list(full.x) == [1.0]  # keep None on full-cache records counts as 1.0
    assert is_empty_note(plots.quality_vs_keep(report.quality_summary(records.iloc[0:0])), "no quality")


def test_counter_vs_10hz_has_equality_line(perf):
    fig = plots.energy_counter_vs_10hz(perf)
    assert trace_names(fig)[-1] == "equal"
    line = fig.data[-1]
    assert line.x[0] == line.y[0] == 0 and line.x[1] == line.y[1]
    assert sum(len(t.x) for t in fig.data[:-1]) == len(perf)


def test_study_table_cells_show_mean_and_ci(perf):
    summary, at, caption = report.study_summary(perf, 16384, n_boot=200)
    fig = plots.study_table(summary, report.STUDY_METRICS, caption)
    table = fig.data[0]
    assert isinstance(table, go.Table)
    assert list(table.cells.values[0]) == ["full", "quanto int4", "streamingllm keep 0.5"]
    header = list(table.header.values)
    jcol = table.cells.values[header.index("J/token")]
    assert jcol[0].startswith("1.000 [")  # full at 16k: 0.5 * 2 = 1.0 J/token


def test_ci_text_formats():
    assert ci_text(math.nan, math.nan, math.nan) == "n/a"
    assert ci_text(1.23456, math.nan, math.nan) == "1.235"
    assert ci_text(12.34, 11.0, 13.0) == "12.3 [11.0, 13.0]"


def test_colors_are_stable_across_figures_and_full_is_grey(perf):
    a = plots.energy_vs_memory(perf)
    b = plots.itl_vs_context(report.method_summary(perf, ["itl_median_ms"], by=["label", "ctx"], n_boot=50))
    colors_a = {t.name: t.marker.color for t in a.data}
    colors_b = {t.name: t.line.color for t in b.data}
    assert colors_a == colors_b
    assert colors_a["full"] == plots.BASELINE_COLOR
    assert len(set(colors_a.values())) == 3


def test_anatomy_bars_stack_in_category_order():
    rows = [{"label": m, "category": c, "ms": 1.0 + i, "wall_ms": 20.0, "busy_ms": 10.0}
            for m in ("full", "quanto int4") for i, c in enumerate(reversed(plots.ANATOMY_ORDER))]
    fig = plots.anatomy_bars(pd.DataFrame(rows))
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    assert [t.name for t in bars] == list(plots.ANATOMY_ORDER)
    assert fig.layout.barmode == "stack"
    wall = next(t for t in fig.data if t.name == "wall")
    assert list(wall.y) == [20.0, 20.0]


def test_budget_plots_from_tables():
    cache = pd.DataFrame({"format": ["bf16 (full)"] * 2 + ["int4"] * 2, "ctx": [1024, 2048] * 2,
                          "cache_bytes": [1e9, 2e9, 0.3e9, 0.6e9]})
    fig = plots.cache_vs_context(cache, free_bytes=30e9, gpu_name="X")
    assert list(fig.data[1].y) == [0.3, 0.6]
    assert any("30.0 GB" in (s.text or "") for s in fig.layout.annotations)
    decode = pd.DataFrame({"format": ["a", "b"], "weight_bytes": [16e9, 16e9], "kv_bytes": [2e9, 0.5e9],
                           "floor_ms": [23.4, 21.4]})
    fig = plots.decode_split(decode, "X")
    assert [t.name for t in fig.data] == ["weights", "KV cache", "roofline time"]
    assert list(fig.data[2].text) == ["23.40 ms", "21.40 ms"]


# --- a folder of sweeps --------------------------------------------------------------------


def batch_summary_frame():
    """What report.batch_summary returns: full at batch 4 and 16, int4 at 4 and OOM at 16."""
    return pd.DataFrame([
        {"label": "full", "batch": 4, "n": 1, "status": "ok", "tokens_per_s": 100.0, "j_per_token": 1.0},
        {"label": "full", "batch": 16, "n": 1, "status": "ok", "tokens_per_s": 350.0, "j_per_token": 0.4},
        {"label": "quanto int4", "batch": 4, "n": 1, "status": "ok", "tokens_per_s": 60.0, "j_per_token": 1.3},
        {"label": "quanto int4", "batch": 16, "n": 0, "status": "failed: OOM"},
    ])


def test_batch_scaling_one_panel_per_metric_and_lists_failures():
    metrics = {"tokens_per_s": "tokens/s", "j_per_token": "J/token", "itl_median_ms": "ITL"}
    fig = plots.batch_scaling(batch_summary_frame(), metrics)
    assert trace_names(fig) == ["full", "quanto int4", "full", "quanto int4"]  # no ITL column: two panels
    assert [a.text for a in fig.layout.annotations][:2] == ["tokens/s", "J/token"]
    assert list(fig.data[0].x) == [4, 16] and list(fig.data[0].y) == [100.0, 350.0]
    assert list(fig.data[1].x) == [4]  # the OOM point is not drawn ...
    assert any(a.text == "quanto int4 at batch 16: failed: OOM" for a in fig.layout.annotations)  # ... but named
    assert fig.layout.xaxis.type == "log" and list(fig.layout.xaxis.tickvals) == [4, 16]
    assert [t.showlegend for t in fig.data] == [True, True, False, False]


def test_batch_scaling_with_one_batch_is_a_note():
    one = batch_summary_frame()
    assert is_empty_note(plots.batch_scaling(one[one["batch"] == 4], {"tokens_per_s": "tokens/s"}),
                         "fewer than two batch sizes")


def test_compression_pays_heatmap_cells():
    pays = pd.DataFrame([
        {"label": "quanto int4", "ctx": 16384, "batch": 1, "j_per_token_ratio": 1.3, "j_per_token_ratio_lo": 1.2,
         "j_per_token_ratio_hi": 1.4, "verdict": "costs"},
        {"label": "snapkv 10%", "ctx": 16384, "batch": 1, "j_per_token_ratio": 0.8, "j_per_token_ratio_lo": math.nan,
         "j_per_token_ratio_hi": math.nan, "verdict": "no interval (fewer than 3 runs a side)"},
        {"label": "quanto int4", "ctx": 16384, "batch": 32, "j_per_token_ratio": math.nan,
         "j_per_token_ratio_lo": math.nan, "j_per_token_ratio_hi": math.nan, "verdict": "failed: OOM"},
    ])
    heat = plots.compression_pays(pays).data[0]
    assert list(heat.x) == ["16k · b1", "16k · b32"] and list(heat.y) == ["quanto int4", "snapkv 10%"]
    assert heat.z[0][0] == 1.3 and heat.z[1][0] == 0.8 and math.isnan(heat.z[0][1])
    assert heat.text[0][0] == "+30%<br>[+20%, +40%]"
    assert heat.text[1][0] == "-20%" and heat.text[0][1] == "failed: OOM"
    assert heat.zmid == 1.0 and heat.zmin == pytest.approx(0.7) and heat.zmax == pytest.approx(1.3)
    assert is_empty_note(plots.compression_pays(pays.assign(j_per_token_ratio=math.nan)), "no J/token")


def test_relative_bars_name_the_batch_when_several():
    rel = pd.DataFrame({"label": ["quanto int4", "quanto int4"], "ctx": [16384, 16384], "batch": [1, 4],
                        "ratio": [1.35, 1.1], "ratio_lo": [1.3, 1.0], "ratio_hi": [1.4, 1.2]})
    assert list(plots.relative_to_baseline(rel).data[0].x) == ["quanto int4 b1", "quanto int4 b4"]


def test_show_prints_the_note_of_an_empty_figure(capsys):
    plots.show(plots.empty_figure("Scaling with batch size", "only batch 1 measured"))
    assert capsys.readouterr().out == "Scaling with batch size: only batch 1 measured\n"


def test_quality_with_one_keep_per_method_draws_every_method_as_a_bar():
    labels = {"full": ("full", 1.0), "snapkv": ("snapkv 25%", 0.25), "tova": ("tova 25%", 0.25),
              "quanto": ("quanto int4", 1.0), "hqq": ("hqq int4", 1.0), "fp8": ("fp8", 1.0)}
    q = pd.DataFrame([{"task": "niah_single", "method": m, "label": lab, "keep": k, "n": 1, "score": s}
                      for (m, (lab, k)), s in zip(labels.items(), [1, 0, 1, 1, 1, 1], strict=True)])
    fig = plots.quality_vs_keep(q)
    assert len(fig.data) == 1 and fig.data[0].type == "bar"
    assert list(fig.data[0].x) == [lab for lab, _ in labels.values()]  # all six, none hidden
    two = pd.concat([q, q.assign(label="quanto int2", score=0.5).iloc[[3]]], ignore_index=True)
    assert "quanto int2" in list(plots.quality_vs_keep(two).data[0].x)
