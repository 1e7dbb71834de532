"""benchmarks/quant_attention.py's choice of launch configs (pure; the GPU run is the script's job)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvlab.kernels import LaunchConfig

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "quant_attention.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("quant_attention_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(label, batch, config, ms, rel_err=1e-3, status="ok"):
    return {"label": label, "batch": batch, "config": vars(config), "kernel_ms": ms * 1.1, "kernel_graph_ms": ms,
            "rel_err": rel_err, "status": status}


def test_winner_is_best_over_all_batches_and_within_error(bench):
    steady = LaunchConfig(variant="fold", block_n=128)
    spiky = LaunchConfig(variant="fold", block_n=256)  # best at batch 16, poor at batch 1
    wrong = LaunchConfig(variant="split", block_n=32)  # fastest everywhere, but its error is too large
    partial = LaunchConfig(variant="split", block_n=64)  # measured at one batch only
    rows = [row("int4-g64", 1, steady, 0.030), row("int4-g64", 16, steady, 0.120),
            row("int4-g64", 1, spiky, 0.060), row("int4-g64", 16, spiky, 0.100),
            row("int4-g64", 1, wrong, 0.010, rel_err=0.5), row("int4-g64", 16, wrong, 0.050, rel_err=0.5),
            row("int4-g64", 16, partial, 0.090),
            row("fp8", 1, spiky, 0.020), row("fp8", 1, steady, 0.025, status="failed")]
    winners = bench.pick_winners(rows)
    assert winners["int4-g64"]["config"] == vars(steady)  # geometric mean of ratios to the best 1.15, spiky's 1.49
    assert winners["int4-g64"]["best_ms"] == {1: 0.030, 16: 0.090}  # the partial config still sets the best
    assert winners["fp8"]["config"] == vars(spiky)
    split_only = bench.pick_winners(rows, variant="split")
    assert split_only["int4-g64"]["config"] == vars(partial)  # the only split config within error
    assert "fp8" not in split_only  # no split config measured ok for fp8
