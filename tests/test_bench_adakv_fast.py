"""benchmarks/adakv_fast.py on CPU with the tiny model: the rows its GPU run reads exist and say what the
CPU can check (the ragged store's bytes against the full store's, the SDPA path against a per-segment
reference, fast against hf); the flash rows say they need CUDA."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "adakv_fast.py"


def test_the_benchmark_runs_on_cpu_and_reports_each_part(tmp_path):
    spec = importlib.util.spec_from_file_location("adakv_fast_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "adakv.json"
    assert bench.main(["--model", "tiny-llama", "--device", "cpu", "--ctx", "64", "--batch", "2",
                       "--new-tokens", "6", "--hf-steps", "3", "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())
    kernels = {r["kernel"]: r for r in rows if r["part"] == "kernel"}
    assert "needs a CUDA device" in kernels["ragged flash"]["error"]
    assert kernels["ragged sdpa"]["max_abs_err"] < 1e-5
    assert kernels["ragged sdpa"]["lengths_min"] < kernels["ragged sdpa"]["lengths_max"]  # uneven heads
    engine = {r["label"]: r for r in rows if r["part"] == "engine" and r["attention"] == "sdpa"}
    full, ada = engine["full"], engine["adakv(snapkv) 25%"]
    # tiny-llama: 2 layers x K,V x batch 2 x 2 KV heads x (slots) x head_dim 16 x float32
    assert full["store_bytes"] == 2 * 2 * 2 * 2 * (64 + 6) * 16 * 4
    assert ada["store_bytes"] == 2 * 2 * 2 * 2 * (16 + 6) * 16 * 4
    assert ada["kv_format"] == "model dtype, ragged heads"
    hf = next(r for r in rows if r["part"] == "fast vs hf")
    assert hf["top1_agree"] == 1.0
