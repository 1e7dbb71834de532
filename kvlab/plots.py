"""Figures: pure functions from DataFrames (records, summaries, budget tables) to plotly Figures.

No measuring, no file access: notebooks and reports pass frames in and show what comes out, so
every figure is testable on a synthetic frame. Summaries with confidence intervals are computed in
:mod:`kvlab.report`; a plot draws columns ``m``, ``m_lo`` and ``m_hi`` when it is given them.
Missing data (no energy counter on CPU, no quality records) gives an empty figure that says why,
rather than an error, so a smoke report still renders end to end.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from kvlab.reporting.text import ci_text, fmt_ctx, is_baseline_label, runs_text

GB = 1e9
BASELINE_COLOR = "#555555"
PALETTE = qualitative.Plotly + qualitative.D3

# Anatomy categories, bottom to top of a stacked bar (kvlab.anatomy produces these names).
ANATOMY_ORDER = ("weight GEMMs", "attention", "page selection", "cache update/concat", "quantize", "dequantize",
                 "other ops", "CPU/launch gap")
ANATOMY_COLORS = dict(zip(ANATOMY_ORDER, ("#4c78a8", "#f58518", "#ffbf79", "#54a24b", "#e45756", "#b279a2",
                                          "#9d9d9d", "#e8e8e8"), strict=True))


# ---------------------------------------------------------------------------------------------
# helpers


def is_empty(fig: go.Figure) -> bool:
    """True for an :func:`empty_figure` (no traces, a note)."""
    return len(fig.data) == 0


def show(fig: go.Figure) -> None:
    """Draw a figure, or print its note when it has no data: sections a folder may lack (batch
    sizes, anatomy) then read as one sentence instead of an empty frame."""
    if is_empty(fig):
        notes = [a.text for a in fig.layout.annotations if a.text]
        title = fig.layout.title.text or "figure"
        print(f"{title}: {'; '.join(notes) or 'no data'}")
    else:
        fig.show()


def empty_figure(title: str, reason: str) -> go.Figure:
    """A titled figure with a centred note: the report keeps its layout when data are missing."""
    fig = go.Figure()
    fig.add_annotation(text=reason, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                       font=dict(size=14, color="#666"))
    fig.update_layout(title=title, xaxis=dict(visible=False), yaxis=dict(visible=False), height=300)
    return fig


# Colours are assigned per label in order of first use in this process, so all figures drawn by
# one report (one kernel) agree; the full cache (the baseline) is always grey.
_LABEL_COLORS: dict[str, str] = {}


def color_map(labels: Iterable[str]) -> dict[str, str]:
    """label -> colour, stable across figures (see _LABEL_COLORS)."""
    out = {}
    for label in dict.fromkeys(str(x) for x in labels):
        if is_baseline_label(label):
            out[label] = BASELINE_COLOR
            continue
        if label not in _LABEL_COLORS:
            _LABEL_COLORS[label] = PALETTE[len(_LABEL_COLORS) % len(PALETTE)]
        out[label] = _LABEL_COLORS[label]
    return out


def _has(df: pd.DataFrame | None, *cols: str) -> bool:
    """True when df exists, has the columns and at least one row where all are present."""
    if df is None or df.empty or any(c not in df.columns for c in cols):
        return False
    return bool(df[list(cols)].notna().all(axis=1).any())


def _error_y(df: pd.DataFrame, col: str) -> dict | None:
    lo, hi = f"{col}_lo", f"{col}_hi"
    if lo not in df.columns or hi not in df.columns or df[[lo, hi]].isna().all().all():
        return None
    return dict(type="data", symmetric=False, array=(df[hi] - df[col]).tolist(),
                arrayminus=(df[col] - df[lo]).tolist(), thickness=1.2, width=4)


# ---------------------------------------------------------------------------------------------
# byte budget (tables from kvlab.widgets)


def cache_vs_context(table: pd.DataFrame, free_bytes: float | None = None,
                     gpu_name: str | None = None, note: str | None = None) -> go.Figure:
    """Cache GB against context, one line per format; optional line: memory left after weights
    (only when some is left: ``note`` says why not, e.g. the weights alone exceed the GPU)."""
    fig = go.Figure()
    colors = color_map(table["format"])
    for name, part in table.groupby("format", sort=False):
        fig.add_trace(go.Scatter(x=part["ctx"], y=part["cache_bytes"] / GB, mode="lines+markers",
                                 name=str(name), line=dict(color=colors[str(name)])))
    if free_bytes is not None:
        label = f"free after weights{' on ' + gpu_name if gpu_name else ''}: {free_bytes / GB:.1f} GB"
        fig.add_hline(y=free_bytes / GB, line=dict(dash="dot", color="#c00"), annotation_text=label,
                      annotation_position="top left")
    if note:
        fig.add_annotation(text=note, x=0, y=1, xref="paper", yref="paper", xanchor="left", yanchor="bottom",
                           showarrow=False, font=dict(color="#b00"))
    fig.update_layout(title="KV cache size vs context", xaxis_title="context (tokens)",
                      yaxis_title="cache (GB)", legend_title="format", hovermode="x unified")
    fig.update_xaxes(type="log")
    return fig


def capacity(table: pd.DataFrame, gpu_name: str, ctx: int) -> go.Figure:
    """Max batch (sequences that fit) per format on one GPU at one context."""
    colors = color_map(table["format"])
    text = [str(b) if b > 0 else "0: not one sequence fits" for b in table["max_batch"]]
    fig = go.Figure(go.Bar(x=table["format"], y=table["max_batch"], text=text, textposition="outside",
                           cliponaxis=False, marker_color=[colors[str(f)] for f in table["format"]]))
    fig.update_layout(title=f"Capacity on {gpu_name} at {fmt_ctx(ctx)} context",
                      xaxis_title="cache format", yaxis_title="max batch (sequences)", showlegend=False)
    fig.update_yaxes(range=[0, max(1, float(table["max_batch"].max())) * 1.2])  # room for the labels
    return fig


def decode_split(table: pd.DataFrame, gpu_name: str | None = None) -> go.Figure:
    """Bytes one decode step reads (weights + KV, stacked) and its roofline time per format."""
    with_floor = "floor_ms" in table.columns and table["floor_ms"].notna().any()
    fig = make_subplots(rows=1, cols=2 if with_floor else 1, horizontal_spacing=0.12,
                        subplot_titles=("bytes read per decode step", "roofline time per step")
                        if with_floor else ("bytes read per decode step",))
    fig.add_trace(go.Bar(x=table["format"], y=table["weight_bytes"] / GB, name="weights",
                         marker_color="#4c78a8"), row=1, col=1)
    fig.add_trace(go.Bar(x=table["format"], y=table["kv_bytes"] / GB, name="KV cache",
                         marker_color="#f58518"), row=1, col=1)
    fig.update_yaxes(title_text="GB per step", row=1, col=1)
    if with_floor:
        fig.add_trace(go.Bar(x=table["format"], y=table["floor_ms"], name="roofline time",
                             text=[f"{v:.2f} ms" for v in table["floor_ms"]], textposition="outside",
                             cliponaxis=False, marker_color="#54a24b", showlegend=False), row=1, col=2)
        fig.update_yaxes(range=[0, float(table["floor_ms"].max()) * 1.2], row=1, col=2)
        fig.update_yaxes(title_text=f"ms per step{' on ' + gpu_name if gpu_name else ''}", row=1, col=2)
    fig.update_layout(barmode="stack", title="What a decode step must read")
    return fig


def compression_vs_context(table: pd.DataFrame) -> go.Figure:
    """Real compression ratio against context; dashed: the nominal ratio the bits promise."""
    fig = go.Figure()
    colors = color_map(table["format"])
    for name, part in table.groupby("format", sort=False):
        c = colors[str(name)]
        fig.add_trace(go.Scatter(x=part["ctx"], y=part["ratio"], mode="lines+markers", name=str(name),
                                 line=dict(color=c)))
        if "nominal" in part.columns:
            fig.add_trace(go.Scatter(x=part["ctx"], y=part["nominal"], mode="lines", showlegend=False,
                                     name=f"{name} nominal", line=dict(color=c, dash="dash", width=1)))
    fig.update_layout(title="Real compression ratio vs context (dashed: nominal bits ratio)",
                      xaxis_title="context (tokens)", yaxis_title="16-bit bytes / compressed bytes",
                      legend_title="format")
    fig.update_xaxes(type="log")
    return fig


# ---------------------------------------------------------------------------------------------
# study (records and summaries from kvlab.report)


def study_table(summary: pd.DataFrame, columns: dict[str, str], title: str,
                key: str = "label") -> go.Figure:
    """A table figure: one row per method, ``mean [lo, hi]`` per metric (``columns``: col -> header)."""
    if summary is None or summary.empty:
        return empty_figure(title, "no performance records")
    cells = [summary[key].astype(str).tolist(), [str(n) for n in runs_text(summary)]]
    for col in columns:
        cells.append([ci_text(r.get(col), r.get(f"{col}_lo"), r.get(f"{col}_hi"))
                      for r in summary.to_dict("records")])
    fig = go.Figure(go.Table(
        header=dict(values=["method", "runs", *columns.values()], fill_color="#eef", align="left"),
        cells=dict(values=cells, align="left", height=26),
    ))
    fig.update_layout(title=title, height=120 + 28 * len(summary), margin=dict(t=60, b=10))
    return fig


def relative_to_baseline(rel: pd.DataFrame, metric_title: str = "J/token",
                         baseline: str = "full", why: str | None = None) -> go.Figure:
    """Each method's metric over the baseline's (1.0 = same), with CIs and "+35%" labels; ``why``
    says why there is no data (e.g. the recorded energy source), when known."""
    title = f"{metric_title} relative to {baseline}"
    if not _has(rel, "ratio"):
        return empty_figure(title, why or f"no {metric_title} data in these records")
    rel = rel.dropna(subset=["ratio"])
    x = rel["label"].astype(str)
    if "ctx" in rel.columns and rel["ctx"].nunique() > 1:
        x = x + " @" + rel["ctx"].map(fmt_ctx)
    if "batch" in rel.columns and rel["batch"].nunique() > 1:  # a folder of sweeps: bars per batch
        x = x + " b" + rel["batch"].map(lambda b: str(int(b)))
    colors = color_map(rel["label"])
    fig = go.Figure(go.Bar(
        x=x, y=rel["ratio"], error_y=_error_y(rel, "ratio"),
        text=[f"{(r - 1) * 100:+.0f}%" for r in rel["ratio"]], textposition="outside",
        marker_color=[colors[str(label)] for label in rel["label"]],
    ))
    fig.add_hline(y=1.0, line=dict(color=BASELINE_COLOR, dash="dash"), annotation_text=baseline)
    fig.update_layout(title=title, yaxis_title=f"{metric_title} / {baseline}", showlegend=False)
    return fig


def energy_vs_memory(records: pd.DataFrame, energy: str = "j_per_token",
                     memory: str = "peak_mem_bytes", why: str | None = None) -> go.Figure:
    """One point per run: peak memory against J/token; good methods sit bottom-left."""
    title = "Energy vs memory per run"
    if not _has(records, energy):
        return empty_figure(title, why or f"no {energy} data in these records")
    if not _has(records, energy, memory):
        return empty_figure(title, f"no {memory} data")
    df = records.dropna(subset=[energy, memory])
    colors = color_map(df["label"])
    fig = go.Figure()
    for label, part in df.groupby("label", sort=False):
        hover = [f"ctx {c} · batch {b}" for c, b in zip(part["ctx"], part["batch"], strict=True)]
        fig.add_trace(go.Scatter(x=part[memory] / GB, y=part[energy], mode="markers", name=str(label),
                                 text=hover, marker=dict(color=colors[str(label)], size=9, opacity=0.8)))
    fig.update_layout(title=title, xaxis_title="peak memory (GB)", yaxis_title=energy.replace("_", " "),
                      legend_title="method")
    return fig


def itl_vs_context(summary: pd.DataFrame, metric: str = "itl_median_ms") -> go.Figure:
    """Time between tokens against context, one line per method, with CI bars."""
    title = "Time between tokens vs context"
    if not _has(summary, metric, "ctx"):
        return empty_figure(title, "no latency records")
    colors = color_map(summary["label"])
    fig = go.Figure()
    for label, part in summary.sort_values("ctx").groupby("label", sort=False):
        fig.add_trace(go.Scatter(x=part["ctx"], y=part[metric], mode="lines+markers", name=str(label),
                                 error_y=_error_y(part, metric), line=dict(color=colors[str(label)])))
    fig.update_layout(title=title, xaxis_title="context (tokens)", yaxis_title="ms per token",
                      legend_title="method")
    fig.update_xaxes(type="log")
    return fig


def token_latency_series(records: pd.DataFrame, ctx: int | None = None) -> go.Figure:
    """Per-token latency of one run per method: a quantized cache's residual flushes show as spikes."""
    title = "Per-token latency" + (f" at {fmt_ctx(ctx)} context" if ctx else "")
    if records is None or records.empty or "itl_ms" not in records.columns:
        return empty_figure(title, "no latency records")
    df = records if ctx is None else records[records["ctx"] == ctx]
    df = df[df["itl_ms"].map(lambda v: isinstance(v, (list, tuple)) or hasattr(v, "__len__"))]
    if df.empty:
        return empty_figure(title, "no per-token latencies at this context")
    sort_cols = [c for c in ("batch", "prompt_id", "repeat") if c in df.columns]
    df = df.sort_values(sort_cols) if sort_cols else df
    colors = color_map(df["label"])
    fig = go.Figure()
    for label, part in df.groupby("label", sort=False):
        itl = list(part["itl_ms"].iloc[0])
        fig.add_trace(go.Scatter(x=list(range(1, len(itl) + 1)), y=itl, mode="lines", name=str(label),
                                 line=dict(color=colors[str(label)], width=1.3)))
    fig.update_layout(title=title, xaxis_title="decode step", yaxis_title="ms", legend_title="method",
                      hovermode="x unified")
    return fig


def quality_vs_keep(summary: pd.DataFrame, metric: str = "score", key: str | None = None) -> go.Figure:
    """Task score against keep ratio, one line per method, one panel per task. When no method ran
    at two keep ratios, one bar per method instead: lines would stack every method on one or two x
    positions (the full cache and the quantized caches all keep 1.0)."""
    title = "Quality vs keep ratio"
    if not _has(summary, metric, "keep"):
        return empty_figure(title, "no quality records in this folder")
    if key is None:  # a method that ran at several keeps is one line; else its label (quanto int4, int2)
        key = "series"
        if {"method", "label"} <= set(summary.columns):
            several = summary.groupby("method")["keep"].transform("nunique") > 1
            summary = summary.assign(series=summary["method"].where(several, summary["label"]))
        else:
            summary = summary.assign(series=summary["method" if "method" in summary.columns else "label"])
    tasks = list(dict.fromkeys(summary["task"])) if "task" in summary.columns else [None]
    fig = make_subplots(rows=1, cols=len(tasks), shared_yaxes=True,
                        subplot_titles=[str(t) for t in tasks] if tasks != [None] else None)
    colors = color_map(summary[key])
    if summary.groupby(key)["keep"].nunique().max() < 2:
        for i, task in enumerate(tasks, start=1):
            part = summary if task is None else summary[summary["task"] == task]
            fig.add_trace(go.Bar(x=part[key].astype(str), y=part[metric], error_y=_error_y(part, metric),
                                 marker_color=[colors[str(n)] for n in part[key]], showlegend=False,
                                 text=[f"{v:.2f}" for v in part[metric]], textposition="outside",
                                 cliponaxis=False), row=1, col=i)
        fig.update_yaxes(title_text=metric.replace("_", " "), row=1, col=1)
        fig.update_layout(title="Quality per method (each at one keep ratio)", margin=dict(t=80))
        return fig
    for i, task in enumerate(tasks, start=1):
        part_t = summary if task is None else summary[summary["task"] == task]
        for name, part in part_t.sort_values("keep").groupby(key, sort=False):
            fig.add_trace(go.Scatter(x=part["keep"], y=part[metric], mode="lines+markers", name=str(name),
                                     legendgroup=str(name), showlegend=i == 1,
                                     error_y=_error_y(part, metric), line=dict(color=colors[str(name)])),
                          row=1, col=i)
        fig.update_xaxes(title_text="keep ratio", row=1, col=i)
    fig.update_yaxes(title_text=metric.replace("_", " "), row=1, col=1)
    fig.update_layout(title=title, legend_title=key)
    return fig


def energy_counter_vs_10hz(records: pd.DataFrame, counter: str = "energy_j",
                           sampled: str = "energy_10hz_j", why: str | None = None) -> go.Figure:
    """The hardware energy counter against 10 Hz power integration, per run; the line is equality."""
    title = "Energy counter vs 10 Hz power integration"
    if not _has(records, counter, sampled):
        return empty_figure(title, why or "no energy measurements in these records")
    df = records.dropna(subset=[counter, sampled])
    colors = color_map(df["label"])
    fig = go.Figure()
    for label, part in df.groupby("label", sort=False):
        fig.add_trace(go.Scatter(x=part[counter], y=part[sampled], mode="markers", name=str(label),
                                 marker=dict(color=colors[str(label)], size=8)))
    top = float(max(df[counter].max(), df[sampled].max())) * 1.05
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="equal",
                             line=dict(color=BASELINE_COLOR, dash="dash")))
    fig.update_layout(title=title, xaxis_title="counter (J)", yaxis_title="10 Hz integration (J)",
                      legend_title="method")
    return fig


def anatomy_bars(table: pd.DataFrame, key: str = "label", why: str | None = None) -> go.Figure:
    """Where a decode step's time goes, per method: stacked ms per category (kvlab.anatomy)."""
    title = "Anatomy of a decode step"
    if not _has(table, "category", "ms"):
        return empty_figure(title, why or "no anatomy data")
    order = [c for c in ANATOMY_ORDER if c in set(table["category"])]
    order += [c for c in dict.fromkeys(table["category"]) if c not in order]
    methods = list(dict.fromkeys(table[key]))
    fig = go.Figure()
    for cat in order:
        part = table[table["category"] == cat].set_index(key).reindex(methods)
        fig.add_trace(go.Bar(x=methods, y=part["ms"].fillna(0.0), name=cat,
                             marker_color=ANATOMY_COLORS.get(cat)))
    if "wall_ms" in table.columns:
        walls = table.groupby(key, sort=False)["wall_ms"].first().reindex(methods)
        fig.add_trace(go.Scatter(x=methods, y=walls, mode="markers+text", name="wall",
                                 text=[f"{w:.2f} ms" for w in walls], textposition="top center",
                                 marker=dict(symbol="line-ew-open", size=30, color="black")))
    fig.update_layout(barmode="stack", title=title, yaxis_title="ms per decode step",
                      legend_title="category")
    return fig


# ---------------------------------------------------------------------------------------------
# a folder of sweeps (summaries from kvlab.report.batch_summary and compression_pays)


def batch_scaling(summary: pd.DataFrame, metrics: dict[str, str], title: str = "Scaling with batch size",
                  key: str = "label", why: str | None = None) -> go.Figure:
    """One panel per metric against batch (log x), one line per method with CI bars; (method,
    batch) pairs that failed (``status`` ``failed: OOM``) are listed under the panels."""
    present = [m for m in metrics if _has(summary, m, "batch")]
    if not present or summary["batch"].nunique() < 2:
        return empty_figure(title, why or "fewer than two batch sizes at one context: no batch scaling to show")
    cols = 2 if len(present) > 1 else 1
    rows = math.ceil(len(present) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[metrics[m] for m in present],
                        horizontal_spacing=0.1, vertical_spacing=0.16)
    colors = color_map(summary[key])
    ok = summary[summary["n"] > 0] if "n" in summary.columns else summary
    for i, m in enumerate(present):
        r, c = i // cols + 1, i % cols + 1
        for label, part in ok.sort_values("batch").groupby(key, sort=False):
            part = part.dropna(subset=[m])
            if part.empty:
                continue
            fig.add_trace(go.Scatter(x=part["batch"], y=part[m], mode="lines+markers", name=str(label),
                                     legendgroup=str(label), showlegend=i == 0, error_y=_error_y(part, m),
                                     line=dict(color=colors[str(label)])), row=r, col=c)
        batches = sorted(int(b) for b in summary["batch"].unique())
        fig.update_xaxes(type="log", tickvals=batches, ticktext=[str(b) for b in batches],
                         title_text="batch" if r == rows else None, row=r, col=c)
    failed = summary[summary["status"].astype(str).str.startswith("failed")] if "status" in summary.columns \
        else summary.iloc[0:0]
    if not failed.empty:
        text = "; ".join(f"{lab} at batch {int(b)}: {st}" for lab, b, st in
                         zip(failed[key], failed["batch"], failed["status"], strict=True))
        fig.add_annotation(text=text, x=0, y=-0.12, xref="paper", yref="paper", showarrow=False,
                           xanchor="left", font=dict(color="#c00"))
    fig.update_layout(title=title, legend_title="method", height=300 * rows + 120, margin=dict(b=90))
    return fig


def compression_pays(pays: pd.DataFrame, metric: str = "j_per_token", metric_title: str = "J/token",
                     baseline: str = "full", why: str | None = None) -> go.Figure:
    """Heatmap of each method's ``metric`` over the full cache's per (ctx, batch) cell: blue below
    1 (compression pays), red above; cells show the change with its CI, or why there is none."""
    title = f"Where compression pays: {metric_title} relative to {baseline}"
    col = f"{metric}_ratio"
    if not _has(pays, col):
        return empty_figure(title, why or f"no {metric_title} ratios in these records")
    df = pays.sort_values(["ctx", "batch"], kind="stable")
    cells = list(dict.fromkeys(zip(df["ctx"], df["batch"], strict=True)))
    x = [f"{fmt_ctx(c)} · b{int(b)}" for c, b in cells]
    labels = list(dict.fromkeys(pays["label"].astype(str)))
    z = [[math.nan] * len(cells) for _ in labels]
    text = [[""] * len(cells) for _ in labels]
    for r in df.to_dict("records"):
        i, j = labels.index(str(r["label"])), cells.index((r["ctx"], r["batch"]))
        v, lo, hi = r[col], r.get(f"{col}_lo"), r.get(f"{col}_hi")
        if v is None or math.isnan(v):
            text[i][j] = str(r.get("verdict", ""))
            continue
        z[i][j] = v
        ci = "" if lo is None or math.isnan(lo) else f"<br>[{(lo - 1) * 100:+.0f}%, {(hi - 1) * 100:+.0f}%]"
        text[i][j] = f"{(v - 1) * 100:+.0f}%{ci}"
    values = [v for row in z for v in row if not math.isnan(v)]
    spread = max(abs(v - 1) for v in values) or 0.05
    fig = go.Figure(go.Heatmap(
        x=x, y=labels, z=z, text=text, texttemplate="%{text}", zmid=1.0, zmin=1 - spread, zmax=1 + spread,
        colorscale="RdBu_r", colorbar=dict(title=f"× {baseline}"), hoverongaps=False,
        hovertemplate="%{y} at %{x}: %{z:.3f}× " + baseline + "<extra></extra>",
    ))
    fig.update_layout(title=title, xaxis_title="context · batch", yaxis=dict(autorange="reversed"),
                      height=160 + 45 * len(labels))
    return fig

