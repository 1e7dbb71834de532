"""benchmarks/fast_attention.py on CPU: the SDPA row over the head-major store matches its float32
reference and the JSON holds what the GPU run reads (the flash and cuDNN rows need CUDA)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fast_attention.py"


def test_the_benchmark_runs_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("fast_attention_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "fa.json"
    assert bench.main(["--device", "cpu", "--ctx", "40", "--new-tokens", "8", "--batch", "1", "3", "--reps", "1",
                       "--rounds", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["batch"], r["variant"]): r for r in result["rows"]}
    assert set(rows) == {(1, "sdpa"), (3, "sdpa")}
    assert all(r["max_err"] < 1e-5 and r["us_per_call"] > 0 and r["capacity"] == 48 for r in rows.values())
    assert isinstance(result["flash_takes_splits"], bool)
    assert result["card"]["card"] == "cpu" and result["card"]["gpu_uuid"] is None
