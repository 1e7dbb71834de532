"""benchmarks/quality_engines.py's summary (issue #28): per cell, each engine's mean gold NLL and
whether fast's mean difference from hf is within the per-item noise (two standard errors)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "quality_engines.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("quality_engines_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agreement_is_the_mean_difference_against_its_t_interval(bench):
    noisy = bench.agreement([0.5, 0.4, 0.6, 0.5], [0.3, 0.6, 0.4, 0.7])  # differences -0.2, 0.2, -0.2, 0.2
    assert noisy["diff"] == pytest.approx(0.0) and noisy["within_noise"] is True
    assert noisy["sd_item_diff"] == pytest.approx(0.2309, abs=1e-4)
    assert noisy["se_diff"] == pytest.approx(noisy["sd_item_diff"] / 2)
    assert noisy["max_item_diff"] == pytest.approx(0.2)
    shifted = bench.agreement([0.5, 0.4, 0.6, 0.5], [0.3, 0.21, 0.39, 0.3])  # about -0.2 on every item
    assert shifted["diff"] == pytest.approx(-0.2, abs=0.01) and shifted["within_noise"] is False
    assert bench.agreement([0.5], [0.4])["within_noise"] is None  # one item: no spread to compare with
    two = bench.agreement([0.5, 0.4], [0.3, 0.21])  # 2 items: no interval, whatever their spread
    assert two["within_noise"] is None and two["diff_lo"] is None
    # 4 items: the mean 0 minus t(3) = 3.182 standard errors
    assert noisy["diff_lo"] == pytest.approx(-3.1824 * noisy["se_diff"], rel=1e-3)


def record(method, depth, nll, engine_score=1.0):
    return {"method": method, "task": "niah_single", "length": 1024, "depth": depth, "sample": 0,
            "gold_nll": nll, "score": engine_score}


def test_summary_rows_pair_items_across_engines(bench):
    records = {"hf": [record("kvq-int4", d, n) for d, n in ((0.1, 0.4), (0.5, 0.5), (0.9, 0.6))],
               "fast": [record("kvq-int4", d, n) for d, n in ((0.1, 0.3), (0.5, 0.6), (0.9, 0.5))],
               "hf1": [record("kvq-int4", d, n) for d, n in ((0.1, 0.45), (0.5, 0.55))]}  # one item missing
    records["fast"].append({**record("kvq-int4", 0.3, 9.0), "status": "failed"})
    [row] = bench.summary_rows(records, ["kvq-int4", "full"], ["niah_single"], [1024])
    assert row["n"] == 3 and row["hf_gold_nll"] == pytest.approx(0.5) and row["fast_gold_nll"] == pytest.approx(0.4667,
                                                                                                                  abs=1e-4)
    assert row["diff"] == pytest.approx(-1 / 30) and row["within_noise"] is True
    assert "hf1_diff" not in row  # hf1 did not run every item of the cell
    bench.print_rows([row])
