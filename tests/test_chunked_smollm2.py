"""Chunked prefill on real weights (SmolLM2-135M-Instruct, CPU): the ~2k-token needle prompt of
tests/test_policies_smollm2.py prefilled in 512-token chunks."""

import pytest
from test_policies_smollm2 import needle_prompt

from kvlab.engine.engines import generate_text
from kvlab.policies import make_policy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def needle(smollm2):
    return needle_prompt(smollm2.tokenizer)


def answer(smollm2, needle, method, **params):
    context, question, value, _ = needle
    return generate_text(smollm2, context, make_policy(method, **params), 12, question_ids=question), value


def test_the_full_cache_in_chunks_answers_as_one_shot(smollm2, needle):
    """Chunks attend lower-right causal without a mask: the same answer, token for token."""
    once, value = answer(smollm2, needle, "full")
    chunked, _ = answer(smollm2, needle, "full", prefill_chunk=512)
    assert value in chunked.text and chunked.tokens.tolist() == once.tokens.tolist()


def test_tova_half_cache_streamed_in_chunks_keeps_its_budget_and_the_needle(smollm2, needle):
    result, value = answer(smollm2, needle, "tova", keep=0.5, prefill_chunk=512)
    assert result.cache_after_prefill["physical_tokens"] == len(needle[0]) // 2
    assert value in result.text
