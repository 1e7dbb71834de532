"""benchmarks/engines.py on CPU with the tiny model and fake timings: the JSON carries the step's
byte floor and multiple, and the attention kernels' fraction of copy bandwidth (issue #28)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "engines.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("engines_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_carry_the_floor_and_the_kernel_fraction_of_copy(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device, gib=4: 2e9)  # 2 GB/s read + write
    # every timed callable "takes" 0.5 ms: the kernels and the copy of the same bytes alike
    monkeypatch.setattr(bench, "median_ms", lambda fn, device, iters=20, repeats=5, graph=True: (fn(), 0.5)[1])
    out = tmp_path / "engines.json"
    monkeypatch.setattr(sys, "argv", ["engines.py", "--model", "tiny-llama", "--device", "cpu", "--ctx", "32",
                                      "--new-tokens", "3", "--repeats", "1", "--methods", "full", "kvq-fp8",
                                      "--engines", "hf", "fast", "--compare-steps", "0", "--out", str(out)])
    assert bench.main() == 0
    result = json.loads(out.read_text())
    assert result["card"] == {"card": "cpu", "gpu_name": None, "gpu_uuid": None, "driver": None,
                              "power_limit_w": None, "sm_clock_max_mhz": None, "mem_clock_max_mhz": None}
    # one repeat a side: values, never an interval, and the output says so
    assert all(s["interval"] is None or s["interval"]["method"] == "none" for s in result["summary"])
    assert all(r["ratio"]["method"] == "none" and r["ratio"]["lo"] is None for r in result["ratios"])
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    assert {(r["method"], r["engine"]) for r in rows} == {("full", "hf"), ("full", "fast"), ("kvq-fp8", "hf"),
                                                          ("kvq-fp8", "fast")}
    for r in rows:
        assert r["floor_ms"] == pytest.approx((r["weight_bytes"] + r["cache_bytes"]) / 2e9 * 1e3)
        assert r["x_floor"] == pytest.approx(r["ms_step"] / r["floor_ms"])
    kernel = {r["method"]: r for r in result["kernel_bw"]}
    assert set(kernel) == {"full", "kvq-fp8"} and all(r["status"] == "ok" for r in kernel.values()), kernel
    assert kernel["kvq-fp8"]["kv_format"] == "fp8, keys - prompt-mean" and kernel["full"]["kv_format"] == "model dtype"
    for r in kernel.values():
        assert r["kv_bytes"] > 0 and r["kernel_ms"] == 0.5
        assert r["of_copy_same_bytes"] == pytest.approx(0.5)  # same time, the copy moves twice the bytes
        assert r["x_floor"] == pytest.approx(2.0)
        assert r["of_copy_bw"] == pytest.approx(r["kernel_GBps"] / 2.0)
