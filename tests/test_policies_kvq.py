"""kvq-fp8 / kvq-int4 / kvq-int2: kvlab's formats as transformers cache layers, evict-then-kvq, and
the same greedy tokens on the hf engine (dequantize, then attend) and the fast engine."""

import pytest
import torch
from tiny_models import load_tiny_d32

from kvlab.engine.engines import generate_text
from kvlab.engine.fast import FastEngine
from kvlab.engine.generation import cache_kwarg, greedy_decode, prefill
from kvlab.kernels import parse_format
from kvlab.models import get_spec
from kvlab.policies import EvictionError, cache_stats, kept_positions, make_policy
from kvlab.policies.base import PolicyError
from kvlab.policies.cache import EvictingLayer, evicting_quantized_class
from kvlab.policies.quantized.storage import EvictingKVQLayer
from kvlab.storage.kvq import KVQLayer, KVQStorage

N = 100
FORMATS = ["fp8", "int4-g32", "int2-g32"]


@pytest.fixture(scope="module")
def lm():
    return load_tiny_d32()


def prompt(batch=1, n=N, seed=1):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def _policy(fmt: str, **kw):
    if fmt == "fp8":
        return make_policy("kvq-fp8", **kw)
    bits, group = fmt.removeprefix("int").split("-g")
    return make_policy(f"kvq-int{bits}", q_group_size=int(group), **kw)


@pytest.mark.parametrize("fmt", FORMATS)
def test_layer_returns_the_formats_dequantized_values(fmt):
    f = parse_format(fmt)
    layer = KVQLayer(fmt)
    g = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(2, 3, 10, 64, generator=g), torch.randn(2, 3, 10, 64, generator=g)
    k1, v1 = torch.randn(2, 3, 1, 64, generator=g), torch.randn(2, 3, 1, 64, generator=g)
    keys, values = layer.update(k0, v0)
    assert keys is k0 and values is v0  # the prefill attends exactly
    keys, values = layer.update(k1, v1)
    for got, x in ((keys, torch.cat([k0, k1], 2)), (values, torch.cat([v0, v1], 2))):
        assert torch.equal(got, f.dequantize(f.quantize(x)))  # per token: appending = quantizing the whole
    assert layer.get_seq_length() == 11 and layer.keys.numel() == 0
    layer.crop(-1)
    assert layer.get_seq_length() == 10
    half = KVQLayer(fmt)
    half.lazy_initialization(k0.half(), v0.half())
    half.update(k0.half(), v0.half())
    assert half.update(k1.half(), v1.half())[0].dtype == torch.float16  # the model dtype


@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_stats_count_codes_and_scales(lm, fmt):
    p = _policy(fmt)
    g = generate_text(lm, prompt(batch=2), p, 6)
    per_token = parse_format(fmt).bytes_per_token(lm.spec.num_kv_heads, lm.spec.head_dim)
    layers = lm.spec.num_layers
    offsets = layers * 2 * lm.spec.num_kv_heads * lm.spec.head_dim * 4  # the key offsets: float32 per channel
    for stats, tokens in ((g.cache_after_prefill, N), (g.cache_final, N + 5)):
        assert stats["logical_tokens"] == stats["physical_tokens"] == tokens
        assert stats["bytes"] == 2 * layers * 2 * per_token * tokens + offsets  # K and V, 2 layers, batch 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_transformers_generate_matches_kvlabs_loop(lm, fmt):
    p = _policy(fmt)
    ours = generate_text(lm, prompt(), p, 10)
    out = lm.model.generate(prompt(), **{cache_kwarg(lm.model): p.make_cache(lm.model)}, max_new_tokens=10,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out[:, N:], ours.tokens)


def test_evict_then_kvq_keeps_snapkvs_positions_and_stores_them_quantized(lm):
    combined = make_policy("snapkv", keep=0.25, window_size=8, quant={"backend": "kvq", "nbits": 4,
                                                                        "q_group_size": 32, "key_offset": "none"})
    alone = make_policy("snapkv", keep=0.25, window_size=8)
    assert combined.storage() == KVQStorage("int4-g32", alone, "none")
    with combined.attach(lm, warm=False):
        cache, ref = combined.make_cache(lm.model), alone.make_cache(lm.model)
        assert all(type(layer) is EvictingKVQLayer for layer in cache.layers)
        prefill(lm.model, prompt(), cache)
        prefill(lm.model, prompt(), ref)
    for a, b in zip(kept_positions(cache), kept_positions(ref), strict=True):
        assert torch.equal(a, b)
    fmt = parse_format("int4-g32")
    for layer, ref_layer in zip(cache.layers, ref.layers, strict=True):
        assert torch.equal(layer.key_store.dequantize(), fmt.dequantize(fmt.quantize(ref_layer.keys)))
        assert torch.equal(layer.value_store.dequantize(), fmt.dequantize(fmt.quantize(ref_layer.values)))
    stats = cache_stats(cache)
    assert (stats["logical_tokens"], stats["physical_tokens"]) == (N, 25)
    assert stats["bytes"] == 2 * lm.spec.num_layers * fmt.bytes_per_token(lm.spec.num_kv_heads, 32) * 25
    g = generate_text(lm, prompt(), combined, 8)
    assert g.cache_final["logical_tokens"] == N + 7 and g.cache_final["physical_tokens"] == 25 + 7
    with pytest.raises(EvictionError, match="only crop tokens added after"):
        g.cache.crop(-8)
    g.cache.crop(-7)
    assert g.cache.get_seq_length() == N and cache_stats(g.cache)["physical_tokens"] == 25


def test_other_backends_keep_their_evicting_layers(lm):
    pytest.importorskip("optimum.quanto")
    p = make_policy("knorm", keep=0.5, quant={"backend": "quanto", "q_group_size": 32})
    from transformers import cache_utils

    assert type(p.make_cache(lm.model).layers[0]) is evicting_quantized_class(cache_utils.QuantoQuantizedLayer)
    assert type(make_policy("knorm", keep=0.5).make_cache(lm.model).layers[0]) is EvictingLayer


def _both_engines(lm, policy, ids, n_new):
    with policy.attach(lm, warm=False):
        cache = policy.make_cache(lm.model)
        first = prefill(lm.model, ids, cache)[:, -1].argmax(-1)
        ref = greedy_decode(lm.model, cache, first, n_new, ids.shape[1])
        decoder = FastEngine(lm).decoder(policy, ids.shape[0], ids.shape[1], n_new)
        fast_cache = decoder.prefill_cache()
        first_fast = prefill(lm.model, ids, fast_cache)[:, -1].argmax(-1)
        decoder.load(fast_cache)
        return ref, decoder.decode(first_fast, n_new, ids.shape[1]), decoder


@pytest.mark.parametrize("method,params", [
    ("kvq-fp8", {}), ("kvq-int4", {"q_group_size": 32}), ("kvq-int2", {"q_group_size": 32}),
    ("kvq-int4", {"q_group_size": 32, "key_offset": "none"}),
    ("snapkv", {"keep": 0.25, "window_size": 8, "quant": {"backend": "kvq", "nbits": 4, "q_group_size": 32}}),
])
def test_fast_equals_hf_token_for_token(lm, method, params):
    """Both engines hold the same codes (one ``quantize`` per token) and dequantize them to float32;
    hf then attends with SDPA at the model dtype (float32 here), fast with the float32 reference, so
    only the summation order differs. On a bf16 model hf would also round the dequantized values to
    bf16 before attending, and tokens could part where two logits tie within that rounding."""
    policy = make_policy(method, **params)
    ref, fast, decoder = _both_engines(lm, policy, prompt(batch=2, n=64), 24)
    assert decoder.store.kv_format == policy.storage().kv_format and decoder.graph is None
    assert torch.equal(ref, fast)


def test_fast_and_hf_report_the_same_bytes(lm):
    policy = make_policy("kvq-int4", q_group_size=32)
    hf = generate_text(lm, prompt(), policy, 8)
    fast = generate_text(lm, prompt(), policy, 8, engine=FastEngine(lm))
    assert torch.equal(hf.tokens, fast.tokens)
    assert fast.cache_final["bytes"] == hf.cache_final["bytes"]
    assert fast.cache_final["physical_tokens"] == hf.cache_final["physical_tokens"]


@pytest.mark.parametrize("make,match", [
    (lambda: make_policy("kvq-int4", q_group_size=48), "q_group_size=48 is not supported: use one of 32, 64, 128"),
    (lambda: make_policy("kvq-fp8", q_group_size=32), "unknown parameter"),
    (lambda: make_policy("kvq-int4", key_offset="bias"), "key_offset='bias' is not supported by the kvq backend: "
                                                         "use one of prompt-mean, none"),
    (lambda: make_policy("snapkv", quant={"backend": "quanto", "key_offset": "prompt-mean"}),
     "not supported by the quanto backend: use one of none"),
    (lambda: make_policy("kvq-int4", nbits=2), "unknown parameter"),
    (lambda: make_policy("snapkv", quant={"backend": "kvq", "nbits": 8, "q_group_size": 32}), "does not apply"),
    (lambda: make_policy("snapkv", quant={"backend": "kvq", "residual_length": 32}), "do not apply"),
    (lambda: make_policy("snapkv", quant={"backend": "kvq", "nbits": 3}), "use one of 2, 4, 8"),
    (lambda: make_policy("kvq-int4").check(get_spec("tiny-llama")), "head_dim 16 is not a multiple of group 64"),
])
def test_bad_knobs_name_the_fix(make, match):
    with pytest.raises(PolicyError, match=match):
        make()


def test_params_labels_and_fast_formats():
    # the layout without a key offset keeps its params (and so its run ids) and labels
    assert make_policy("kvq-int4", q_group_size=32, key_offset="none").params() == {
        "method": "kvq-int4", "backend": "kvq", "nbits": 4, "q_group_size": 32, "keep": 1.0, "bits": 4}
    assert make_policy("kvq-int4", q_group_size=32).params() == {
        "method": "kvq-int4", "backend": "kvq", "nbits": 4, "q_group_size": 32, "key_offset": "prompt-mean",
        "keep": 1.0, "bits": 4}
    assert make_policy("kvq-fp8").params()["q_group_size"] is None
    assert make_policy("kvq-fp8", key_offset="none").label == "kvq fp8"
    assert make_policy("kvq-fp8").label == "kvq fp8 (keys - prompt-mean)"
    assert make_policy("snapkv", keep=0.25, quant={"backend": "kvq", "key_offset": "none"}).label == \
        "snapkv 25% + kvq int4-g64"
    assert [make_policy(m, key_offset="none").storage().format for m in ("kvq-fp8", "kvq-int4", "kvq-int2")] == \
        ["fp8", "int4-g64", "int2-g64"]
    assert [(make_policy(m).storage().format, make_policy(m).storage().key_offset) for m in ("kvq-fp8", "kvq-int4")] \
        == [("fp8", "prompt-mean"), ("int4-g64", "prompt-mean")]
    assert make_policy("kvq-int4").storage().kv_format == "int4-g64, keys - prompt-mean"
    make_policy("kvq-fp8").check(get_spec("tiny-llama"))  # fp8 needs only head_dim % 16 == 0
