"""benchmarks/kivi_quest.py's timing on CPU: every read runs once per copy (the eager pass that also
checks it runs) and no time is reported off CUDA (the GPU run is the script's job; the alternation
itself is kvlab.repeats', tested in tests/test_repeats.py)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kivi_quest.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kivi_quest_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_read_runs_each_copy_and_no_time_off_cuda(bench):
    calls = []
    fns = {"a": lambda i: calls.append(("a", i)), ("quest", "select_ms"): lambda i: calls.append(("q", i))}
    ms = bench.timed_alternating(fns, copies=3, device=torch.device("cpu"), reps=5)
    assert calls == [("a", 0), ("a", 1), ("a", 2), ("q", 0), ("q", 1), ("q", 2)]
    assert set(ms) == set(fns) and all(math.isnan(v) for v in ms.values())
