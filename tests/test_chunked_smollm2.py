"""Chunked prefill on real weights (SmolLM2-135M-Instruct, CPU): the ~2k-token needle prompt of
tests/test_policies_smollm2.py prefilled in 512-token chunks."""

import pytest

pytestmark = pytest.mark.slow(reason="real SmolLM2 weights: a 2k-token prefill and 12 decode steps per answer")


def test_the_full_cache_in_chunks_answers_as_one_shot(smollm2_answer):
    """Chunks attend lower-right causal without a mask: the same answer, token for token. The one-shot
    answer is the session's (tests/conftest.py), shared with test_policies_smollm2's full-cache test."""
    once, value = smollm2_answer("full")
    chunked, _ = smollm2_answer("full", prefill_chunk=512)
    assert value in chunked.text and chunked.tokens.tolist() == once.tokens.tolist()


def test_tova_half_cache_streamed_in_chunks_keeps_its_budget_and_the_needle(smollm2_answer, smollm2_needle):
    result, value = smollm2_answer("tova", keep=0.5, prefill_chunk=512)
    assert result.cache_after_prefill["physical_tokens"] == len(smollm2_needle[0]) // 2
    assert value in result.text
