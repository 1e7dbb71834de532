"""What KVzip's prefill costs (issue #27; it never finished a 16k warm-up on the GPU): one forward of
the prompt plus one per context chunk, per row group of the fast engine and never more; the repeat
tokens attend lower-right causal with no attention mask and the K/V heads as they are (the form flash
takes on CUDA), and the scoring's float32 transient stays within its budget. Counts and shapes,
not wall-clock timings (benchmarks/kvzip_cost.py times the phases)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from tiny_models import load_tiny_d32
from torch.nn.attention.bias import CausalBias, CausalVariant

import kvlab.policies.kvzip as kvzip
from kvlab.engine.fast import FastEngine
from kvlab.engine.generation import prefill
from kvlab.policies import make_policy

N, CHUNK = 80, 32
REPEATS = [32, 8 + 32, 8 + 16]  # no tokenizer: chunk 0 bare, then the previous 8 tokens + the chunk
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kvzip_cost.py"


@pytest.fixture(scope="module")
def lm():
    return load_tiny_d32()


def prompt(batch, n=N, seed=3):
    return torch.randint(3, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


def recorded_sdpa(monkeypatch) -> list:
    """Every SDPA call kvlab or transformers makes (not those torch makes inside one): (query, key,
    attn_mask, is_causal, enable_gqa)."""
    fn = torch.nn.functional.scaled_dot_product_attention
    calls, depth = [], [0]

    def recording(query, key, value, attn_mask=None, *args, **kwargs):
        if depth[0] == 0:
            calls.append((query.shape, key.shape, attn_mask, kwargs.get("is_causal", False),
                          kwargs.get("enable_gqa", False)))
        depth[0] += 1
        try:
            if isinstance(attn_mask, CausalBias):  # its __torch_function__ only knows torch's own function
                return CausalBias._dispatch(query, key, value, attn_mask, *args, **kwargs)
            return fn(query, key, value, attn_mask, *args, **kwargs)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def test_repeat_tokens_attend_lower_right_without_a_mask(lm, monkeypatch):
    """Before, each repeat forward got transformers' ``[B, 1, q, n + q]`` mask, so SDPA repeated every
    K/V head per query head and could not run flash on CUDA (efficient or math, or "No available
    kernel" under a flash pin)."""
    calls = recorded_sdpa(monkeypatch)
    policy = make_policy("kvzip", keep=0.25, chunk_size=CHUNK)
    with policy.attach(lm, warm=False):
        prefill(lm.model, prompt(2), policy.make_cache(lm.model))
    layers, kv_heads = lm.spec.num_layers, lm.spec.num_kv_heads
    assert len(calls) == layers * (1 + len(REPEATS))
    assert all(mask is None or isinstance(mask, CausalBias) for _, _, mask, _, _ in calls)  # no mask tensor
    prompt_calls, repeat_calls = calls[:layers], calls[layers:]
    assert all(mask is None and causal and q[-2] == k[-2] == N for q, k, mask, causal, _ in prompt_calls)
    for i, (q, k, mask, causal, gqa) in enumerate(repeat_calls):
        q_len = REPEATS[i // layers]
        assert (q[-2], k[-2]) == (q_len, N + q_len)  # the whole cached prompt, then the repeat tokens
        assert mask.variant == CausalVariant.LOWER_RIGHT and not causal
        assert (mask.seq_len_q, mask.seq_len_kv) == (q_len, N + q_len)
        assert k[1] == kv_heads < q[1] and gqa  # K/V heads not repeated per query head


def test_one_forward_per_chunk_per_row_group(lm, monkeypatch):
    """With ``prefill_rows`` each group runs its own prompt forward and reconstruction, over its own
    rows only: the work is the whole batch's, split, never multiplied by the number of groups."""
    scored = []
    score = kvzip.kvzip_chunk_scores
    monkeypatch.setattr(kvzip, "kvzip_chunk_scores",
                        lambda q, *a: scored.append(q.shape[:3]) or score(q, *a))
    policy = make_policy("kvzip", keep=0.25, chunk_size=CHUNK)
    ids = prompt(4)
    per_rows = {}
    with policy.attach(lm, warm=False):
        for rows in (None, 2, 1):
            forwards = per_rows[rows] = []
            hook = lm.model.model.register_forward_pre_hook(
                lambda m, a, k, seen=forwards: seen.append(tuple(k["input_ids"].shape)), with_kwargs=True)
            try:
                decoder = FastEngine(lm).decoder(policy, 4, N, 2)
                decoder.prefill(ids, None, rows)
            finally:
                hook.remove()
    for rows, groups in ((None, 1), (2, 2), (1, 4)):
        b = 4 // groups
        assert per_rows[rows] == [(b, t) for _ in range(groups) for t in (N, *REPEATS)], rows
        assert sum(b * t for b, t in per_rows[rows]) == 4 * (N + sum(REPEATS))  # tokens: the batch's
    layers, heads = lm.spec.num_layers, lm.spec.num_attention_heads
    assert len(scored) == layers * len(REPEATS) * (1 + 2 + 4)  # once per layer and chunk, per group
    assert scored[: layers * len(REPEATS)] == [(4, heads, q) for q in REPEATS for _ in range(layers)]


def test_the_scoring_transient_stays_within_its_budget():
    """A block's float32 logits ``[B, Hq, rows, cols]`` at Llama-3.1-8B's shape, 16k in chunks of 2048
    (cols = 4 sinks + the chunk + 2056 repeat keys): within the device's ``SCORE_BLOCK_BYTES`` at batch
    16 as at batch 2 (a fixed 512 rows held 4.3 GB at batch 16)."""
    cols = 4 + 2048 + 2056
    for device in ("cuda", "cpu"):
        for batch in (1, 2, 16):
            rows = kvzip.score_rows(batch, 32, cols, device)
            assert rows == 1 or 4 * batch * 32 * rows * cols <= kvzip.SCORE_BLOCK_BYTES[device]  # one row at least
    assert kvzip.score_rows(2, 32, cols, "cuda") >= 500  # few launches where memory allows
    assert kvzip.score_rows(2, 32, cols, "cpu") < kvzip.score_rows(2, 32, cols, "cuda")
    assert kvzip.score_rows(1, 1, 10**12) == 1


def test_the_benchmark_counts_the_phases(tmp_path):
    spec = importlib.util.spec_from_file_location("kvzip_cost_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "kvzip.json"
    bench.main(["--model", "tiny-llama", "--weights", "synthetic", "--ctx", "96", "--batch", "2",
                "--rows", "0", "1", "--chunk-size", "32", "--json-out", str(out)])
    rows = {(r["method"], r["rows"]): r for r in json.loads(out.read_text())}
    full, kv, kv1 = rows[("full", 0)], rows[("kvzip", 0)], rows[("kvzip", 1)]
    assert full["forwards"] == [[2, 96]] and full["reconstruction_s"] == 0
    assert kv["forwards"] == [[2, 96], [2, 32], [2, 40], [2, 40]]
    assert kv1["forwards"] == [[1, 96], [1, 32], [1, 40], [1, 40]] * 2
    assert kv["forward_tokens"] == kv1["forward_tokens"] == 2 * (96 + 32 + 40 + 40)
    assert kv["masked_calls"] == kv["repeated_kv_calls"] == 0 and kv["lower_right_calls"] == 2 * 3
    assert kv["reconstruction_s"] > kv["scoring_s"] > 0
