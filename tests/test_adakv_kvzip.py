"""AdaKV (head-adaptive budgets, padded + masked on transformers' cache) and KVzip (reconstruction
scores) on a tiny random Llama, against kvpress's rules restated in tests/kvpress_reference.py."""

import kvpress_reference as ref
import pytest
import torch
from tiny_models import load_tiny_d32

from kvlab.engine.generation import greedy_decode, prefill
from kvlab.policies import POLICIES, PolicyError, cache_stats, kept_positions, make_policy
from kvlab.policies.headwise import adakv_keep_mask, head_stats, ragged_layout
from kvlab.policies.kvzip import kvzip_chunk_scores, reconstruction_inputs
from kvlab.policies.snapkv import snapkv_scores

N = 96


@pytest.fixture(scope="module")
def lm():
    return load_tiny_d32()


def prompt(batch=1, n=N, seed=5):
    return torch.randint(3, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


def run(lm, policy, ids, n_new=5):
    with policy.attach(lm, warm=False):
        cache = policy.make_cache(lm.model)
        logits = prefill(lm.model, ids, cache, policy.prefill_chunk)
        kept = [k.clone() for k in kept_positions(cache)]
        stats = cache_stats(cache)
        tokens = greedy_decode(lm.model, cache, logits[:, -1].argmax(-1), n_new, ids.shape[1])
    return cache, kept, stats, tokens


def kept_mask(kept, n):
    """Padded kept positions (-1: padding) -> bool ``[B, H, n]``."""
    mask = torch.zeros(*kept.shape[:2], n + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(kept < 0, n, kept).long(), True)
    return mask[..., :n]


def test_adakv_rule_matches_kvpress_and_keeps_the_layer_budget():
    scores = torch.rand(2, 4, 50, generator=torch.Generator().manual_seed(0))
    scores[:, 0] *= 5  # head 0 earns most of the budget
    for keep, alpha in ((0.5, 0.2), (0.25, 0.2), (0.25, 0.0), (0.3, 1.0)):
        n_kept = int(50 * keep)
        mask = adakv_keep_mask(scores, n_kept, alpha)
        assert torch.equal(mask, ref.adakv_mask(scores, keep, alpha))
        assert (mask.sum(dim=(1, 2)) == 4 * n_kept).all()
        assert (mask.sum(-1) >= int(n_kept * alpha)).all()
    # kvpress's int(n (1 - r)) with r = 1 - keep loses a position where n x keep is whole but
    # 1 - (1 - keep) rounds below keep (0.1, 0.2, ...): kvlab keeps floor(n x keep)
    assert int(50 * (1 - (1 - 0.1))) == 4 and int(50 * 0.1) == 5
    rows, valid = ragged_layout(mask)
    assert rows.shape[-1] == mask.sum(-1).max() and torch.equal(valid.sum(-1), mask.sum(-1))
    assert ((rows.diff(dim=-1) > 0) | ~valid[..., 1:]).all()


def test_adakv_on_snapkv_keeps_kvpress_positions_per_head(lm):
    ids = prompt()
    policy = make_policy("adakv", keep=0.25, scorer_params={"window_size": 8})
    _, kept, stats, _ = run(lm, policy, ids)
    snap = make_policy("snapkv", keep=0.25, window_size=8)
    captured = {}
    with snap.attach(lm, warm=False):
        cache = snap.make_cache(lm.model)
        def keep_attn(keys, values, attn, n_kept, layer_idx, num_layers, inner=snap.select):
            captured[layer_idx] = attn  # the window attention each layer scores with
            return inner(keys, values, attn, n_kept, layer_idx, num_layers)

        object.__setattr__(snap, "select", keep_attn)
        prefill(lm.model, ids, cache)
    for i, k in enumerate(kept):
        scores = snapkv_scores(captured[i], 2, 5)
        assert torch.equal(kept_mask(k, N), adakv_keep_mask(scores, 24, 0.2)), f"layer {i}"
    assert stats["physical_tokens_per_layer"] == [k.shape[-1] for k in kept]


@pytest.mark.parametrize("scorer", ["knorm", "expected_attention", "kvzip"])
def test_padding_is_masked_out_exactly(lm, scorer):
    """Garbage in the padding slots changes nothing: they get zero attention weight."""
    ids = prompt(batch=2)
    policy = make_policy("adakv", keep=0.25, scorer=scorer, alpha_safeguard=0.0)
    with policy.attach(lm, warm=False):
        cache = policy.make_cache(lm.model)
        logits = prefill(lm.model, ids, cache)
        assert any((~layer.head_valid).any() for layer in cache.layers), "no padding to test"
        first = logits[:, -1].argmax(-1)
        ref_tokens = greedy_decode(lm.model, cache, first, 6, N)
        cache2 = policy.make_cache(lm.model)
        prefill(lm.model, ids, cache2)
        for layer in cache2.layers:
            pad = ~layer.head_valid[..., :, None].expand_as(layer.keys)
            layer.keys[pad] = 1e4
            layer.values[pad] = -1e4
        tokens = greedy_decode(lm.model, cache2, first, 6, N)
    assert torch.equal(tokens, ref_tokens)


def test_head_stats_report_logical_and_padded(lm):
    ids = prompt()
    cache, kept, stats, _ = run(lm, make_policy("adakv", keep=0.25, scorer="knorm", alpha_safeguard=0.0), ids)
    hs = head_stats(cache)
    assert hs["kept_tokens_per_layer"] == [24.0, 24.0]
    assert hs["padded_tokens_per_layer"] == [k.shape[-1] for k in kept] == stats["physical_tokens_per_layer"]
    # layers x K,V x heads x (24 kept + 4 decoded) rows x D x fp32
    assert hs["padded_bytes"] > hs["kept_bytes"] == 2 * 2 * 2 * (24 + 4) * 32 * 4
    full = make_policy("adakv", keep=0.25, scorer="knorm", alpha_safeguard=1.0)
    cache, kept, _, _ = run(lm, full, ids)  # every head keeps exactly its share: knorm's own selection
    _, knorm_kept, _, _ = run(lm, make_policy("knorm", keep=0.25), ids)
    assert all(torch.equal(a, b) for a, b in zip(kept, knorm_kept, strict=True))
    assert head_stats(cache)["padded_bytes"] == head_stats(cache)["kept_bytes"]


def test_adakv_refuses_what_it_cannot_do():
    with pytest.raises(PolicyError, match="scorer"):
        make_policy("adakv", scorer="streamingllm")
    with pytest.raises(PolicyError, match="alpha_safeguard"):
        make_policy("adakv", alpha_safeguard=1.5)
    with pytest.raises(PolicyError, match="window"):
        make_policy("adakv", scorer_params={"window": 8})
    with pytest.raises(PolicyError, match="keep"):
        make_policy("adakv", scorer_params={"keep": 0.1})
    with pytest.raises(PolicyError, match="only the kvzip"):
        make_policy("adakv", scope="model")
    with pytest.raises(PolicyError, match="fast engine"):  # scope 'layer' runs there (tests/test_adakv_fast.py)
        make_policy("adakv", scorer="kvzip", scope="model").storage()
    assert "adakv" in POLICIES and "kvzip" in POLICIES


def test_kvzip_scores_match_kvpress(lm):
    ids = prompt(batch=2, n=80)
    expected = ref.kvzip_scores(lm.model, ids, chunk_size=32)
    for keep in (0.5, 0.25):
        _, kept, _, _ = run(lm, make_policy("kvzip", keep=keep, chunk_size=32), ids, n_new=2)
        for i, k in enumerate(kept):
            assert torch.equal(k, ref.scorer_keep(expected[i], keep)), f"layer {i}"
    # kvpress's layerwise=True spreads each layer's budget over heads: adakv(kvzip) without safeguard
    _, kept, _, _ = run(lm, make_policy("adakv", keep=0.25, scorer="kvzip", alpha_safeguard=0.0,
                                        scorer_params={"chunk_size": 32}), ids, n_new=2)
    for i, k in enumerate(kept):
        assert torch.equal(kept_mask(k, 80), ref.adakv_mask(expected[i], 0.25, 0.0)), f"layer {i}"
    # kvpress's default (layerwise=False): one budget over every layer and head
    _, kept, _, _ = run(lm, make_policy("adakv", keep=0.25, scorer="kvzip", alpha_safeguard=0.0, scope="model",
                                        scorer_params={"chunk_size": 32}), ids, n_new=2)
    for b in range(2):
        flat = expected[:, b].reshape(-1)
        want = torch.ones_like(flat, dtype=torch.bool)
        want[(-flat).topk(int(flat.numel() * 0.75)).indices] = False
        got = torch.stack([kept_mask(k[b:b + 1], 80)[0] for k in kept]).reshape(-1)
        assert torch.equal(got, want)


def test_kvzip_reconstruction_inputs_and_chunked_prefill(lm):
    ids = torch.arange(10).unsqueeze(0)
    parts = reconstruction_inputs(ids, ([1, 2], [3], [9]), 4, 2)
    assert [(s, e) for s, e, _ in parts] == [(0, 4), (4, 8), (8, 10)]
    assert parts[1][2].tolist() == [[3, 2, 3, 9, 4, 5, 6, 7]]
    ids = prompt(n=80)
    _, one, _, tokens = run(lm, make_policy("kvzip", keep=0.25, chunk_size=32), ids)
    _, chunked, _, chunked_tokens = run(lm, make_policy("kvzip", keep=0.25, chunk_size=32, prefill_chunk=24), ids)
    assert all(torch.equal(a, b) for a, b in zip(one, chunked, strict=True))
    assert torch.equal(tokens, chunked_tokens)


def test_kvzip_chunk_scores_rows_are_blocked_exactly():
    g = torch.Generator().manual_seed(1)
    q, keys = torch.randn(1, 4, 700, 8, generator=g), torch.randn(1, 2, 900, 8, generator=g)
    import kvlab.policies.kvzip as kvzip

    budgets = dict(kvzip.SCORE_BLOCK_BYTES)
    try:
        kvzip.SCORE_BLOCK_BYTES["cpu"] = 2**30
        whole = kvzip_chunk_scores(q, keys, 4, 150, 4)
        assert kvzip.score_rows(1, 4, 146 + 700, "cpu") >= 700  # one block
        for rows in (64, 7, 1):
            kvzip.SCORE_BLOCK_BYTES["cpu"] = 4 * 4 * (146 + 700) * rows
            assert kvzip.score_rows(1, 4, 146 + 700, "cpu") == rows
            blocked = kvzip_chunk_scores(q, keys, 4, 150, 4)
            if rows > 1:
                assert torch.equal(blocked, whole)
            else:  # a one-row block is a matrix-vector product, which MKL may sum in another order
                # (1.6e-7 apart on an AMD EPYC with AVX2; equal on the CPUs CI ran on before)
                torch.testing.assert_close(blocked, whole, rtol=0, atol=1e-6)
    finally:
        kvzip.SCORE_BLOCK_BYTES.update(budgets)


def test_kvzip_reconstruction_runs_inside_the_prefill_call(lm):
    """The reconstruction forwards happen within the prefill call (so TTFT and prefill energy hold
    them): one decoder forward for the prompt plus one per context chunk, then none while decoding."""
    calls = []
    hook = lm.model.model.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape[1]),
                                                    with_kwargs=True)
    try:
        policy = make_policy("kvzip", keep=0.25, chunk_size=32)
        with policy.attach(lm, warm=False):
            cache = policy.make_cache(lm.model)
            logits = prefill(lm.model, prompt(n=80), cache)
            assert calls == [80, 32, 8 + 32, 8 + 16]  # no tokenizer: the previous 8 tokens + the chunk
            greedy_decode(lm.model, cache, logits[:, -1].argmax(-1), 3, 80)
    finally:
        hook.remove()
    assert calls[4:] == [1, 1]


def test_kvzip_repeat_forwards_may_use_a_masked_sdpa_backend_under_a_flash_pin(lm):
    """A sweep with sdpa_backend: flash pins SDPA to flash for the whole prefill; KVzip's repeat
    forwards attended with an explicit mask, which CUDA's flash kernel cannot take ("No available
    kernel" on the H200, 2026-12-03f; CPU's flash takes masks, so the failure does not show here).
    They now attend lower-right with no mask (flash takes that: tests/test_kvzip_cost.py) and still
    re-open the other backends for inputs flash cannot take; the prompt's forward stays pinned."""
    from kvlab.measure import sdpa_context

    seen = []
    hook = lm.model.model.register_forward_pre_hook(
        lambda m, a, k: seen.append((k["input_ids"].shape[1], torch.backends.cuda.math_sdp_enabled(),
                                     torch.backends.cuda.mem_efficient_sdp_enabled())), with_kwargs=True)
    policy = make_policy("kvzip", keep=0.25, chunk_size=32)
    try:
        with policy.attach(lm, warm=False), sdpa_context("flash"):
            cache = policy.make_cache(lm.model)
            prefill(lm.model, prompt(n=80), cache)
    finally:
        hook.remove()
    assert seen[0] == (80, False, False)  # the prompt: flash only, as the run asked
    assert seen[1:] and all(math and efficient for _, math, efficient in seen[1:])  # the repeats
    assert cache_stats(cache)["physical_tokens"] == 20
