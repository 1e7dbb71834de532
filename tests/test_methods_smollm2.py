"""Expected Attention, KVzip and AdaKV on real weights: the ~2k-token needle prompt of
test_policies_smollm2 (SmolLM2-135M-Instruct, CPU), question-agnostic compression at keep 0.5.

Observed 2026-12-03 (kept positions identical to kvpress 0.5.4's, see
reports/cpu-kvpress-parity-2026-12-03): KVzip, which scores what the model needs to repeat the
context, keeps the needle; Expected Attention (per head or head-adaptive) answers 2021/2023 for
2058756, as question-agnostic SnapKV loses it (test_policies_smollm2)."""

import pytest
from test_policies_smollm2 import needle_prompt

from kvlab.engine.engines import generate_text
from kvlab.policies import kept_positions, make_policy
from kvlab.policies.headwise import head_stats

pytestmark = pytest.mark.slow(reason="real SmolLM2 weights: a 2k-token needle prompt per method (kvzip: two prefills)")


@pytest.fixture(scope="module")
def needle(smollm2):
    return needle_prompt(smollm2.tokenizer)


def answer(smollm2, needle, method, **params):
    context, question, value, _ = needle
    result = generate_text(smollm2, context, make_policy(method, **params), 12, question_ids=question)
    return result, value


@pytest.mark.parametrize("method,params,finds", [
    ("expected_attention", {}, False),
    ("kvzip", {}, True),
    ("adakv", {"scorer": "expected_attention"}, False),
    ("adakv", {"scorer": "kvzip", "alpha_safeguard": 0.0}, True),
])
def test_half_cache_and_the_needle(smollm2, needle, method, params, finds):
    result, value = answer(smollm2, needle, method, keep=0.5, **params)
    n = len(needle[0])
    kept = kept_positions(result.cache)
    assert all(k.shape[:2] == (1, 3) for k in kept)
    if method == "adakv":
        stats = head_stats(result.cache)
        assert stats["kept_tokens_per_layer"][0] >= n // 2  # + the question and answer tokens
        assert stats["padded_bytes"] >= stats["kept_bytes"]
    else:
        assert result.cache_after_prefill["physical_tokens"] == n // 2
    print(method, params, repr(result.text))
    assert (value in result.text) == finds
