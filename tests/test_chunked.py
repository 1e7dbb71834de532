"""Chunked prefill (``prefill_chunk``) for every registry policy on a tiny random Llama: a chunk of
at least the prompt is the one-shot prefill exactly; smaller chunks keep the one-shot budget,
never hold more than budget + chunk rows, and decode on both engines."""


import pytest
import torch
from tiny_models import load_tiny_d32, registry_kwargs

from kvlab.engine.engines import generate_text
from kvlab.engine.fast import FastEngine
from kvlab.engine.generation import chunk_bounds, greedy_decode, prefill
from kvlab.engine.generation import prefill_once as one_shot
from kvlab.policies import POLICIES, EvictionPolicy, PolicyError, QuantizedPolicy, cache_stats, kept_positions
from kvlab.policies import make_policy as _make

N = 100
NEW = 6


@pytest.fixture(scope="module")
def lm():
    return load_tiny_d32()


def make(name, **extra):
    return _make(name, **registry_kwargs(name), **extra)


EVICTION = [n for n, c in POLICIES.items() if issubclass(c, EvictionPolicy)]
CHUNKABLE = list(POLICIES)


def prompt(batch=1, n=N, seed=1):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def run(lm, policy, ids=None, n_new=NEW):
    """Prefill (chunked as the policy says) and decode; returns the cache, tokens, stats after prefill."""
    ids = prompt() if ids is None else ids
    with policy.attach(lm, warm=False):
        cache = policy.make_cache(lm.model)
        logits = prefill(lm.model, ids, cache, policy.prefill_chunk)
        stats = cache_stats(cache)
        kept = [None if k is None else k.clone() for k in kept_positions(cache)]
        tokens = greedy_decode(lm.model, cache, logits[:, -1].argmax(-1), n_new, ids.shape[1])
    return cache, tokens, stats, kept


def test_chunk_bounds_cover_the_prompt():
    assert chunk_bounds(10, None) == [(0, 10)] == chunk_bounds(10, 10) == chunk_bounds(10, 64)
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]


@pytest.mark.parametrize("method", CHUNKABLE)
def test_a_chunk_of_the_whole_prompt_is_the_one_shot_prefill(lm, method):
    """Selection, stored bytes and tokens are exactly today's when chunk >= prompt length."""
    _, ref_tokens, ref_stats, ref_kept = run(lm, make(method))
    for chunk in (N,):
        _, tokens, stats, kept = run(lm, make(method, prefill_chunk=chunk))
        assert torch.equal(tokens, ref_tokens)
        assert stats == ref_stats
        for a, b in zip(kept, ref_kept, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("method", EVICTION)
@pytest.mark.parametrize("chunk", [32, 7])
def test_small_chunks_keep_the_one_shot_budget_of_prompt_positions(lm, method, chunk):
    policy = make(method, prefill_chunk=chunk)
    cache, tokens, stats, kept = run(lm, policy)
    assert tokens.shape == (1, NEW)
    assert stats["logical_tokens"] == N
    assert stats["physical_tokens_per_layer"] == policy.kept_tokens(N, 2)
    for layer_kept, budget in zip(kept, policy.kept_tokens(N, 2), strict=True):
        assert layer_kept.shape == (1, 2, budget)
        assert (layer_kept.diff(dim=-1) > 0).all() and layer_kept.min() >= 0 and layer_kept.max() < N
    assert cache.get_seq_length() == N + NEW - 1


def test_chunk_invariant_selections(lm):
    """StreamingLLM's positions do not depend on scores: any chunking keeps what one shot keeps. Knorm
    rescoring keeps the lowest norms among the keys it saw; in the first layer those keys do not
    depend on what earlier chunks kept, so its selection is one shot's too (deeper layers' keys do:
    later chunks attended to the kept rows only)."""
    for method, layers in (("streamingllm", 2), ("knorm", 1)):
        _, _, _, ref_kept = run(lm, make(method))
        for chunk in (7, 16, 33):
            _, _, _, kept = run(lm, make(method, prefill_chunk=chunk))
            assert all(torch.equal(a, b) for a, b in zip(kept[:layers], ref_kept[:layers], strict=True))


def test_snapkv_chunks_change_the_selection_by_scoring_with_the_latest_window(lm):
    _, _, _, ref_kept = run(lm, make("snapkv"))
    _, _, _, kept = run(lm, make("snapkv", prefill_chunk=20))
    assert not torch.equal(kept[0], ref_kept[0])
    assert (kept[0][..., -8:] == torch.arange(N - 8, N)).all()  # the last chunk's window is always kept


@pytest.mark.parametrize("method", ["snapkv", "knorm"])
def test_a_layer_never_holds_more_than_budget_plus_one_chunk(lm, method):
    chunk = 16
    policy = make(method, prefill_chunk=chunk)
    seen = []
    with policy.attach(lm, warm=False):
        cache = policy.make_cache(lm.model)
        for layer in cache.layers:
            def counted(k, v, inner=layer._prefill):
                out = inner(k, v)
                seen.append(out[0].shape[-2])
                return out
            layer._prefill = counted
        prefill(lm.model, prompt(), cache, chunk)
    budget = max(policy.kept_tokens(N, 2))
    assert len(seen) == 2 * len(chunk_bounds(N, chunk))
    assert max(seen) <= budget + chunk


def test_full_cache_in_chunks_is_the_same_cache(lm):
    full = make("full")
    ids = prompt()
    ref_cache = full.make_cache(lm.model)
    ref = one_shot(lm.model, ids, ref_cache, logits_to_keep=0)
    cache = full.make_cache(lm.model)
    got = prefill(lm.model, ids, cache, 16, logits_to_keep=0)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(cache.layers, ref_cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
    last = prefill(lm.model, ids, full.make_cache(lm.model), 16, logits_to_keep=20)
    torch.testing.assert_close(last, ref[:, -20:], rtol=1e-4, atol=1e-4)  # logits spanning two chunks


@pytest.mark.parametrize("method", [n for n, c in POLICIES.items() if issubclass(c, QuantizedPolicy)])
def test_quantized_caches_quantize_each_chunk(lm, method):
    """Every chunk lands quantized (quanto/HQQ: a chunk that fills the residual flushes it)."""
    extra = {"residual_length": 20} if method in ("quanto", "hqq") else {}
    policy = make(method, prefill_chunk=20, **extra)
    cache, tokens, stats, _ = run(lm, policy)
    _, _, ref_stats, _ = run(lm, make(method, **extra))
    assert stats["logical_tokens"] == N and stats["physical_tokens"] == N
    assert stats["bytes"] == ref_stats["bytes"]  # the same codes' size: everything is stored quantized
    assert tokens.shape == (1, NEW)


@pytest.mark.parametrize("backend", [{"backend": "quanto", "q_group_size": 32}, {"backend": "kvq", "nbits": 4,
                                                                                   "q_group_size": 32}])
def test_evict_then_quantize_selects_on_exact_rows_and_stores_quantized(lm, backend):
    plain = run(lm, make("snapkv", prefill_chunk=16))
    cache, _, stats, kept = run(lm, make("snapkv", prefill_chunk=16, quant=backend))
    assert all(torch.equal(a, b) for a, b in zip(kept, plain[3], strict=True))
    assert stats["bytes"] < plain[2]["bytes"]
    assert all(layer._staged is None for layer in cache.layers)


def test_a_question_after_a_chunked_context_is_appended(lm):
    policy = make("snapkv", prefill_chunk=16)
    with policy.attach(lm, warm=False):
        cache = policy.make_cache(lm.model)
        prefill(lm.model, prompt(), cache, 16)
        kept = cache_stats(cache)["physical_tokens"]
        prefill(lm.model, prompt(n=40, seed=4), cache, 16)  # not fresh: appended uncompressed
    stats = cache_stats(cache)
    assert (stats["logical_tokens"], stats["physical_tokens"]) == (N + 40, kept + 40)


@pytest.mark.parametrize("method", ["full", "snapkv", "pyramidkv", "tova"])
def test_fast_engine_decodes_a_chunked_prefill_like_hf(lm, method):
    policy = make(method, prefill_chunk=16)
    ids = prompt(batch=2)
    with policy.attach(lm, warm=False):
        ref = generate_text(lm, ids, policy, 10).tokens
        fast = generate_text(lm, ids, policy, 10, engine=FastEngine(lm)).tokens
    assert torch.equal(ref, fast)


@pytest.mark.parametrize("chunk", [0, -4, 2.5, "512", True])
def test_bad_prefill_chunk_is_refused_before_any_model(chunk):
    with pytest.raises(PolicyError, match="prefill_chunk"):
        make("snapkv", prefill_chunk=chunk)


def test_records_and_labels_name_the_chunk_only_when_chunked():
    assert "prefill_chunk" not in make("snapkv").params()
    assert make("snapkv", prefill_chunk=512).params()["prefill_chunk"] == 512
    assert make("quanto", prefill_chunk=512).params()["prefill_chunk"] == 512
    assert make("snapkv", prefill_chunk=512).label == "snapkv 30% chunk 512"
    assert make("full", prefill_chunk=64).label == "full chunk 64"


# --- the sweep axis ----------------------------------------------------------------------------


def test_prefill_chunk_is_a_sweep_axis_recorded_per_run(tmp_path):
    from kvlab.records import load_records
    from kvlab.sweep.checks import check_params
    from kvlab.sweep.driver import run_sweep
    from kvlab.sweep.params import parse_params
    from kvlab.sweep.plan import expand, planned_runs

    params = parse_params({"models": "tiny-llama", "weights": "synthetic", "device": "cpu", "threads": 1,
                           "methods": ["full", {"method": "snapkv", "keep": 0.25, "window_size": 4}],
                           "prefill_chunk": [None, 16], "ctx": [48], "new_tokens": 3, "warmup_runs": 0})
    runs = expand(params, check_params(params))
    assert sorted((r.method, r.policy_kwargs.get("prefill_chunk") or 0) for r in runs) == [
        ("full", 0), ("full", 16), ("snapkv", 0), ("snapkv", 16)]
    one_shot = parse_params({**params.model_dump(), "prefill_chunk": None})
    assert {r.run_id for r in planned_runs(one_shot)} < {r.run_id for r in runs}  # one-shot ids unchanged
    assert run_sweep(params, tmp_path, progress=False, log=lambda m: None).complete
    df = load_records(tmp_path)
    chunked = df[df.prefill_chunk.notna()]
    assert set(chunked.prefill_chunk) == {16} and len(chunked) == 2 and df.prefill_chunk.isna().sum() == 2
    assert set(df.label) == {"full", "full chunk 16", "snapkv 25%", "snapkv 25% chunk 16"}
    snap = df[df.method == "snapkv"]
    assert set(snap.cache_physical_tokens) == {12}  # the one-shot budget, chunked or not


def test_prefill_chunk_axis_is_validated():
    from kvlab.sweep.params import ParamsError, parse_params

    base = {"models": "tiny-llama", "weights": "synthetic", "methods": ["full"], "ctx": [32]}
    with pytest.raises(ParamsError, match="prefill_chunk"):
        parse_params({**base, "prefill_chunk": [0]})
    assert parse_params({**base, "prefill_chunk": 512}).prefill_chunk == [512]


@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_lower_right_chunk_attention_equals_the_masked_stock_path(lm, method, monkeypatch):
    """The CPU reference for the chunk attention CUDA runs with flash: the same logits, kept positions
    and cache as transformers' masked SDPA (K/V repeated per head), and the model keeps its attention."""
    import contextlib

    import kvlab.engine.generation as generation
    import kvlab.storage.attention as attention

    calls = []
    real = attention.chunk_attention
    monkeypatch.setattr(attention, "chunk_attention", lambda *a: calls.append(1) or real(*a))
    policy = make(method, prefill_chunk=24)
    _, fast_tokens, fast_stats, fast_kept = run(lm, policy)
    assert calls and lm.model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(generation, "lower_right_chunks", lambda model: contextlib.nullcontext())
    calls.clear()
    _, tokens, stats, kept = run(lm, policy)
    assert not calls
    assert torch.equal(tokens, fast_tokens) and stats == fast_stats
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(kept, fast_kept, strict=True))


def test_chunk_attention_with_repeated_heads_is_the_same_attention(monkeypatch):
    """The CUDA fallback (flash cannot take the grouped heads): repeated K/V, the same output."""
    import kvlab.storage.attention as attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 16, generator=g) for h, n in ((8, 5), (2, 12), (2, 12)))
    grouped, _ = attention.chunk_attention(q, k, v, 0.25)
    monkeypatch.setattr(attention, "_repeat_heads", lambda *a: True)
    repeated, _ = attention.chunk_attention(q, k, v, 0.25)
    torch.testing.assert_close(repeated, grouped)
    scores = (q @ k.repeat_interleave(4, 1).transpose(-1, -2) * 0.25).masked_fill(
        torch.ones(5, 12, dtype=torch.bool).tril(7).logical_not(), float("-inf"))
    torch.testing.assert_close(grouped, (scores.softmax(-1) @ v.repeat_interleave(4, 1)).transpose(1, 2))


def test_the_quality_summary_pairs_chunked_runs_with_the_one_shot_full_cache():
    from kvlab.quality import summarize

    def rec(label, method, nll, depth):
        return {"kind": "quality", "status": "ok", "task": "niah_single", "length": 2048, "depth": depth,
                "sample": 0, "query_aware": False, "method": method, "label": label, "no_signal": False,
                "score": 1.0, "gold_nll": nll, "first_token_acc": 1.0, "kl": 0.0, "top1_agree": 1.0}

    records = [rec(label, label.split()[0], nll + d, d) for d in (0.1, 0.9)
               for label, nll in (("full", 1.0), ("full chunk 512", 1.0), ("tova 25% chunk 512", 1.5))]
    summary = summarize(records, metrics=["gold_nll"], n_boot=50).set_index("label")
    assert summary.loc["full chunk 512", "gold_nll_diff"] == pytest.approx(0.0)
    assert summary.loc["tova 25% chunk 512", "gold_nll_diff"] == pytest.approx(0.5)
