"""Capacity arithmetic (pure) and the capacity benchmark's mechanics on a CPU with the tiny model."""

import importlib.util
import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvlab.capacity import above, cap_for_batch, fit_peaks, max_batch, split_sequence

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


def test_with_row_groups_a_sequence_costs_its_store_and_the_transients_are_about_zero():
    """Fast engine, 4 rows per group (16k, Llama-3.1-8B shape): peak = weights + fixed + one group's
    transient + batch x (kept + new-token slots). The split finds no transient per sequence, and a
    slope a hair under the store (noise in the peaks) is a small negative, reported, not clipped."""
    weights, group, kept, slots = 16.1 * GB, 16.4 * GB, 2.147 * GB, 0.0005 * GB
    line = fit_peaks([(b, weights + 0.5 * GB + group + b * (kept + slots)) for b in (4, 16)])
    split = split_sequence(line, weights, kept, kept + slots)
    assert split.new_token_slots_bytes == pytest.approx(slots)
    assert split.transient_bytes == pytest.approx(0.0, abs=1e3)
    assert split.fixed_bytes == pytest.approx(0.5 * GB + group)
    assert max_batch(line, 150.1 * GB) == 54
    noisy = fit_peaks([(4, line.peak(4) + 4e6), (16, line.peak(16) - 4e6)])  # 8 MB of noise over 12 sequences
    split = split_sequence(noisy, weights, kept, kept + slots)
    assert split.transient_bytes == pytest.approx(-8e6 / 12) and split.transient_bytes < 0
    assert -0.001 < split.transient_share < 0
    assert split.as_dict()["transient_share"] == split.transient_share
    hf = split_sequence(line, weights, kept)  # no static store: the slots count as transients
    assert (hf.new_token_slots_bytes, hf.transient_bytes) == (0.0, pytest.approx(slots))


def test_a_memory_cap_puts_the_lines_largest_batch_where_asked():
    line = fit_peaks([(4, 20.9 * GB), (16, 23.5 * GB)])  # snapkv10@2048 fast rows4, roughly
    for batch in (1, 64, 300):
        assert max_batch(line, cap_for_batch(line, batch)) == batch
    assert cap_for_batch(line, 64) == pytest.approx(line.peak(64) + line.slope / 2)
    with pytest.raises(ValueError, match="positive slope"):
        cap_for_batch(fit_peaks([(1, 5.0), (8, 5.0)]), 4)


def test_the_benchmark_runs_on_a_cpu_and_writes_every_row(tmp_path):
    out = tmp_path / "c.json"
    assert bench().main(["--device", "cpu", "--model", "tiny-llama", "--ctx", "96", "--methods", "full", "snapkv10",
                         "--chunks", "none", "32", "--batches", "1", "2", "--new-tokens", "2", "--confirm", "none",
                         "--memory-gb", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    configs = ("full@once hf", "full@32 hf", "snapkv10@once hf", "snapkv10@32 hf")
    assert {(r["config"], r["batch"]) for r in rows} == {(c, b) for c in configs for b in (1, 2)}
    assert all(r["status"] == "ok" and r["peak_mem_bytes"] for r in rows)
    assert {(r["engine"], r["prefill_rows"], r["prefill_groups"]) for r in rows} == {("hf", None, 1)}
    snap = [r for r in rows if r["config"] == "snapkv10@32 hf"]
    assert {r["cache_physical_tokens"] for r in snap} == {9}  # 10% of 96, chunked or not
    assert {f["config"] for f in data["fits"]} == set(configs)
    assert set(data["fits"][0]["split"]) == {"weights_bytes", "fixed_bytes", "per_sequence_bytes",
                                             "kept_cache_bytes", "transient_bytes", "new_token_slots_bytes",
                                             "transient_share"}


def test_the_fast_engine_with_row_groups_runs_on_a_cpu_one_point_at_a_time(tmp_path, monkeypatch, capsys):
    """``--engine fast --prefill-rows 2``: fit batches 2 and 8 by default, rows named for the engine
    and the rows, each point starting with no decoder kept from the one before, and the
    ``--expandable-batch`` child (run in this process here) given the same engine and rows."""
    import subprocess

    import kvlab.measure as measure

    real, held = measure.measure_generation, []

    def spy(loaded, policy, *, engine=None, prefill_rows=None, **kw):
        held.append((len(engine._decoders), prefill_rows))  # what the engine kept when the point began
        return real(loaded, policy, engine=engine, prefill_rows=prefill_rows, **kw)

    monkeypatch.setattr(measure, "measure_generation", spy)
    module, out, children = bench(), tmp_path / "c.json", []

    def child(cmd, env, check):  # the child's own argv, through its main, in this process
        children.append(cmd)
        return subprocess.CompletedProcess(cmd, module.main(cmd[2:]))

    monkeypatch.setattr(module.subprocess, "run", child)
    assert module.main(["--device", "cpu", "--model", "tiny-llama", "--ctx", "96", "--methods", "full", "snapkv10",
                        "--chunks", "32", "--engine", "fast", "--prefill-rows", "2", "--new-tokens", "2",
                        "--confirm", "none", "--memory-gb", "2", "--expandable-batch", "3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["args"]["batches"] == [2, 8]
    fits = [r for r in data["rows"] if r["phase"] == "fit"]
    assert {(r["config"], r["batch"], r["prefill_groups"]) for r in fits} == {
        (c, b, b // 2) for c in ("full@32 fast rows2", "snapkv10@32 fast rows2") for b in (2, 8)}
    assert all(r["status"] == "ok" and r["engine"] == "fast" and r["prefill_rows"] == 2 for r in data["rows"])
    assert all(r["cache_bytes_allocated"] > r["cache_bytes"] for r in fits)  # kept + new-token slots
    assert held == [(0, 2)] * 5  # 4 fit points + the child's one: nothing kept from the point before
    assert {f["config"] for f in data["fits"]} == {"full@32 fast rows2", "snapkv10@32 fast rows2"}
    assert all(f["split"]["new_token_slots_bytes"] > 0 for f in data["fits"])
    (cmd,) = children
    assert cmd[cmd.index("--engine") + 1:][:1] == ["fast"] and cmd[cmd.index("--prefill-rows") + 1] == "2"
    (expandable,) = [r for r in data["rows"] if r["phase"] == "expandable_segments"]
    assert (expandable["config"], expandable["batch"], expandable["prefill_groups"]) == ("full@once fast rows2", 3, 2)
    assert "snapkv10@32 fast rows2" in capsys.readouterr().out


def fake_measure(monkeypatch, fits_up_to: int):
    """measure_generation with peaks of 1 GB + 0.1 GB per sequence, out of memory above a batch."""
    import kvlab.measure as measure
    from kvlab.measure import Measurement

    def fake(loaded, policy, *, ctx, batch, new_tokens, engine=None, prefill_rows=None, **kw):
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


def fake_memory_cap(monkeypatch, module):
    """The benchmark's ``memory_cap`` replaced by one that records each cap; ``cap_now[0]`` is the cap
    in force (None outside the block), for a fake allocator to refuse peaks above it."""
    caps, cap_now = [], [None]

    @contextmanager
    def fake_cap(device, cap_bytes):
        caps.append(cap_bytes)
        cap_now[0] = cap_bytes
        yield
        cap_now[0] = None

    monkeypatch.setattr(module, "memory_cap", fake_cap)
    return caps, cap_now


def run_capped_fast(module, out):
    """SnapKV on the fast engine, 2 rows per group, predicted in 10 GB and confirmed at 6 under a cap."""
    module.main(["--device", "cpu", "--model", "tiny-llama", "--ctx", "64", "--methods", "snapkv10", "--chunks", "32",
                 "--engine", "fast", "--prefill-rows", "2", "--confirm", "snapkv10@32", "--confirm-max-batch", "6",
                 "--memory-gb", "10", "--out", str(out)])
    return json.loads(out.read_text())


def test_a_confirm_above_the_cap_batch_runs_under_a_memory_cap_on_the_fast_engine(tmp_path, monkeypatch):
    """Fast, 2 rows per group, a transient-free line (1 GB + 0.1 GB per sequence, all of it the
    store): predicted 90 sequences in 10 GB, confirmed at 6 under a cap where the line predicts 6
    (1.65 GB); the allocator (faked: it refuses peaks over the cap) lets 6 run and stops 7."""
    import kvlab.measure as measure
    from kvlab.measure import Measurement

    module, out = bench(), tmp_path / "c.json"
    caps, cap_now = fake_memory_cap(monkeypatch, module)

    def fake(loaded, policy, *, ctx, batch, new_tokens, engine=None, prefill_rows=None, **kw):
        assert engine.name == "fast" and prefill_rows == 2
        peak = 1e9 + 1e8 * batch
        if cap_now[0] is not None and peak > cap_now[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 100.00 MiB")
        record = {"peak_mem_bytes": peak, "cache_bytes": 0.9e8 * batch, "cache_bytes_allocated": 1e8 * batch,
                  "cache_physical_tokens": 9, "prefill_s": 0.01 * batch, "itl_median_ms": 1.0,
                  "prefill_rows": prefill_rows if batch > prefill_rows else None}
        return Measurement(record=record, window=None)

    monkeypatch.setattr(measure, "measure_generation", fake)
    data = run_capped_fast(module, out)
    (fit,) = data["fits"]
    assert (fit["config"], fit["predicted_max_batch"]) == ("snapkv10@32 fast rows2", 90)
    assert fit["split"]["transient_bytes"] == pytest.approx(0.0, abs=1.0)
    assert fit["split"]["new_token_slots_bytes"] == pytest.approx(1e7)
    phases = {r["phase"]: r for r in data["rows"]}
    assert [r["batch"] for r in data["rows"] if r["phase"] == "fit"] == [2, 8]
    assert caps == [pytest.approx(1.65e9)] * 2
    assert (phases["confirm"]["batch"], phases["confirm"]["status"]) == (6, "ok")
    assert (phases["above"]["batch"], phases["above"]["status"]) == (7, "oom")
    assert phases["confirm"]["memory_cap_bytes"] == pytest.approx(1.65e9)
    assert (phases["confirm"]["prefill_groups"], phases["fit"]["prefill_groups"]) == (3, 4)


def test_the_cap_sits_on_the_reserved_line_where_the_allocator_holds_more_than_it_hands_out(tmp_path, monkeypatch):
    """CUDA records both peaks: allocated 1 GB + 0.1 GB per sequence, reserved 0.3 GB above it (the
    caching allocator's slack, which the H200 showed on 2026-12-03). A cap limits reserved memory, so
    a cap on the allocated line (1.65 GB at 6) would stop batch 6; on the reserved line (1.95 GB) 6
    runs and 7 does not. Both predictions land in the fit."""
    import kvlab.measure as measure
    from kvlab.measure import Measurement

    module, out = bench(), tmp_path / "c.json"
    caps, cap_now = fake_memory_cap(monkeypatch, module)

    def fake(loaded, policy, *, ctx, batch, new_tokens, engine=None, prefill_rows=None, **kw):
        peak, reserved = 1e9 + 1e8 * batch, 1.3e9 + 1e8 * batch
        if cap_now[0] is not None and reserved > cap_now[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 100.00 MiB")
        record = {"peak_mem_bytes": peak, "peak_mem_reserved_bytes": reserved, "cache_bytes": 0.9e8 * batch,
                  "cache_bytes_allocated": 1e8 * batch, "cache_physical_tokens": 9, "prefill_s": 0.01 * batch,
                  "itl_median_ms": 1.0, "prefill_rows": prefill_rows if batch > prefill_rows else None}
        return Measurement(record=record, window=None)

    monkeypatch.setattr(measure, "measure_generation", fake)
    data = run_capped_fast(module, out)
    (fit,) = data["fits"]
    assert (fit["predicted_max_batch"], fit["predicted_max_batch_reserved"]) == (90, 87)
    assert fit["reserved_slope_bytes"] == pytest.approx(1e8)
    assert caps == [pytest.approx(1.95e9)] * 2
    phases = {r["phase"]: r for r in data["rows"]}
    assert (phases["confirm"]["batch"], phases["confirm"]["status"]) == (6, "ok")
    assert (phases["above"]["batch"], phases["above"]["status"]) == (7, "oom")
    assert phases["confirm"]["predicted_reserved_bytes"] == pytest.approx(1.9e9)


MEMORY = ["--memory-gb", "2"]
BAD = [
    ([*MEMORY, "--prefill-rows", "2"], "--prefill-rows 2 needs --engine fast"),
    ([*MEMORY, "--engine", "fast", "--prefill-rows", "0"], "--prefill-rows 0: give a number of sequences >= 1"),
    ([*MEMORY, "--engine", "fast", "--prefill-rows", "4", "--batches", "1", "8"], "fit batches must be >= 4"),
    ([*MEMORY, "--fast-compile", "layers"], "--fast-compile layers needs --engine fast"),
    ([*MEMORY, "--confirm-max-batch", "0"], "--confirm-max-batch 0"),
    ([*MEMORY, "--confirm", "snapkv10@4096"], "--confirm snapkv10@4096: not a measured config"),
    ([*MEMORY, "--batches", "0", "8"], "batches >= 1"),
    (["--engine", "fast", "--prefill-rows", "2"], "--device cpu: give --memory-gb"),
]


@pytest.mark.parametrize(("argv", "expected"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_capacity_arguments_are_one_line_before_any_model_loads(argv, expected, monkeypatch, capsys, tmp_path):
    import kvlab.models

    monkeypatch.setattr(kvlab.models, "load_model", lambda *a, **k: pytest.fail("a model loaded for bad input"))
    with pytest.raises(SystemExit) as exit_:
        bench().main(["--device", "cpu", "--model", "tiny-llama", "--out", str(tmp_path / "c.json"), *argv])
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()
