"""Teacher forcing through each engine's own storage (issue #28): ``Decoder.feed`` on ``fast`` writes
every token into the store in its format, as ``hf``'s quantized layers do, so the two engines give
the same logits for a question and a gold answer after a context; decode goes on after what was fed."""

import pytest
import torch
from tiny_models import load_tiny_d32

from kvlab.engine.engines import make_engine
from kvlab.engine.generation import greedy_decode, prefill
from kvlab.policies import make_policy


@pytest.fixture(scope="module")
def lm():
    return load_tiny_d32()


def _policy(method):
    return make_policy(method, q_group_size=32) if method.startswith("kvq-int") else make_policy(method)


def ids(n, seed, vocab=500):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def fed_logits(loaded, engine_name, policy, context, fed, room):
    engine = make_engine(engine_name, loaded)
    cache = engine.storage_policy(policy).make_cache(loaded.model)
    prefill(loaded.model, context, cache)
    decoder = engine.decoder_for_cache(policy, cache, room)
    with torch.no_grad():
        return decoder.feed(fed, context.shape[1]), decoder


@pytest.mark.parametrize("method", ["full", "kvq-int4", "kvq-fp8"])
def test_fast_and_hf_teacher_force_to_the_same_logits(lm, method):
    tiny = lm
    policy = _policy(method)
    context, fed = ids(48, 1), ids(12, 2)
    with policy.attach(tiny, warm=False):
        hf, _ = fed_logits(tiny, "hf", policy, context, fed, 12)
        fast, _ = fed_logits(tiny, "fast", policy, context, fed, 12)
        exact, _ = fed_logits(tiny, "hf", make_policy("full"), context, fed, 12)
    assert hf.shape == fast.shape == (1, 12, tiny.model.config.vocab_size)
    assert torch.allclose(fast, hf, atol=1e-3, rtol=1e-3), (fast - hf).abs().max()
    if method != "full":  # the store's format is seen: the logits are not the exact cache's
        assert (fast - exact).abs().max() > 10 * (fast - hf).abs().max()


def test_decode_goes_on_after_the_fed_tokens_and_restore_rewinds(lm):
    tiny = lm
    policy = _policy("kvq-int4")
    context, fed, gold = ids(40, 3), ids(6, 4), ids(5, 5)
    with policy.attach(tiny, warm=False):
        hf_logits, hf = fed_logits(tiny, "hf", policy, context, fed, 6 + 8)
        logits, fast = fed_logits(tiny, "fast", policy, context, fed, 6 + 8)
        start = 40 + 6
        first = logits[:, -1].argmax(-1)
        mark = fast.checkpoint()
        tokens = fast.decode(first, 8, start)
        ref = greedy_decode(tiny.model, hf.cache, hf_logits[:, -1].argmax(-1), 8, start)
        assert torch.equal(tokens, ref)
        fast.restore(mark)
        with torch.no_grad():
            again = fast.feed(gold, start)
        fresh, _ = fed_logits(tiny, "fast", policy, context, torch.cat([fed, gold], dim=1), 6 + 8)
    assert torch.allclose(again, fresh[:, 6:], atol=1e-5)


def test_feed_refuses_more_than_the_room(tiny):
    policy = make_policy("full")
    with policy.attach(tiny, warm=False), pytest.raises(Exception, match="room"):
        fed_logits(tiny, "fast", policy, ids(16, 1), ids(5, 2), 4)
