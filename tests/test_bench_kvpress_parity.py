"""benchmarks/kvpress_parity.py keys the worker's cached kvpress masks by kvpress's version and the
worker's own code, so a changed worker (or another kvpress) never compares against stale masks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kvpress_parity.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("kvpress_parity_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_masks_folder_is_keyed_by_version_and_worker_code():
    bench = load_bench()
    folder = bench.masks_folder("0.5.5")
    assert folder.startswith("kvpress-0.5.5-") and len(folder.rsplit("-", 1)[1]) == 12
    assert bench.masks_folder("0.5.4") != folder
    assert bench.masks_folder("0.5.5") == folder  # stable: a rerun reuses what this worker made
