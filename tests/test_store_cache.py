"""The fast engine prefills a policy that keeps every token straight into its static store (issue #28):
no second copy of the prompt's K/V at the peak, the same tokens as before."""

import pytest
import torch
from tiny_models import load_tiny_d32

from kvlab.engine.fast import FastEngine
from kvlab.engine.generation import greedy_decode, prefill
from kvlab.policies import make_policy
from kvlab.storage.store_cache import StoreCache


@pytest.fixture(scope="module")
def lm():
    return load_tiny_d32()


def ids(batch=2, n=48, seed=1):
    return torch.randint(3, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


def store_storages(store) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in store.buffers()}


def own_bytes(cache, store) -> int:
    """Bytes the cache's layers hold in tensors that are not the store's buffers."""
    shared = store_storages(store)
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in shared:
                total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("method", ["full", "kvq-int4", "kvq-fp8"])
def test_the_prefill_holds_no_cache_beside_the_store(lm, method):
    policy = make_policy(method, q_group_size=32) if method == "kvq-int4" else make_policy(method)
    prompt = ids()
    with policy.attach(lm, warm=False):
        decoder = FastEngine(lm).decoder(policy, 2, prompt.shape[1], 6)
        cache = decoder.prefill_cache()
        assert isinstance(cache, StoreCache)
        peak = []
        hooks = [layer.register_forward_hook(lambda *_: peak.append(own_bytes(cache, decoder.store)))
                 for layer in lm.model.model.layers]
        try:
            first = prefill(lm.model, prompt, cache, chunk=16)[:, -1].argmax(-1)
        finally:
            for h in hooks:
                h.remove()
        assert len(peak) == 3 * len(lm.model.model.layers) and max(peak) == 0  # after every layer of every chunk
        decoder.load(cache)
        tokens = decoder.decode(first, 6, prompt.shape[1])
        ref_cache = policy.make_cache(lm.model)
        ref_first = prefill(lm.model, prompt, ref_cache, chunk=16)[:, -1].argmax(-1)
        ref = greedy_decode(lm.model, ref_cache, ref_first, 6, prompt.shape[1])
    assert torch.equal(tokens, ref)  # what hf's cache of the same policy gives, chunked prefill included


def test_row_groups_write_their_rows(lm):
    policy = make_policy("full")
    prompt = ids(batch=4)
    with policy.attach(lm, warm=False):
        decoder = FastEngine(lm).decoder(policy, 4, prompt.shape[1], 5)
        first = decoder.prefill(prompt, rows=2)
        tokens = decoder.decode(first, 5, prompt.shape[1])
        cache = policy.make_cache(lm.model)
        ref = greedy_decode(lm.model, cache, prefill(lm.model, prompt, cache)[:, -1].argmax(-1), 5, prompt.shape[1])
    assert torch.equal(tokens, ref)


def test_an_evicting_policy_still_prefills_into_its_own_cache(lm):
    policy = make_policy("snapkv", keep=0.5, window_size=8)
    with policy.attach(lm, warm=False):
        decoder = FastEngine(lm).decoder(policy, 1, 48, 4)
        assert not isinstance(decoder.prefill_cache(), StoreCache)


def test_a_prompt_longer_than_the_store_is_refused(lm):
    policy = make_policy("full")
    with policy.attach(lm, warm=False):
        decoder = FastEngine(lm).decoder(policy, 1, 16, 4)
        with pytest.raises(ValueError, match="slots"):
            prefill(lm.model, ids(batch=1, n=20), decoder.prefill_cache())
