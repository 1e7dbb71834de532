"""benchmarks/serve_paged_decode.py at tiny shapes in the Triton interpreter: every row timed side by side,
the kernel's error against the reference recorded (the GPU run's times are the script's job)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_paged_decode.py"


def test_the_quick_run_times_every_row_and_records_the_kernels_error(tmp_path):
    spec = importlib.util.spec_from_file_location("serve_paged_decode_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    bench.main(["--device", "cpu", "--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    rows = {r["row"]: r for r in data["rows"]}
    assert set(rows) == {"dense", "int4-g32", "int4-g32:reference", "kivi4", "kivi4:reference"}
    assert data["card"]["card"] == "cpu"
    assert all(r["n"] == 3 and len(r["ms_all"]) == 3 for r in rows.values())
    assert rows["int4-g32"]["rel_err"] < 5e-3 and rows["kivi4"]["rel_err"] < 1e-2  # float16 products
    assert rows["int4-g32"]["vs_reference"]["lo"] is not None  # 3 rounds a side: an interval
