"""benchmarks/minimal_step.py on CPU: the minimal step computes what transformers computes from the
same weights, and the script runs end to end (no graph, no energy)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from kvlab.engine.generation import forward, prefill
from kvlab.engine.llama import LlamaFamilyStep
from kvlab.policies import make_policy

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "minimal_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("minimal_step_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_minimal_step_gives_transformers_logits(bench, tiny):
    model, ctx = tiny.model, 24
    ids = torch.randint(3, 500, (2, ctx + 1), generator=torch.Generator().manual_seed(0))
    cache = make_policy("full").make_cache(model)
    with torch.no_grad():
        prefill(model, ids[:, :ctx], cache)
        m = bench.MinimalStep(LlamaFamilyStep(model), 2, ctx + 1, "cpu", torch.float32)
        for i, layer in enumerate(cache.layers):
            m.kv_keys[i][:, :, :ctx].copy_(layer.keys)
            m.kv_values[i][:, :, :ctx].copy_(layer.values)
        m.token.copy_(ids[:, ctx:])
        m.pos.fill_(ctx)
        logits = m.step()
        ref = forward(model, ids[:, ctx:], cache, torch.full((2, 1), ctx)).logits[:, -1]
    assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4), (logits - ref).abs().max()
    assert torch.equal(m.token[:, 0], ref.argmax(-1)) and int(m.pos) == ctx + 1


def test_the_script_runs_on_cpu(bench, monkeypatch, tmp_path):
    out = tmp_path / "m.json"
    monkeypatch.setattr(sys, "argv", ["minimal_step.py", "--model", "tiny-llama", "--device", "cpu", "--ctx", "32",
                                      "--batch", "2", "--new-tokens", "4", "--steps", "5", "--seconds", "0.01",
                                      "--profile-steps", "2", "--rows", "5", "--out", str(out)])
    assert bench.main() == 0
    row = json.loads(out.read_text())["batches"][0]
    assert row["batch"] == 2 and row["kvlab_ms_step"] > 0 and row["minimal_ms_step"] > 0
    assert row["kvlab_j_per_token"] is None  # no counter on CPU
    assert set(row["kernel_totals"]) == {"kvlab", "minimal"} and row["kernels"]
    assert "aten::" in row["kvlab_eager_ops"] and "aten::" in row["minimal_eager_ops"]
