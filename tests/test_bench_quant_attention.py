"""benchmarks/quant_attention.py's choice of launch configs (pure; the GPU run is the script's job)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

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


def test_bandwidth_fields_against_a_copy_of_the_same_bytes(bench):
    # 100 MB read in 0.1 ms = 1000 GB/s; the copy of the same 100 MB (read + write) took 0.05 ms = 4000 GB/s
    f = bench.bandwidth_fields(100e6, 0.1, 0.05, copy_gbps=4000.0)
    assert f["kernel_GBps"] == pytest.approx(1000.0)
    assert f["copy_same_bytes_GBps"] == pytest.approx(4000.0)
    assert f["of_copy_same_bytes"] == pytest.approx(0.25) and f["of_copy_bw"] == pytest.approx(0.25)
    assert f["floor_ms"] == pytest.approx(0.025) and f["x_floor"] == pytest.approx(4.0)


def fake_samples(bench, monkeypatch):
    """Clock.sample_ms returning 1, 2, 3, ... in call order; the callables it was handed, in order."""
    calls = []
    monkeypatch.setattr(bench.Clock, "sample_ms", lambda self, fn, iters: calls.append(fn) or float(len(calls)))
    return calls


CASE = {"format": "int4", "group": 64, "batch": 1, "q_heads": 4, "kv_heads": 2, "length": 40, "capacity": 40}


def test_performance_rows_carry_the_copy_fields_on_cpu(bench, monkeypatch):
    """The CPU path with the float32 reference and a fake clock: every row has the fields, and the
    kernel, the same-bytes copy and the same-bytes read alternate round by round."""
    fake_samples(bench, monkeypatch)
    rows = bench.run_performance(CASE, [LaunchConfig(variant="split")], "cpu", "reference", bench.Clock("cpu"),
                                 copy_gbps=None, seed=0, l2_bytes=0, iters=1, repeats=3, baselines=False)
    assert [r["status"] for r in rows] == ["ok"], rows
    r = rows[0]
    # rounds: (copy, read, kernel) x 3 -> copy 1, 4, 7; read 2, 5, 8; kernel 3, 6, 9 (AABB would give 2, 5, 8)
    assert r["kernel_ms"] == 6.0 and r["copy_same_bytes_ms"] == 4.0
    assert r["alternated"] is True and r["repeats"] == 3
    assert r["kernel_GBps"] == pytest.approx(r["kv_bytes"] / 6.0 / 1e6)
    assert r["of_copy_same_bytes"] == pytest.approx(4.0 / (2 * 6.0))  # the copy counts read + write
    assert r["x_floor"] == pytest.approx(6.0 / 2.0)


def test_launch_configs_alternate_within_a_case(bench, monkeypatch):
    """Two configs on one case: each timed once per round (ABAB), not all of one then the other."""
    fake_samples(bench, monkeypatch)
    configs = [LaunchConfig(variant="split"), LaunchConfig(variant="split", block_n=32)]
    rows = bench.run_performance(CASE, configs, "cpu", "reference", bench.Clock("cpu"), copy_gbps=None, seed=0,
                                 l2_bytes=0, iters=1, repeats=3, baselines=False)
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    # a round: copy, read, config 0, config 1 -> config 0 at 3, 7, 11 and config 1 at 4, 8, 12
    assert [r["kernel_ms"] for r in rows] == [7.0, 8.0]


def test_write_section_alternates_torch_and_kernel(bench, monkeypatch):
    fake_samples(bench, monkeypatch)
    case = {"format": "int4", "group": 64, "batch": 1, "kv_heads": 2, "capacity": 40}
    row = bench.run_write(case, "cpu", "reference", bench.Clock("cpu"), seed=0, iters=1, repeats=3)
    assert row["status"] == "ok", row
    assert (row["torch_ms"], row["kernel_ms"]) == (3.0, 4.0)  # torch at 1, 3, 5; kernel at 2, 4, 6


def test_tune_grids_cover_the_variants_asked_for_where_they_read(bench):
    def variants(fmt, *asked):
        case = {"format": fmt, "group": 64 if fmt == "int4" else None}
        return {c.variant for c in bench.tune_configs(case, quick=False, **({"variants": asked} if asked else {}))}

    assert variants("int4") == {"split", "fold", "fold_asm"}  # the default grids: no warp kernels
    assert variants("int4", "fold_asm", "warp_asm") == {"fold_asm", "warp_asm"}
    assert variants("fp8", "fold_asm", "warp_asm") == {"warp_asm"}  # PTX unpacking of fold: int4 only
    assert variants("bf16", "warp", "fold") == {"fold"}  # the warp kernel reads int4 and fp8
    shapes = [c for c in bench.tune_configs({"format": "fp8", "group": None}, quick=False, variants=("warp",))]
    assert all(c.block_n // c.num_warps >= 16 for c in shapes)  # every warp keeps 16 slots of a block


def test_bandwidth_fields_against_a_read_only_stream(bench):
    # 100 MB read in 0.1 ms = 1000 GB/s; a reduction over the same 100 MB took 0.04 ms = 2500 GB/s
    f = bench.bandwidth_fields(100e6, 0.1, copy_ms=0.05, read_ms=0.04, read_gbps=2000.0)
    assert f["read_same_bytes_GBps"] == pytest.approx(2500.0)
    assert f["of_read_same_bytes"] == pytest.approx(0.4) and f["x_read_floor"] == pytest.approx(2.5)
    assert f["of_read_bw"] == pytest.approx(0.5)
    assert f["of_copy_same_bytes"] == pytest.approx(0.25)  # the copy's figure stays beside it


def test_read_stream_reads_every_word(bench):
    import kernel_timing  # on the path once the script is loaded

    buf = torch.zeros(4096, dtype=torch.uint8)
    buf[4092:] = torch.tensor([1, 0, 0, 0], dtype=torch.uint8)  # the last int32 word is 1 (little-endian)
    assert int(kernel_timing.read_words(buf)) == 1


def test_same_bytes_streams_scale_to_the_bytes_asked(bench):
    import kernel_timing

    _, per_call = kernel_timing.read_same_bytes("cpu", 10, copies=3)  # 10 bytes read as 8 (whole words)
    assert per_call == pytest.approx(3 * 8 / 10)
    _, per_call = kernel_timing.copy_same_bytes("cpu", 10, copies=3)
    assert per_call == 3
