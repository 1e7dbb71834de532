"""Expected Attention: kvlab's policy keeps what kvpress's rule (restated in tests/kvpress_reference.py,
from hidden states and q_proj) keeps, on a tiny random Llama."""

import kvpress_reference as ref
import pytest
import torch
from tiny_models import load_tiny_d32
from transformers import DynamicCache

from kvlab.engine.generation import cache_kwarg, greedy_decode, prefill
from kvlab.policies import PolicyError, cache_stats, kept_positions, make_policy
from kvlab.policies.expected_attention import mean_rotation, unrotate

N = 96


@pytest.fixture(scope="module")
def lm():
    return load_tiny_d32()


def prompt(batch=1, n=N, seed=3):
    return torch.randint(3, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


def full_prefill(lm, ids):
    """Full-cache K/V per layer and the hidden states entering each attention module."""
    hidden = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, k, i=i: hidden.__setitem__(i, k["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(lm.model.model.layers)]
    cache = DynamicCache(config=lm.model.config)
    try:
        with torch.no_grad():
            lm.model(ids, **{cache_kwarg(lm.model): cache})
    finally:
        for h in hooks:
            h.remove()
    return [(layer.keys, layer.values) for layer in cache.layers], hidden


def kvlab_kept(lm, policy, ids):
    with policy.attach(lm, warm=False):
        cache = policy.make_cache(lm.model)
        prefill(lm.model, ids, cache, policy.prefill_chunk)
    return cache, kept_positions(cache)


def test_unrotate_inverts_rope_and_mean_rotation_is_the_average():
    rotary = load_tiny_d32().model.model.rotary_emb
    q = torch.randn(1, 2, 5, 32)
    pos = torch.arange(7, 12).unsqueeze(0)
    cos, sin = rotary(q, pos)
    rotated = q * cos + ref_rotate(q) * sin
    torch.testing.assert_close(unrotate(rotated, cos[0], sin[0]), q, rtol=1e-5, atol=1e-5)
    rbar = mean_rotation(cos[0], sin[0])
    x = q[0, 0]  # [5, D]: each vector rotated to every position, then averaged
    averaged = (x[:, None, :] * cos[0] + ref_rotate(x)[:, None, :] * sin[0]).mean(1)
    torch.testing.assert_close(x @ rbar.T, averaged, rtol=1e-5, atol=1e-5)


def ref_rotate(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@pytest.mark.parametrize("keep", [0.5, 0.25])
@pytest.mark.parametrize("knobs", [{}, {"use_covariance": False}, {"use_vnorm": False, "n_sink": 2},
                                   {"epsilon": 0.01, "n_future_positions": 64}])
def test_kept_positions_match_kvpress(lm, keep, knobs):
    ids = prompt()
    kv, hidden = full_prefill(lm, ids)
    _, kept = kvlab_kept(lm, make_policy("expected_attention", keep=keep, **knobs), ids)
    rotary = lm.model.model.rotary_emb
    for i, (keys, values) in enumerate(kv):
        module = lm.model.model.layers[i].self_attn
        scores = ref.expected_attention(module, rotary, hidden[i], keys, values, **knobs)
        assert torch.equal(kept[i], ref.scorer_keep(scores, keep)), f"layer {i}"


def test_sinks_kept_and_batch_rows_independent(lm):
    ids = prompt(batch=2)
    _, kept = kvlab_kept(lm, make_policy("expected_attention", keep=0.25), ids)
    _, kept0 = kvlab_kept(lm, make_policy("expected_attention", keep=0.25), ids[:1])
    for a, b in zip(kept, kept0, strict=True):
        assert (a[..., :4] == torch.arange(4)).all()
        assert torch.equal(a[:1], b)


def test_whole_prompt_chunk_is_one_shot_and_small_chunks_keep_the_budget(lm):
    ids = prompt()
    _, one = kvlab_kept(lm, make_policy("expected_attention", keep=0.25), ids)
    _, same = kvlab_kept(lm, make_policy("expected_attention", keep=0.25, prefill_chunk=N), ids)
    assert all(torch.equal(a, b) for a, b in zip(one, same, strict=True))
    cache, small = kvlab_kept(lm, make_policy("expected_attention", keep=0.25, prefill_chunk=20), ids)
    assert [k.shape[-1] for k in small] == [24, 24]
    assert cache_stats(cache)["physical_tokens_per_layer"] == [24, 24]


def test_decodes_after_eviction(lm):
    policy = make_policy("expected_attention", keep=0.25)
    ids = prompt()
    with policy.attach(lm, warm=False):
        cache = policy.make_cache(lm.model)
        logits = prefill(lm.model, ids, cache)
        tokens = greedy_decode(lm.model, cache, logits[:, -1].argmax(-1), 4, N)
    assert tokens.shape == (1, 4) and cache.get_seq_length() == N + 3


@pytest.mark.parametrize("bad", [{"n_sink": -1}, {"n_future_positions": 0}, {"use_vnorm": 1},
                                 {"epsilon": -0.1}, {"epsilon": float("nan")}])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(PolicyError):
        make_policy("expected_attention", keep=0.5, **bad)


def test_evict_then_quantize_keeps_the_same_positions(lm):
    ids = prompt()
    _, plain = kvlab_kept(lm, make_policy("expected_attention", keep=0.25), ids)
    cache, quant = kvlab_kept(lm, make_policy("expected_attention", keep=0.25,
                                              quant={"backend": "kvq", "nbits": 4, "q_group_size": 32}), ids)
    assert all(torch.equal(a, b) for a, b in zip(plain, quant, strict=True))
    assert cache_stats(cache)["physical_tokens_per_layer"] == [24, 24]
