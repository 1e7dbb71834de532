"""The shared greedy loop: exact token counts, explicit positions, callbacks, padding."""

import pytest
import torch

from kvlab.engine.engines import generate_text
from kvlab.engine.generation import cache_kwarg, greedy_decode, prefill
from kvlab.models import load_model
from kvlab.policies import make_policy


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama", weights="synthetic", seed=0)


def ids(batch=1, n=40, seed=1):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_cache_kwarg_matches_the_forward_signature(lm):
    import inspect

    assert cache_kwarg(lm.model) in inspect.signature(type(lm.model).forward).parameters


def test_prefill_returns_the_last_logits(lm):
    cache = make_policy("full").make_cache(lm.model)
    logits = prefill(lm.model, ids(batch=2), cache)
    assert logits.shape == (2, 1, lm.spec.vocab_size)
    assert cache.get_seq_length() == 40
    all_logits = prefill(lm.model, ids(n=3, batch=2), cache, logits_to_keep=0)
    assert all_logits.shape == (2, 3, lm.spec.vocab_size)


def test_exactly_n_tokens_eos_ignored_and_equal_to_generate(lm):
    """The loop never stops early: with EOS set to the first generated token it still returns n."""
    cache = make_policy("full").make_cache(lm.model)
    first = prefill(lm.model, ids(), cache)[:, -1].argmax(-1)
    steps = []
    tokens = greedy_decode(lm.model, cache, first, 15, 40, on_step=steps.append)
    assert tokens.shape == (1, 15) and tokens[0, 0] == first[0]
    assert steps == list(range(14))
    assert cache.get_seq_length() == 40 + 14
    ref = lm.model.generate(ids(), max_new_tokens=15, do_sample=False, eos_token_id=None, pad_token_id=0,
                            **{cache_kwarg(lm.model): make_policy("full").make_cache(lm.model)})
    assert torch.equal(ref[:, 40:], tokens)


def test_one_token_means_no_decode_step(lm):
    cache = make_policy("full").make_cache(lm.model)
    first = prefill(lm.model, ids(), cache)[:, -1].argmax(-1)
    called = []
    assert greedy_decode(lm.model, cache, first, 1, 40, on_step=called.append).shape == (1, 1)
    assert called == [] and cache.get_seq_length() == 40
    with pytest.raises(ValueError):
        greedy_decode(lm.model, cache, first, 0, 40)


def test_chunked_prefill_continues_positions(lm):
    """Prefilling in two calls gives the same logits as one call: positions come from the cache."""
    whole = make_policy("full").make_cache(lm.model)
    one = prefill(lm.model, ids(), whole)
    parts = make_policy("full").make_cache(lm.model)
    prefill(lm.model, ids()[:, :25], parts)
    two = prefill(lm.model, ids()[:, 25:], parts)
    torch.testing.assert_close(one, two, rtol=1e-4, atol=1e-4)


def test_left_padded_batch_matches_unpadded_rows(lm):
    """With a 2-D padding mask positions come from its cumulative sum, as in generate()."""
    short, long_ = ids(n=30, seed=2), ids(n=40, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 10, dtype=torch.long), short], 1), long_])
    mask = torch.ones_like(batch)
    mask[0, :10] = 0
    cache = make_policy("full").make_cache(lm.model)
    first = prefill(lm.model, batch, cache, attention_mask=mask)[:, -1].argmax(-1)
    tokens = greedy_decode(lm.model, cache, first, 8, torch.tensor([30, 40]), attention_mask=mask)
    for row, alone in enumerate((short, long_)):
        assert torch.equal(tokens[row], generate_text(lm, alone, make_policy("full"), 8).tokens[0])


def test_generate_text_with_a_question_after_the_context(lm):
    p = make_policy("tova", keep=0.5)
    g = generate_text(lm, ids(n=60), p, 5, question_ids=ids(n=7, seed=4)[0])
    assert g.texts is None and g.text is None  # synthetic weights: no tokenizer
    assert g.prompt_tokens == 60 and g.tokens.shape == (1, 5)
    assert g.cache_after_prefill == {"logical_tokens": 60, "physical_tokens": 30, "bytes": g.cache_after_prefill["bytes"],
                                     "physical_tokens_per_layer": [30, 30]}
    assert g.cache_final["logical_tokens"] == 60 + 7 + 4
    assert g.cache_final["physical_tokens"] == 30 + 7 + 4
