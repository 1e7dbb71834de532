"""Eviction mechanics on a tiny random Llama: positions, masks, selection, memory, batches."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvlab.budget import cache_bytes
from kvlab.engine.engines import generate_text
from kvlab.engine.generation import cache_kwarg, greedy_decode, prefill
from kvlab.models import load_model
from kvlab.policies import EvictionError, cache_stats, kept_positions, make_policy
from kvlab.storage.attention import window_attention

EVICTION = ["streamingllm", "snapkv", "pyramidkv", "tova", "knorm", "random"]
SMALL = {"snapkv": {"window_size": 8}, "pyramidkv": {"window_size": 8}}  # windows that fit 100 tokens
N = 100  # prompt tokens
NEW = 12


def policy(method, keep, **extra):
    return make_policy(method, keep=keep, **SMALL.get(method, {}), **extra)


@pytest.fixture(scope="module")
def lm():
    """This module's own tiny model, so switching its attention function touches no other test."""
    return load_model("tiny-llama", weights="synthetic", seed=0)


@pytest.fixture(scope="module")
def eager():
    """The same weights with eager attention, to read full attention matrices as a reference."""
    return load_model("tiny-llama", weights="synthetic", seed=0, attn_implementation="eager")


def prompt(batch=1, n=N, seed=1):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def hf_generate(model, ids, cache, n=NEW):
    out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.fixture(scope="module")
def full_tokens(lm):
    return generate_text(lm, prompt(), make_policy("full"), NEW).tokens


@pytest.mark.parametrize("method", EVICTION)
def test_keep_one_reproduces_the_full_cache(lm, full_tokens, method):
    tokens = generate_text(lm, prompt(), policy(method, 1.0), NEW).tokens
    assert torch.equal(tokens, full_tokens)
    assert torch.equal(hf_generate(lm.model, prompt(), policy(method, 1.0).make_cache(lm.model)), full_tokens)


@pytest.mark.parametrize("method", EVICTION)
def test_generate_and_decode_loop_agree_after_eviction(lm, full_tokens, method):
    """Same tokens from model.generate (positions from the attention mask) and kvlab.engine.generation
    (positions from the logical length): masks and positions are consistent after eviction."""
    p = policy(method, 0.3)
    ours = generate_text(lm, prompt(), p, NEW)
    cache = p.make_cache(lm.model)
    theirs = hf_generate(lm.model, prompt(), cache)
    assert torch.equal(ours.tokens, theirs)
    assert cache.get_seq_length() == N + NEW - 1
    assert not torch.equal(ours.tokens, full_tokens)  # eviction did change something


def test_eviction_equals_masking_the_evicted_positions(lm):
    """StreamingLLM keeps the same positions in every layer and head, so it must match the full
    cache with those positions masked out (exact emulation), logits and all."""
    p = policy("streamingllm", 0.4)
    ids, question = prompt(), prompt(n=6, seed=5)
    cache = p.make_cache(lm.model)
    prefill(lm.model, ids, cache)
    kept = kept_positions(cache)[0][0, 0]
    got = prefill(lm.model, question, cache, logits_to_keep=0)
    got_tokens = greedy_decode(lm.model, cache, got[:, -1].argmax(-1), 8, N + 6)

    full = make_policy("full").make_cache(lm.model)
    prefill(lm.model, ids, full)
    mask = torch.zeros(1, N + 6, dtype=torch.long)
    mask[0, kept] = 1
    mask[0, N:] = 1
    positions = torch.arange(N, N + 6)[None]
    ref = lm.model(input_ids=question, position_ids=positions, attention_mask=mask, use_cache=True,
                   **{cache_kwarg(lm.model): full}).logits
    ref_tokens = greedy_decode(lm.model, full, ref[:, -1].argmax(-1), 8, N + 6, attention_mask=mask)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(got_tokens, ref_tokens)


def test_logical_and_physical_counts(lm):
    p = policy("snapkv", 0.3)
    cache = p.make_cache(lm.model)
    prefill(lm.model, prompt(), cache)
    k = math.floor(N * 0.3)
    stats = cache_stats(cache)
    assert (stats["logical_tokens"], stats["physical_tokens"]) == (N, k)
    assert cache.get_mask_sizes(1, 0) == (k + 1, N - k)
    prefill(lm.model, prompt(n=5, seed=3), cache)  # a question: appended, not evicted again
    stats = cache_stats(cache)
    assert (stats["logical_tokens"], stats["physical_tokens"]) == (N + 5, k + 5)
    for layer in cache.layers:
        assert layer.keys.shape[-2] == k + 5 and layer.kept_positions.shape[-1] == k


@pytest.mark.parametrize("method", EVICTION)
def test_kept_positions_are_sorted_unique_prompt_positions(lm, method):
    p = policy(method, 0.25)
    cache = p.make_cache(lm.model)
    prefill(lm.model, prompt(), cache)
    for idx, layer_kept in enumerate(kept_positions(cache)):
        assert layer_kept.shape[:2] == (1, 2) and layer_kept.dtype == torch.long
        assert layer_kept.shape[-1] == p.budget(N, idx, 2)
        assert (layer_kept.diff(dim=-1) > 0).all() and layer_kept.min() >= 0 and layer_kept.max() < N


def test_streamingllm_keeps_sinks_and_recent(lm):
    cache = policy("streamingllm", 0.2).make_cache(lm.model)
    prefill(lm.model, prompt(), cache)
    expected = list(range(4)) + list(range(N - 16, N))
    for layer_kept in kept_positions(cache):
        assert (layer_kept == torch.tensor(expected)).all()


def test_knorm_keeps_lowest_key_norms(lm):
    full = make_policy("full").make_cache(lm.model)
    prefill(lm.model, prompt(), full)
    cache = policy("knorm", 0.5).make_cache(lm.model)
    prefill(lm.model, prompt(), cache)
    for layer, layer_kept in zip(full.layers, kept_positions(cache), strict=True):
        norms = layer.keys.norm(dim=-1)
        expected = (-norms).topk(50, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer_kept, expected)


def test_random_is_seeded(lm):
    def kept(seed):
        cache = policy("random", 0.5, seed=seed).make_cache(lm.model)
        prefill(lm.model, prompt(), cache)
        return kept_positions(cache)

    a, b, c = kept(0), kept(0), kept(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def _snapkv_reference(att, window, kernel, heads_kv, n_kept):
    n = att.shape[-1]
    s = att[..., -window:, : n - window].float().mean(-2)
    s = F.avg_pool1d(s, kernel, padding=kernel // 2, stride=1)
    s = s.view(s.shape[0], heads_kv, -1, n - window).mean(2)
    s = torch.cat([s, torch.full((*s.shape[:2], window), s.max().item() + 1)], -1)
    return s.topk(n_kept, -1).indices.sort(-1).values


def test_snapkv_and_tova_match_eager_attention(lm, eager):
    """Scores from the window rows equal those from the full eager attention matrix (kvpress formulas)."""
    ids = prompt(batch=2)
    with torch.no_grad():
        attentions = eager.model(input_ids=ids, output_attentions=True).attentions
    snap = policy("snapkv", 0.3).make_cache(lm.model)
    prefill(lm.model, ids, snap)
    tova = policy("tova", 0.3).make_cache(lm.model)
    prefill(lm.model, ids, tova)
    for layer, att in enumerate(attentions):
        assert torch.equal(kept_positions(snap)[layer], _snapkv_reference(att, 8, 5, 2, 30))
        last = att[:, :, -1, :-1].float().mean(1, keepdim=True).expand(-1, 2, -1)
        last = torch.cat([last, torch.full((2, 2, 1), last.max().item() + 1)], -1)
        assert torch.equal(kept_positions(tova)[layer], last.topk(30, -1).indices.sort(-1).values)


def test_window_attention_rows_equal_eager_rows(eager):
    torch.manual_seed(0)
    query, keys = torch.randn(2, 4, 50, 16), torch.randn(2, 2, 50, 16)
    rows = window_attention(query, keys, 0.25, 8)
    assert rows.shape == (2, 4, 8, 50)
    logits = query @ keys.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.25
    logits = logits.masked_fill(torch.ones(50, 50, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(rows, logits.softmax(-1)[:, :, -8:])
    mask = torch.ones(2, 1, 50, 50, dtype=torch.bool).tril()
    torch.testing.assert_close(window_attention(query, keys, 0.25, 8, mask), rows)


def test_pyramidkv_budgets_shrink_with_depth_and_questions_work(lm):
    p = policy("pyramidkv", 0.5)
    cache = p.make_cache(lm.model)
    prefill(lm.model, prompt(), cache)
    per_layer = cache_stats(cache)["physical_tokens_per_layer"]
    assert per_layer[0] > per_layer[1] and sum(per_layer) / 2 == pytest.approx(N * 0.5, abs=1)
    logits = prefill(lm.model, prompt(n=7, seed=4), cache)  # one mask, two layer lengths
    assert torch.isfinite(logits).all()
    assert cache_stats(cache)["physical_tokens_per_layer"] == [k + 7 for k in per_layer]


@pytest.mark.parametrize("method", ["snapkv", "tova", "knorm", "streamingllm"])
def test_batch_of_equal_length_prompts_matches_single_runs(lm, method):
    p = policy(method, 0.3)
    batch = prompt(batch=3, seed=7)
    together = generate_text(lm, batch, p, 6)
    kept_together = kept_positions(together.cache)
    for row in range(3):
        alone = generate_text(lm, batch[row:row + 1], p, 6)
        assert torch.equal(together.tokens[row], alone.tokens[0])
        for a, b in zip(kept_together, kept_positions(alone.cache), strict=True):
            assert torch.equal(a[row], b[0])


@pytest.mark.parametrize("method", EVICTION + ["full"])
@pytest.mark.parametrize("keep", [0.1, 0.5, 1.0])
def test_cache_bytes_after_prefill_match_the_budget(lm, method, keep):
    """Memory is real: the evicted tensors shrink to exactly kvlab.budget's prediction (float32 model)."""
    p = make_policy("full") if method == "full" else policy(method, keep)
    keep = 1.0 if method == "full" else keep
    cache = p.make_cache(lm.model)
    prefill(lm.model, prompt(batch=2), cache)
    stats = cache_stats(cache)
    if method == "pyramidkv":  # per-layer budgets: compare the exact sum, and the budget's mean
        per_token = lm.spec.num_kv_heads * lm.spec.head_dim * 2 * 4 * 2  # K+V, fp32, batch 2
        assert stats["bytes"] == sum(stats["physical_tokens_per_layer"]) * per_token
        assert stats["bytes"] == pytest.approx(cache_bytes(lm.spec, N, batch=2, bits=32, keep=keep), abs=per_token)
    else:
        assert stats["bytes"] == cache_bytes(lm.spec, N, batch=2, bits=32, keep=keep)
    for layer in cache.layers:  # not views of the full prompt tensors
        assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * layer.keys.element_size()


def test_missing_attention_hook_is_a_clear_error():
    model = load_model("tiny-llama", weights="synthetic", seed=0).model
    cache = policy("snapkv", 0.5).make_cache(model)
    model.set_attn_implementation("sdpa")  # undo prepare(): the queries never reach the cache
    prefill(model, prompt(), cache)
    with pytest.raises(EvictionError, match=r"policy\.prepare\(model\)"):
        prefill(model, prompt(n=1), cache)


def test_crop_removes_only_tokens_added_after_prefill(lm):
    cache = policy("knorm", 0.5).make_cache(lm.model)
    prefill(lm.model, prompt(), cache)
    prefill(lm.model, prompt(n=4, seed=9), cache)
    cache.crop(-4)
    assert (cache.get_seq_length(), cache_stats(cache)["physical_tokens"]) == (N, 50)
    with pytest.raises(EvictionError, match="after its prefill"):
        cache.crop(-1)


def test_every_cache_is_fresh(lm):
    p = policy("snapkv", 0.5)
    a, b = p.make_cache(lm.model), p.make_cache(lm.model)
    assert a is not b and not any(x is y for x, y in zip(a.layers, b.layers, strict=True))


ALLOWED: dict[int, torch.Tensor] = {}  # layer -> [B, Hkv, N] prompt positions each head may see


def _register_per_head_reference():
    """Full-cache attention that hides, per KV head, the prompt positions in ``ALLOWED``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        q_len, kv_len = query.shape[2], key.shape[2]
        mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        mask = mask.expand(query.shape[0], query.shape[1], q_len, kv_len).clone()
        allowed = ALLOWED[module.layer_idx].repeat_interleave(groups, 1)
        mask[..., : allowed.shape[-1]] &= allowed[:, :, None, :]
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1),
                                             value.repeat_interleave(groups, 1), attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvlab_test_per_head", attend)
    AttentionMaskInterface.register("kvlab_test_per_head", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@pytest.mark.parametrize("method", ["snapkv", "knorm", "random"])
def test_per_head_eviction_equals_per_head_masking(method):
    """Each KV head keeps its own positions: the question's logits must equal those of the full
    cache with, per head, the evicted positions masked out."""
    _register_per_head_reference()
    model = load_model("tiny-llama", weights="synthetic", seed=0).model
    ids, question = prompt(batch=2), prompt(batch=2, n=6, seed=5)
    cache = policy(method, 0.3).make_cache(model)
    prefill(model, ids, cache)
    got = prefill(model, question, cache, logits_to_keep=0)
    for layer, kept in enumerate(kept_positions(cache)):
        assert not (kept[:, :1] == kept[:, 1:]).all()  # heads really differ
        ALLOWED[layer] = torch.zeros(*kept.shape[:2], N, dtype=torch.bool).scatter_(2, kept, True)
    model.set_attn_implementation("sdpa")
    full = make_policy("full").make_cache(model)
    prefill(model, ids, full)
    model.set_attn_implementation("kvlab_test_per_head")
    ref = model(input_ids=question, position_ids=torch.arange(N, N + 6).expand(2, -1), use_cache=True,
                **{cache_kwarg(model): full}).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
