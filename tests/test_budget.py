"""The byte-budget math against the seed arithmetic and bad input."""

import math

import pytest

from kvlab import budget
from kvlab.budget import BudgetError
from kvlab.models import get_spec

GiB = 1024**3


@pytest.fixture(scope="module")
def llama8b():
    return get_spec("llama-3.1-8b")


def test_bytes_per_token_llama3_8b(llama8b):
    assert budget.kv_bytes_per_token(llama8b, 16) == 131_072
    assert budget.kv_bytes_per_token(llama8b, 8) == 65_536
    assert budget.kv_bytes_per_token(llama8b, 4) == 32_768
    assert budget.kv_bytes_per_token(llama8b, 2) == 16_384


def test_seed_cache_sizes(llama8b):
    assert budget.cache_bytes(llama8b, 8192) == 1 * GiB
    assert budget.cache_bytes(llama8b, 16384) == 2 * GiB
    assert budget.cache_bytes(llama8b, 8192, batch=32) == 32 * GiB


def test_batch32_at_8k_does_not_fit_rtx4090(llama8b):
    gpu = budget.get_gpu("rtx-4090")
    assert budget.max_batch(llama8b, 8192, gpu.memory_bytes) < 32
    report = budget.budget_report(llama8b, 8192, batch=32, gpu=gpu)
    assert report["fits"] is False


def test_group_overhead_adds_two_scales_per_group():
    assert budget.effective_bits(4, 64) == 4 + 32 / 64
    assert budget.effective_bits(2, 128) == 2 + 32 / 128
    assert budget.effective_bits(16, 64) == 16


def test_residual_makes_short_contexts_compress_less(llama8b):
    # 384 tokens at 4 bits + 128 residual tokens at 16 bits vs 512 at 16 bits: about 2.3x, not 4x.
    no_scales = budget.compression_ratio(llama8b, 512, bits=4, group_size=None, residual=128)
    assert no_scales == pytest.approx(8192 / 3584)
    assert 2.25 < no_scales < 2.35
    with_scales = budget.compression_ratio(llama8b, 512, bits=4, group_size=64, residual=128)
    assert with_scales == pytest.approx(8192 / (384 * 4.5 + 128 * 16))
    # the ratio approaches 16 / 4.5 as the context grows
    long = budget.compression_ratio(llama8b, 131072, bits=4, group_size=64, residual=128)
    assert long == pytest.approx(16 / 4.5, rel=0.01)
    assert with_scales < long


def test_keep_applies_to_prompt_only(llama8b):
    per_tok = 131_072
    assert budget.cache_bytes(llama8b, 1000, keep=0.1, new_tokens=128) == (100 + 128) * per_tok
    assert budget.kept_prompt_tokens(5, 0.1) == 1  # floor(0.5) would be 0: at least one kept


def test_decode_floor_eviction_saves_little_at_batch1(llama8b):
    full = budget.decode_bytes(llama8b, 16384)
    assert full.weights == pytest.approx(16e9, rel=0.01)
    assert full.kv == 2 * GiB
    evicted = budget.decode_bytes(llama8b, 16384, keep=0.1)
    saved = 1 - evicted.total / full.total
    assert saved == pytest.approx(0.11, abs=0.01)
    h200 = budget.get_gpu("h200")
    assert full.floor_s(h200.bandwidth_bytes_per_s) == pytest.approx(full.total / 4.8e12)


def test_max_context_is_the_boundary(llama8b):
    mem = 80e9
    n = budget.max_context(llama8b, mem, batch=4)
    free = mem - budget.weight_bytes(llama8b) - budget.DEFAULT_RESERVE_BYTES
    assert budget.cache_bytes(llama8b, n, batch=4) <= free < budget.cache_bytes(llama8b, n + 1, batch=4)


def test_quantized_capacity_is_larger(llama8b):
    mem = budget.get_gpu("h100-sxm").memory_bytes
    b16 = budget.max_batch(llama8b, 16384, mem)
    b4 = budget.max_batch(llama8b, 16384, mem, bits=4)
    assert b4 > 3 * b16


def test_weight_bytes(llama8b):
    assert budget.weight_bytes(llama8b) == llama8b.num_params * 2
    assert math.isclose(budget.weight_bytes(llama8b) / 1e9, 16.06, rel_tol=1e-3)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: budget.cache_bytes(s, 0), "ctx must be a positive integer"),
        (lambda s: budget.cache_bytes(s, -5), "ctx must be a positive integer"),
        (lambda s: budget.kv_bytes_per_token(s, 5), "bits: 5 is not a stored width: use 16 (bf16/fp16), 8 (fp8/int8), 4, 3, 2 or 1"),
        (lambda s: budget.kv_bytes_per_token(s, 4, group_size=48), "does not divide"),
        (lambda s: budget.cache_bytes(s, 100, keep=0), "outside (0, 1]"),
        (lambda s: budget.cache_bytes(s, 100, keep=1.5), "outside (0, 1]"),
        (lambda s: budget.cache_bytes(s, 100, batch=0), "batch must be a positive integer"),
        (lambda s: budget.get_gpu("tpu-v9"), "presets: rtx-a6000"),
    ],
)
def test_bad_input_names_the_fix(llama8b, call, message):
    with pytest.raises(BudgetError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(llama8b)
