"""The storage families' bytes per token and paged layout against what their fast-engine stores hold."""

import pytest
import torch

from kvlab.models import get_spec
from kvlab.policies import POLICIES, make_policy
from kvlab.storage.base import PagedLayout, StoreOptions, paged_layout, storage_blocks, storage_bytes
from kvlab.storage.slots import Layout

SPEC = get_spec("smollm2-135m")  # head_dim 64: every kvq group fits
# every method the fast engine runs, with parameters whose layers keep a whole number of pages
METHODS = {"full": {}, "snapkv": {"keep": 0.5}, "kvq-int4": {}, "kvq-fp8": {}, "kvq-int2": {"q_group_size": 32},
           "quest": {"budget": 64}, "quest-int4": {"budget": 64, "format": "int4-g64"},
           "quest-fp8": {"budget": 64, "format": "fp8"},
           "adakv": {"keep": 0.5}, "streamingllm": {"keep": 0.25, "quant": {"backend": "kvq"}}}


@pytest.mark.parametrize("method", list(METHODS))
def test_bytes_per_token_is_what_the_store_holds(method):
    policy = make_policy(method.split("-")[0] if method.startswith("quest") else method, **METHODS[method])
    storage = policy.storage()
    ctx, new = 128, 32
    kept = policy.kept_tokens(ctx, SPEC.num_layers)
    layout = Layout(2, tuple(kept), new, SPEC.num_kv_heads, SPEC.head_dim)
    store = storage.store(layout, StoreOptions(torch.bfloat16, "cpu", SPEC.num_attention_heads, 1.0, "sdpa"))
    held = [k + new for k in kept]
    per_sequence = store.held_bytes([0] * len(held))  # a kvq key offset: per sequence and layer, not per token
    assert store.held_bytes(held) - per_sequence == storage_bytes(storage, SPEC, kept, new, batch=2)
    assert store.kv_format == storage.kv_format
    blocks = storage_blocks(storage, SPEC, kept, new, batch=2, block_tokens=16)
    assert blocks == 2 * sum(-(-n // 16) for n in held)
    per_block = storage.paged(SPEC.num_kv_heads, SPEC.head_dim, 16).block_bytes
    assert blocks * per_block >= store.held_bytes(held) - per_sequence


def test_kivi_counts_its_quantized_tokens_per_block():
    storage = make_policy("kivi").storage()
    per_token = storage.token_bytes(SPEC.num_kv_heads, SPEC.head_dim)
    assert per_token < 2 * SPEC.num_kv_heads * SPEC.head_dim * 2 / 4  # 2-bit codes plus scales
    assert storage.paged(SPEC.num_kv_heads, SPEC.head_dim, 32).block_bytes == -(-int(per_token * 32 * 8) // 8)


def test_paged_layout_rounds_up_to_whole_blocks():
    layout = PagedLayout(16, 4096)
    assert [layout.blocks(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
    assert layout.sequence_blocks([10, 20], new_tokens=6) == 1 + 2
    assert paged_layout(2.5, 16) == PagedLayout(16, 40)


def test_every_registered_method_has_a_storage_or_says_why():
    from kvlab.errors import UserError

    for name in POLICIES:
        try:
            storage = make_policy(name).storage()
        except UserError:
            continue  # hf only (decoding, adakv scope model, hqq): refused with a reason
        assert storage.token_bytes(SPEC.num_kv_heads, SPEC.head_dim) > 0


def test_quest_over_a_kvq_format_counts_codes_and_bounds():
    dense, int4 = (make_policy("quest", **p).storage() for p in ({}, {"format": "int4-g64"}))
    h, d = SPEC.num_kv_heads, SPEC.head_dim
    bounds = 2 * h * d * 2 / 16  # each page's key min and max at bf16, per token
    assert dense.token_bytes(h, d) == 2 * h * d * 2 + bounds
    assert int4.token_bytes(h, d) == 2 * h * (d / 2 + 2 * 2 * d / 64) + bounds  # codes, float16 scale and zero
    assert int4.paged(h, d, 16).block_bytes == -(-int(int4.token_bytes(h, d) * 16 * 8) // 8) < dense.paged(h, d).block_bytes
