"""The serving sweep's figures, from its records: latency against rate, goodput against rate,
energy per request against rate with each method's crossover, and a run's blocks timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.intervals import ratio_interval
from kvlab.serve.run import load_run


def load_sweep(out_dir) -> pd.DataFrame:
    """``serve_runs.jsonl`` as a frame, one row per complete run, ``label`` = method and its knobs."""
    path = Path(out_dir) / "serve_runs.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    df = pd.DataFrame([r for r in rows if r.get("status") == "complete"])
    if not df.empty:
        df["label"] = df["method"] + " " + df["params"].where(df["params"] != "{}", "")
    return df


def per_rate(df: pd.DataFrame, column: str) -> pd.DataFrame:
    """Median over repeats of ``column`` per (label, rate), with n."""
    return df.groupby(["label", "rate"])[column].agg(["median", "count"]).reset_index()


def crossover_rates(df: pd.DataFrame, column: str = "energy_per_request", baseline: str = "full") -> dict:
    """Per method, the lowest rate from which its median ``column`` stays at or below the baseline's
    at every higher rate (None: never). Medians over repeats, for the figure; the crossover with its
    interval (>= 3 repeats a side) is :func:`crossover_interval`'s."""
    table = per_rate(df.dropna(subset=[column]), column).pivot(index="rate", columns="label", values="median")
    base = [c for c in table.columns if c.strip() == baseline]
    if not base:
        return {}
    out = {}
    for label in table.columns:
        if label == base[0]:
            continue
        pays = (table[label] <= table[base[0]]).tolist()
        out[label] = next((r for i, r in enumerate(table.index) if all(pays[i:])), None)
    return out


def crossover_interval(df: pd.DataFrame, column: str = "energy_per_request", baseline: str = "full",
                       level: float = 0.95) -> dict:
    """Per method, where it starts to pay on the ratio of its mean ``column`` to the baseline's at each
    rate (:func:`kvlab.intervals.ratio_interval`): ``rate``, the lowest rate from which the ratio stays
    at or below 1 at every higher rate (None: never); with >= 3 repeats a side at every rate, ``lo``
    (from there on the ratio's lower bound stays <= 1: paying cannot be ruled out) and ``hi`` (its
    upper bound stays <= 1: it pays at ``level``), else None and ``n``, the fewest repeats a side."""
    data = df.dropna(subset=[column])
    base = next((c for c in data["label"].unique() if c.strip() == baseline), None)
    if base is None:
        return {}
    rates = [r.item() if hasattr(r, "item") else r for r in sorted(data["rate"].unique())]  # plain numbers
    values = {(label, rate): part[column].tolist() for (label, rate), part in data.groupby(["label", "rate"])}
    out = {}
    for label in data["label"].unique():
        if label == base:
            continue
        ratios = {r: ratio_interval(values.get((label, r), []), values.get((base, r), []), level) for r in rates}
        n = min(min(i.n) for i in ratios.values())
        bounded = all(i.has_bounds for i in ratios.values())
        out[label] = {"rate": _from_here_on(ratios, lambda i: i.value), "n": n, "level": level,
                      "method": "welch-log" if bounded else "none",
                      "lo": _from_here_on(ratios, lambda i: i.lo) if bounded else None,
                      "hi": _from_here_on(ratios, lambda i: i.hi) if bounded else None,
                      "ratios": {r: i.to_dict() for r, i in ratios.items()}}
    return out


def _from_here_on(ratios: dict, pick) -> float | None:
    """The lowest rate from which ``pick(interval) <= 1`` at every higher rate (NaN counts as not)."""
    rates = list(ratios)
    ok = [pick(ratios[r]) <= 1.0 for r in rates]  # NaN compares False
    return next((r for i, r in enumerate(rates) if all(ok[i:])), None)


def latency_throughput(df: pd.DataFrame) -> go.Figure:
    fig = make_subplots(rows=1, cols=2, subplot_titles=("p99 TTFT (s)", "p99 TPOT (s)"))
    for col, metric in ((1, "ttft_p99_s"), (2, "tpot_p99_s")):
        for label, part in per_rate(df, metric).groupby("label"):
            fig.add_scatter(x=part["rate"], y=part["median"], name=label, legendgroup=label, showlegend=col == 1,
                            row=1, col=col)
    fig.update_xaxes(title_text="request rate (req/s)")
    return fig


def goodput_vs_rate(df: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    for label, part in per_rate(df.dropna(subset=["goodput"]), "goodput").groupby("label"):
        fig.add_scatter(x=part["rate"], y=part["median"], name=label)
    fig.update_layout(xaxis_title="request rate (req/s)", yaxis_title="goodput (req/s meeting the SLO)")
    return fig


def energy_vs_rate(df: pd.DataFrame) -> go.Figure:
    unit = df["energy_unit"].dropna().iloc[0] if "energy_unit" in df and df["energy_unit"].notna().any() else "J"
    fig = go.Figure()
    crossings = crossover_rates(df)
    for label, part in per_rate(df.dropna(subset=["energy_per_request"]), "energy_per_request").groupby("label"):
        fig.add_scatter(x=part["rate"], y=part["median"], name=label)
        if crossings.get(label) is not None:
            fig.add_vline(x=crossings[label], line_dash="dot", annotation_text=f"{label} pays from here")
    fig.update_layout(xaxis_title="request rate (req/s)", yaxis_title=f"{unit} per request (steady state)")
    return fig


def blocks_timeline(run_dir) -> go.Figure:
    """Blocks allocated and blocks' worth of slots filled, and running requests, per step."""
    run = load_run(run_dir)
    rows = [json.loads(line) for line in (Path(run_dir) / "timeline.jsonl").read_text().splitlines() if line]
    t = pd.DataFrame(rows)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_scatter(x=t["time_s"], y=t["blocks_used"], name="blocks allocated")
    fig.add_scatter(x=t["time_s"], y=t["slots_filled"] / run.get("block_size", 16), name="blocks' worth filled")
    fig.add_scatter(x=t["time_s"], y=t["running"], name="running requests", secondary_y=True)
    fig.update_layout(title=f"{run.get('method')} at rate {run.get('rate')}: pool of {run.get('blocks_total')} blocks",
                      xaxis_title="time (s)")
    return fig
