"""The serving notebook's explorer: pick a method and an SLO; goodput against rate is re-counted at
that SLO from every run's request records (vLLM's definition: requests meeting every SLO per second
of the run), beside the method's p99 TTFT and TPOT per rate and its blocks timeline. Plain functions
of values (tested without a browser or kernel), plus one ipywidgets UI over them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from kvlab.serve import metrics
from kvlab.serve.figures import blocks_timeline
from kvlab.serve.run import load_run

DEFAULT_SLO = {"ttft": 2.0, "tpot": 0.1}  # seconds: p99-style service levels for an interactive chat


def run_records(out_dir, df: pd.DataFrame) -> dict[str, list[dict]]:
    """Each run's finished requests (the records with tokens), by run folder name."""
    return {run: [r for r in load_run(Path(out_dir) / run)["records"] if r.get("token_times")] for run in df["run"]}


def goodput_at(df: pd.DataFrame, records: dict[str, list[dict]], slo: dict) -> pd.DataFrame:
    """Per run (``label``, ``rate``, ``repeat``): goodput at ``slo`` (seconds; keys ttft, tpot, e2el)."""
    good = [sum(metrics.good(r, slo) for r in records[run]) / d if d and d > 0 else None
            for run, d in zip(df["run"], df["duration_s"], strict=True)]
    return df[["label", "rate", "repeat", "run"]].assign(goodput=good)


def slo_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Median goodput over repeats per (label, rate), with n (no interval: see kvlab.intervals for one)."""
    return runs.groupby(["label", "rate"])["goodput"].agg(["median", "count"]).reset_index()


@dataclass
class SloViews:
    table: pd.DataFrame  # per (label, rate): median goodput at the SLO, n
    latency: pd.DataFrame  # the picked method's median p99 TTFT and TPOT per rate
    figures: dict[str, go.Figure]


def slo_views(df: pd.DataFrame, records: dict[str, list[dict]], label: str, slo: dict, out_dir) -> SloViews:
    """What the explorer shows for ``label`` (a ``load_sweep`` label) at ``slo``."""
    if label not in set(df["label"]):
        raise ValueError(f"no method {label!r} among the runs: {', '.join(sorted(set(df['label'])))}")
    table = slo_table(goodput_at(df, records, slo))
    fig = go.Figure()
    for name, part in table.groupby("label"):
        fig.add_scatter(x=part["rate"], y=part["median"], name=name, line_width=4 if name == label else 1.5)
    said = ", ".join(f"{k} <= {v:g} s" for k, v in slo.items())
    fig.update_layout(xaxis_title="request rate (req/s)", yaxis_title="goodput (req/s)", title=f"goodput at {said}")
    mine = df[df["label"] == label]
    latency = mine.groupby("rate")[["ttft_p99_s", "tpot_p99_s"]].median().reset_index()
    last = mine.sort_values(["rate", "repeat"])["run"].iloc[-1]
    return SloViews(table, latency, {"goodput": fig, "timeline": blocks_timeline(Path(out_dir) / last)})


class ServingExplorer:
    """ipywidgets controls (method, TTFT and TPOT SLOs) -> :func:`slo_views` -> an Output widget.
    ``state`` updates synchronously when a control's value changes, so tests set ``.value``."""

    def __init__(self, out_dir, df: pd.DataFrame, slo: dict | None = None, method: str | None = None):
        import ipywidgets as W

        if df.empty:
            raise ValueError(f"no complete runs in {out_dir}: run the sweep first")
        self.out_dir, self.df = out_dir, df
        self.records = run_records(out_dir, df)
        slo = {**DEFAULT_SLO, **(slo or {})}
        labels = sorted(set(df["label"]))
        style = {"description_width": "90px"}
        self.controls = {
            "method": W.Dropdown(options=labels, value=method if method in labels else labels[0], description="method",
                                 style=style),
            "ttft": W.FloatLogSlider(value=slo["ttft"], base=10, min=-2, max=2, step=0.1, description="TTFT SLO (s)",
                                     style=style),
            "tpot": W.FloatLogSlider(value=slo["tpot"], base=10, min=-3, max=1, step=0.1, description="TPOT SLO (s)",
                                     style=style),
        }
        self.output = W.Output()
        self.state: SloViews | None = None
        for control in self.controls.values():
            control.observe(self.update, names="value")
        self.ui = W.VBox([W.HBox(list(self.controls.values())), self.output])
        self.update()

    def slo(self) -> dict:
        return {"ttft": self.controls["ttft"].value, "tpot": self.controls["tpot"].value}

    def update(self, change=None) -> None:
        self.state = slo_views(self.df, self.records, self.controls["method"].value, self.slo(), self.out_dir)
        self.render()

    def render(self) -> None:
        """The views as the Output widget's state (inside IPython only), not printed into it: printing
        inside ``with output:`` can deadlock nbclient (papermill), as kvlab.widgets explains."""
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            return
        outputs = []
        for obj in (self.state.table, self.state.latency, *self.state.figures.values()):
            if isinstance(obj, go.Figure):
                data, meta = pio.renderers["plotly_mimetype"].to_mimebundle(obj.to_dict()), {}
            else:
                data, meta = shell.display_formatter.format(obj)
            outputs.append({"output_type": "display_data", "data": data, "metadata": meta})
        self.output.outputs = tuple(outputs)

    def _repr_mimebundle_(self, **kwargs):
        return self.ui._repr_mimebundle_(**kwargs)


def serving_explorer(out_dir, df: pd.DataFrame, params=None, method: str | None = None) -> ServingExplorer:
    """The explorer over a serving sweep's runs; the sliders start at ``params.traffic.slo`` where the
    params give one (kvlab's 2 s TTFT, 100 ms TPOT otherwise)."""
    slo = getattr(getattr(params, "traffic", None), "slo", None)
    return ServingExplorer(out_dir, df, slo.as_dict() if slo else None, method)
