"""The serving notebook's explorer: goodput re-counted at the SLO the sliders pick, per method."""

from __future__ import annotations

import pytest

from kvlab.serve import figures, metrics, widgets
from kvlab.serve.traffic import TrafficError, traffic_sets


@pytest.fixture(scope="module")
def sweep(tiny, tmp_path_factory):
    from kvlab.serve.sweep import run_serving_sweep
    from kvlab.sweep.params import parse_params

    out = tmp_path_factory.mktemp("serve-widgets")
    params = parse_params({"models": "tiny-llama", "weights": "synthetic", "methods": ["full", "kvq-fp8"],
                           "ctx": [32], "traffic": {"arrival": "poisson", "rate": [50, 100], "requests": 4,
                                                    "lengths": {"kind": "fixed", "input": 12, "output": 3},
                                                    "server": {"num_blocks": 16, "block_size": 4},
                                                    "slo": {"ttft": 10, "tpot": 5}}})
    run_serving_sweep(params, out, loader=lambda *a, **k: tiny, log=lambda s: None)
    return out, params, figures.load_sweep(out)


def test_goodput_at_an_slo_is_the_runs_goodput_recounted_from_its_records(sweep):
    out, params, df = sweep
    records = widgets.run_records(out, df)
    loose = widgets.goodput_at(df, records, params.traffic.slo.as_dict())
    assert loose["goodput"].tolist() == pytest.approx(df["goodput"].tolist())  # the run's own SLO: its goodput
    none_meet = widgets.goodput_at(df, records, {"ttft": 1e-9})
    assert (none_meet["goodput"] == 0).all()
    ttfts = sorted(metrics.ttft(r) for r in records[df["run"].iloc[0]])
    some = widgets.goodput_at(df.iloc[:1], records, {"ttft": ttfts[1]})["goodput"].iloc[0]
    assert some == pytest.approx(2 / df["duration_s"].iloc[0])  # the two fastest first tokens meet it


def test_the_explorer_follows_its_method_and_slo_controls(sweep):
    out, params, df = sweep
    ex = widgets.serving_explorer(out, df, params)
    assert ex.controls["ttft"].value == pytest.approx(10) and ex.controls["tpot"].value == pytest.approx(5)
    table = ex.state.table
    assert set(table["label"]) == {"full ", "kvq-fp8 "} and (table["count"] == 1).all()
    assert table["median"].tolist() == pytest.approx(widgets.slo_table(widgets.goodput_at(
        df, ex.records, {"ttft": 10, "tpot": 5}))["median"].tolist())
    before = ex.state.table["median"]
    ex.controls["ttft"].value = 0.01  # the slider's smallest TTFT: the table follows
    assert ex.slo() == pytest.approx({"ttft": 0.01, "tpot": 5})
    assert ex.state.table["median"].tolist() == pytest.approx(widgets.slo_table(widgets.goodput_at(
        df, ex.records, {"ttft": 0.01, "tpot": 5}))["median"].tolist())
    assert (ex.state.table["median"] <= before).all()
    ex.controls["method"].value = "kvq-fp8 "
    assert ex.state.figures["goodput"].data[1].line.width == 4 and ex.state.figures["timeline"].data
    assert list(ex.state.latency["rate"]) == [50.0, 100.0]
    with pytest.raises(ValueError, match="no method 'snapkv'"):
        widgets.slo_views(df, ex.records, "snapkv", {"ttft": 1}, out)


def test_notebook_parameters_become_traffic_sets():
    assert traffic_sets([1, 2]) == ["traffic.rate=[1, 2]"]
    assert traffic_sets(None, None, "t.csv", replay=True) == [
        'traffic.lengths={"kind": "trace", "path": "t.csv"}', "traffic.arrival=trace"]
    with pytest.raises(TrafficError, match="not both"):
        traffic_sets(None, {"kind": "sharegpt"}, "t.csv")
    with pytest.raises(TrafficError, match="give trace too"):
        traffic_sets(replay=True)
