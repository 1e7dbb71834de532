"""Behaviour on real weights: a needle in a ~2k-token haystack, SmolLM2-135M-Instruct on CPU.

Protocol (kvpress, question-agnostic): the context (instruction + haystack) is prefilled and
compressed once; the question and answer prefix follow as a second forward that is not
compressed. Prompt format from the RULER-style pilot that scores 100% with the full cache.
"""

import random

import pytest

from kvlab.policies import kept_positions

pytestmark = pytest.mark.slow(reason="real SmolLM2 weights: a 2k-token prefill and 12 decode steps per "
                                     "answer")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEYS = ["brave-otter", "silent-maple", "golden-river", "quiet-falcon"]


def needle_prompt(tokenizer, n_tokens=2000, depth=0.5, seed=1):
    """(context ids, question ids, answer, needle token span) for one seeded needle prompt."""
    rng = random.Random(seed)
    key, value = rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))
    per_line = len(tokenizer(NOISE + "\n", add_special_tokens=False).input_ids)
    lines = [NOISE] * ((n_tokens - 150) // per_line)
    lines.insert(int(len(lines) * depth), f"One of the special magic numbers for {key} is: {value}.")
    instruction = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                   "I will quiz you about the numbers afterwards.\n")
    question = f"What is the special magic number for {key} mentioned in the provided text?"
    text = tokenizer.apply_chat_template([{"role": "user", "content": instruction + "\n".join(lines) + "\n" + question}],
                                         tokenize=False, add_generation_prompt=True)
    text += f"The special magic number for {key} mentioned in the provided text is"
    cut = text.index(question)
    context = tokenizer(text[:cut], add_special_tokens=False).input_ids
    needle_at = len(tokenizer(text[: text.index("One of the special")], add_special_tokens=False).input_ids)
    return context, tokenizer(text[cut:], add_special_tokens=False).input_ids, value, range(needle_at, needle_at + 20)


@pytest.fixture(scope="module")
def needle(smollm2_needle):
    return smollm2_needle


@pytest.fixture(scope="module")
def answer(smollm2_answer):
    """Each (method, params) generated once per session: tests/conftest.py's smollm2_answer."""
    return smollm2_answer


def test_prompt_is_about_2k_tokens_with_the_needle_in_the_middle(needle):
    context, question, _, span = needle
    assert 1800 <= len(context) + len(question) <= 2100
    assert 0.4 < span.start / len(context) < 0.6


def test_full_cache_finds_the_needle(answer, needle):
    result, value = answer("full")
    assert value in result.text


def test_tova_half_cache_finds_the_needle(answer, needle):
    result, value = answer("tova", keep=0.5)
    assert result.cache_after_prefill["physical_tokens"] == len(needle[0]) // 2
    assert value in result.text


def test_streamingllm_tenth_loses_a_needle_in_the_middle(answer, needle):
    result, value = answer("streamingllm", keep=0.1)
    kept = set(kept_positions(result.cache)[0][0, 0].tolist())
    assert not kept & set(needle[3])  # the needle left the cache...
    assert value not in result.text  # ...and with it the answer


@pytest.mark.xfail(strict=True, reason=(
    "question-agnostic SnapKV (kvpress semantics, verified against eager attention) selects per KV head; on "
    "SmolLM2 (3 KV heads) heads of the first layers give the needle's digits the lowest window attention of "
    "the whole prompt and evict them (test_snapkv_evicts_the_needle_digits_in_early_layers), so the copy "
    "breaks: it fails even at keep 0.9, and with the question inside the window too (2026-12-02: keep 0.99 "
    "answers 2058 for 2058756). The evicted cache equals a per-head-masked full cache, so this is the method."))
def test_snapkv_half_cache_finds_the_needle(answer, needle):
    result, value = answer("snapkv", keep=0.5)
    assert value in result.text


def test_snapkv_evicts_the_needle_digits_in_early_layers(smollm2, answer, needle):
    """Why SnapKV loses the needle that TOVA keeps: per-head top-k on window attention drops digits."""
    context, _, value, span = needle
    sentence = range(span.start, span.stop + 8)  # the span's 20 tokens end one digit early
    digits = [p for p in sentence if smollm2.tokenizer.decode([context[p]]).strip().isdigit()]
    assert "".join(smollm2.tokenizer.decode([context[p]]).strip() for p in digits) == value
    result, _ = answer("snapkv", keep=0.5)
    kept = kept_positions(result.cache)
    lost = {(layer, head) for layer in range(3) for head in range(kept[layer].shape[1])
            if set(digits) - set(kept[layer][0, head].tolist())}
    assert lost, "every early-layer KV head kept every digit of the needle"
