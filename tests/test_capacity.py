"""Capacity arithmetic (pure) and the capacity benchmark's mechanics on a CPU with the tiny model."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvlab.capacity import above, fit_peaks, max_batch, split_sequence

GB = 1e9
BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "capacity.py"


def bench():
    spec = importlib.util.spec_from_file_location("capacity_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_line_through_peaks_predicts_the_largest_batch_that_fits():
    line = fit_peaks([(1, 20.2 * GB), (4, 32.5 * GB), (16, 81.7 * GB)])  # full cache, H200 16k, 2026-12-02
    assert line.slope == pytest.approx(4.10 * GB, rel=0.01)
    assert max_batch(line, 150.1 * GB) == 32  # the report's "may fit at 147.3 GB"
    assert line.peak(32) == pytest.approx(147.3 * GB, rel=0.01)
    exact = fit_peaks([(1, 3.0), (3, 7.0)])
    assert (exact.intercept, exact.slope) == (1.0, 2.0)
    assert max_batch(exact, 10.0) == 4 and max_batch(exact, 0.5) == 0


def test_no_prediction_without_a_positive_slope_or_two_batches():
    assert max_batch(fit_peaks([(1, 5.0), (8, 5.0)]), 100.0) is None
    with pytest.raises(ValueError, match="two batch sizes"):
        fit_peaks([(4, 1.0), (4, 2.0)])


def test_the_split_says_where_a_sequence_goes():
    split = split_sequence(fit_peaks([(1, 18.3 * GB), (4, 24.8 * GB)]), 16.1 * GB, 0.21 * GB)
    assert split.per_sequence_bytes == pytest.approx(2.1667 * GB, rel=1e-3)
    assert split.transient_bytes == pytest.approx(split.per_sequence_bytes - 0.21 * GB)
    assert split.fixed_bytes == pytest.approx(18.3 * GB - split.per_sequence_bytes - 16.1 * GB)
    assert above(300) == 306 and above(10) == 11 and above(1) == 2


def test_the_benchmark_runs_on_a_cpu_and_writes_every_row(tmp_path):
    out = tmp_path / "c.json"
    assert bench().main(["--device", "cpu", "--model", "tiny-llama", "--ctx", "96", "--methods", "full", "snapkv10",
                         "--chunks", "none", "32", "--batches", "1", "2", "--new-tokens", "2", "--confirm", "none",
                         "--memory-gb", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["config"], r["batch"]) for r in rows} == {
        (c, b) for c in ("full@once", "full@32", "snapkv10@once", "snapkv10@32") for b in (1, 2)}
    assert all(r["status"] == "ok" and r["peak_mem_bytes"] for r in rows)
    snap = [r for r in rows if r["config"] == "snapkv10@32"]
    assert {r["cache_physical_tokens"] for r in snap} == {9}  # 10% of 96, chunked or not
    assert {f["config"] for f in data["fits"]} == {"full@once", "full@32", "snapkv10@once", "snapkv10@32"}
    assert set(data["fits"][0]["split"]) == {"weights_bytes", "fixed_bytes", "per_sequence_bytes",
                                             "kept_cache_bytes", "transient_bytes"}


def fake_measure(monkeypatch, fits_up_to: int):
    """measure_generation with peaks of 1 GB + 0.1 GB per sequence, out of memory above a batch."""
    import kvlab.measure as measure
    from kvlab.measure import Measurement

    def fake(loaded, policy, *, ctx, batch, new_tokens, engine=None, **kw):
        if batch > fits_up_to:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        record = {"peak_mem_bytes": 1e9 + 1e8 * batch, "cache_bytes": 4e7 * batch, "cache_physical_tokens": 9,
                  "prefill_s": 0.01 * batch, "itl_median_ms": 1.0}
        return Measurement(record=record, window=None)

    monkeypatch.setattr(measure, "measure_generation", fake)


def run_bench(tmp_path):
    out = tmp_path / "c.json"
    bench().main(["--device", "cpu", "--model", "tiny-llama", "--ctx", "64", "--methods", "snapkv10",
                  "--chunks", "32", "--confirm", "all", "--memory-gb", "2", "--out", str(out)])
    return json.loads(out.read_text())


def test_a_confirm_run_out_of_memory_steps_down_once(tmp_path, monkeypatch):
    fake_measure(monkeypatch, fits_up_to=9)  # the allocator's slack costs one sequence
    phases = {r["phase"]: r for r in run_bench(tmp_path)["rows"]}
    assert (phases["confirm"]["batch"], phases["confirm"]["status"]) == (10, "oom")
    assert (phases["below"]["batch"], phases["below"]["status"]) == (9, "ok")
    assert "above" not in phases


def test_confirm_runs_at_the_prediction_and_an_oom_above_it_is_a_clean_row(tmp_path, monkeypatch):
    """With peaks of 1 GB + 0.1 GB per sequence and 2 GB to fill, the prediction is 10 sequences:
    batch 10 runs, batch 11 raises CUDA's out-of-memory error and becomes an ``oom`` row."""
    fake_measure(monkeypatch, fits_up_to=10)
    data = run_bench(tmp_path)
    fit = data["fits"][0]
    assert fit["predicted_max_batch"] == 10
    assert fit["split"]["kept_cache_bytes"] == pytest.approx(4e7)
    assert fit["split"]["transient_bytes"] == pytest.approx(6e7)
    phases = {r["phase"]: r for r in data["rows"]}
    assert (phases["confirm"]["batch"], phases["confirm"]["status"]) == (10, "ok")
    assert (phases["above"]["batch"], phases["above"]["status"]) == (11, "oom")
    assert "out of memory" in phases["above"]["error"]


def test_compression_step_cost_reads_the_eviction_steps():
    from kvlab.capacity import compression_step_cost

    itl = [10.0] * 40
    itl[16] = itl[32] = 25.0
    cost = compression_step_cost(itl, 16)
    assert cost == {"at_interval_ms": [25.0, 25.0], "other_median_ms": 10.0, "extra_ms": 15.0}
    assert compression_step_cost(itl[:10], 16)["extra_ms"] is None
