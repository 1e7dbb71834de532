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
from kvlab.records import read_json

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
                                      "--profile-steps", "2", "--rows", "5", "--repeats", "2", "--kv-fill", "random",
                                      "--variants", "flash_splits=4", "attention=cudnn", "--out", str(out)])
    assert bench.main() == 0
    row = json.loads(out.read_text())["batches"][0]
    assert row["kv_fill"] == "random" and len(row["kvlab_windows"]) == 2 and row["energy_per_step"] is None
    assert row["greedy_equals_argmax"] is True
    assert set(row["work"]) == {"kvlab", "minimal"} and row["kernel_diff"]
    splits, cudnn = row["variants"]
    assert splits["variant"] == "flash_splits=4" and (splits.get("ms_step", 0) > 0 or "num_splits" in splits["error"])
    if "error" not in splits:  # built beside kvlab's step: its windows alternate with kvlab's, round by round
        assert splits["alternated"] is True and len(splits["windows"]) == 2
        assert splits["j_per_token_vs_kvlab"]["method"] == "none"  # no counter on CPU, and 2 rounds: no interval
    assert "needs a CUDA device" in cudnn["error"]  # refused on CPU, in its row
    assert bench.engine_options("attention=cudnn,flash_splits=8") == {"attention": "cudnn", "flash_splits": 8}
    assert row["batch"] == 2 and row["kvlab_ms_step"] > 0 and row["minimal_ms_step"] > 0
    assert row["kvlab_j_per_token"] is None  # no counter on CPU
    assert set(row["kernel_totals"]) == {"kvlab", "minimal"} and row["kernels"]
    assert "aten::" in row["kvlab_eager_ops"] and "aten::" in row["minimal_eager_ops"]


def test_every_kernel_of_the_h200_tables_is_named_for_its_work(bench):
    """The kernel names of both steps on the H200 (reports/h200-2026-12-03f) each land in the work
    the step's attribution gives them."""
    report = Path(__file__).resolve().parents[1] / "reports" / "h200-2026-12-03f" / "minimal_step.json"
    names = {r["kernel"] for b in read_json(report)["batches"] for r in b["kernels"]}  # stored as .xz
    work = {n: bench.work_of(n) for n in names}
    assert "other" not in work.values(), [n for n, w in work.items() if w == "other"]
    by = {w: {n for n in names if work[n] == w} for w in set(work.values())}
    assert all("combine" in n or "lean_reduction" in n for n in by["attention: combine splits"])
    assert all("splitkv_kernel" in n or "sdpa" in n for n in by["attention: read K/V"])
    assert all("index_copy" in n for n in by["cache writes"]) and len(by["copies"]) == 1
    assert all("ArgMax" in n for n in by["greedy token"])
    assert bench.work_of("triton_per_fused_argmax_copy_gather_index_copy_1") == "greedy token"


def test_the_minimal_step_reads_kvlab_s_store_and_every_variant_the_same_kv(bench, tiny):
    _, decoder, runner = bench.kvlab_runner(tiny, 2, 8, 4, fill="random")
    keys = decoder.store.keys
    assert keys[0].abs().sum() > 0 and not torch.equal(keys[0], decoder.store.values[0]) and runner.room == 3
    kv = list(zip(keys, decoder.store.values, strict=True))
    m, _ = bench.minimal_runner(LlamaFamilyStep(tiny.model), 2, 8, 4, "cpu", torch.float32, kv)
    assert all(a is b for a, b in zip(m.kv_keys, keys, strict=True))
    _, other, _ = bench.kvlab_runner(tiny, 2, 8, 4, fill="random", attention="sdpa")
    assert all(torch.equal(a, b) for a, b in zip(other.store.keys, keys, strict=True))
    with pytest.raises(ValueError, match="K/V buffers are"):
        bench.MinimalStep(LlamaFamilyStep(tiny.model), 2, 9, "cpu", torch.float32, kv)
