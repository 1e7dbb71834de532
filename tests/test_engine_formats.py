"""One storage format, two engines (issue #28): ``hf`` (``KVQLayer``: dequantize the store to the
model dtype, then transformers' SDPA) and ``fast`` (``QuantizedStore``: the codes read by the
kernels; on CPU their float32 reference) store the same codes and differ only in the arithmetic of
attention over them.

What is pinned, and why these tolerances:
- the codes: the prompt's codes, scales and zeros are equal bit for bit on both engines in bfloat16,
  and so are the fed tokens' codes in the first layer (its K/V come before any attention);
- attention over the same codes: each path's error against float64 attention over those codes is
  a small fraction of the format's own error (the fast reference's is the bf16 rounding of its
  output; hf's is about twice that: the dequantized values rounded to bf16 and SDPA in bf16);
- the logits in bfloat16: the engines disagree by a share of what the format itself moves them,
  and hf fed token by token (``feed="stepwise"``) agrees with hf fed in one forward.
Past the first layer the fed tokens' codes are not compared: a 1-ulp difference in a K/V element
that sits near a rounding boundary moves it by a whole quantization step, and such flips grow layer
by layer on any two implementations (SmolLM2 at 1k, reports/cpu-quality-engines-2026-12-05); the
slow SmolLM2 test checks that fast flips no more codes against hf than hf's own two feeds do.
"""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import load_tiny_d32

from kvlab.engine.engines import make_engine
from kvlab.engine.generation import prefill
from kvlab.kernels import decode_attention
from kvlab.policies import make_policy
from kvlab.storage.kvq import KVQLayer

METHODS = ["kvq-int4", "kvq-fp8"]


@pytest.fixture(scope="module")
def lm16():
    """The tiny model in bfloat16 with weights drawn 5x wider than the config's init: at 0.02 its
    attention barely reaches the logits, and the format's effect stays under their bf16 rounding."""
    return load_tiny_d32(torch.bfloat16, init_range=0.1)


def _policy(method):
    return make_policy(method, q_group_size=32) if method.startswith("kvq-int") else make_policy(method)


def ids(n, seed, vocab=500):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def fed_decoder(loaded, engine, policy, context, fed):
    """A decoder of ``engine`` (a name or an engine) after ``context`` was prefilled and ``fed`` fed;
    its logits for ``fed``."""
    engine = make_engine(engine, loaded) if isinstance(engine, str) else engine
    cache = engine.storage_policy(policy).make_cache(loaded.model)
    prefill(loaded.model, context, cache)
    decoder = engine.decoder_for_cache(policy, cache, fed.shape[1])
    with torch.no_grad():
        return decoder, decoder.feed(fed, context.shape[1])


def stored(decoder, layer: int, tokens: int) -> list[torch.Tensor]:
    """A layer's codes, scales and zeros of its first ``tokens`` slots (K then V), as raw bits."""
    if decoder.cache is not None:
        cache_layer = decoder.cache.layers[layer]
        stores = (cache_layer.key_store, cache_layer.value_store)
    else:
        stores = (decoder.store.keys[layer], decoder.store.values[layer])
    return [t[:, :, :tokens].contiguous().view(torch.uint8) for s in stores for t in s.tensors()]


@pytest.mark.parametrize("method", METHODS)
def test_both_engines_store_the_same_codes(lm16, method):
    policy = _policy(method)
    context, fed = ids(96, 1), ids(10, 2)
    n = context.shape[1]
    with policy.attach(lm16, warm=False):
        hf, _ = fed_decoder(lm16, "hf", policy, context, fed)
        fast, _ = fed_decoder(lm16, "fast", policy, context, fed)
    for layer in range(lm16.model.config.num_hidden_layers):
        for a, b in zip(stored(hf, layer, n), stored(fast, layer, n), strict=True):
            assert torch.equal(a, b), f"layer {layer}: the prompt's stored bits differ"
    for a, b in zip(stored(hf, 0, n + fed.shape[1]), stored(fast, 0, n + fed.shape[1]), strict=True):
        assert torch.equal(a, b), "layer 0: the fed tokens' stored bits differ"


def synthetic_qkv(seed, n=600, kv_heads=3, dim=64):
    """bf16 q/K/V of one decode step, keys with an outlier channel as SmolLM2's have
    (reports/cpu-quality-kvq-2026-12-03)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, kv_heads, n, dim, generator=g)
    k[..., 5] *= 12
    v = torch.randn(1, kv_heads, n, dim, generator=g)
    q = 1.5 * torch.randn(1, 3 * kv_heads, 1, dim, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def exact_attention(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    return (torch.softmax(q.double() @ k.transpose(-1, -2) * scale, -1) @ v)[:, :, 0]


# hf's error as a fraction of the format's own: measured 0.6-1.8% for int4-g64 and 6-12% for fp8
# (these inputs and SmolLM2's own q/K/V); the bounds leave room above both.
HF_SHARE = {"int4-g64": 0.04, "fp8": 0.2}


@pytest.mark.parametrize("kv_format", sorted(HF_SHARE))
@pytest.mark.parametrize("seed", [0, 1])
def test_each_path_attends_the_codes_within_a_fraction_of_the_formats_error(kv_format, seed):
    q, k, v = synthetic_qkv(seed)
    scale = 0.125
    layer = KVQLayer(kv_format)
    layer.update(k[:, :, :-1], v[:, :, :-1])  # the prompt
    keys, values = layer.update(k[:, :, -1:], v[:, :, -1:])  # a decode step: the store, dequantized
    assert keys.dtype == values.dtype == torch.bfloat16
    hf = F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)[:, :, 0]
    lengths = torch.tensor([k.shape[2]], dtype=torch.int32)
    fast = decode_attention(q[:, :, 0].contiguous(), layer.key_store, layer.value_store, lengths, scale)
    assert fast.dtype == torch.float32  # the CPU reference: float32 throughout
    truth = exact_attention(q, layer.key_store.dequantize(), layer.value_store.dequantize(), scale)
    format_error = (truth - exact_attention(q, k, v, scale)).norm()

    def share(out):
        return float((out.double() - truth).norm() / format_error)

    floor = share(truth.to(torch.bfloat16))  # rounding the exact output to the model dtype
    assert share(fast.to(torch.bfloat16)) <= 1.01 * floor + 1e-6
    assert share(hf) <= HF_SHARE[kv_format], (share(hf), floor)


# mean |logit difference| as a share of the format's own effect (mean |hf - exact cache|), on lm16.
# hf fed stepwise against hf batched: measured 0.02-0.11 (same attention arithmetic, same codes
# before the fed tokens); a chunk that attended its own exact K/V instead measured 0.3-0.5.
# fast against hf: measured 0.10 for int4 and 0.25-0.43 for fp8. The engines round differently
# (float32 attention against bf16 dequantized values and SDPA); in the fed tokens' second layer
# that flips codes, and an fp8 code step (1/16 relative) is as large as fp8's own error.
SELF_SHARE = 0.2
FAST_SHARE = {"kvq-int4": 0.2, "kvq-fp8": 0.6}


@pytest.mark.parametrize("method", METHODS)
def test_bf16_logits_agree_within_a_share_of_the_formats_effect(lm16, method):
    policy = _policy(method)
    context, fed = ids(96, 3), ids(16, 4)
    with policy.attach(lm16, warm=False):
        _, hf = fed_decoder(lm16, "hf", policy, context, fed)
        _, stepwise = fed_decoder(lm16, make_engine("hf", lm16, feed="stepwise"), policy, context, fed)
        _, fast = fed_decoder(lm16, "fast", policy, context, fed)
        _, exact = fed_decoder(lm16, "hf", make_policy("full"), context, fed)

    def mean_gap(a, b):
        return float((a - b).abs().mean())

    effect = mean_gap(hf, exact)
    assert mean_gap(stepwise, hf) <= SELF_SHARE * effect, (mean_gap(stepwise, hf), effect)
    assert mean_gap(fast, hf) <= FAST_SHARE[method] * effect, (mean_gap(fast, hf), effect)


def test_hf_stepwise_feed_is_batched_feed_one_token_at_a_time():
    lm = load_tiny_d32()
    policy = make_policy("full")
    context, fed = ids(40, 5), ids(6, 6)
    with policy.attach(lm, warm=False):
        _, batched = fed_decoder(lm, "hf", policy, context, fed)
        _, stepwise = fed_decoder(lm, make_engine("hf", lm, feed="stepwise"), policy, context, fed)
    assert stepwise.shape == batched.shape
    assert torch.allclose(stepwise, batched, atol=1e-5)
    with pytest.raises(ValueError, match="stepwise"):
        make_engine("hf", lm, feed="one by one")


@pytest.fixture(scope="module")
def smollm2_bf16():
    from kvlab.models import load_model

    return load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)


def fed_bytes_differing(a, b, layer: int, start: int, end: int) -> int:
    """Stored bytes (codes, scales, zeros; K and V) of slots ``start:end`` that differ in ``layer``."""
    return sum(int((x[:, :, start:] != y[:, :, start:]).sum())
               for x, y in zip(stored(a, layer, end), stored(b, layer, end), strict=True))


@pytest.mark.slow(reason="real SmolLM2 weights in bfloat16: a 512-token needle item through hf, hf fed "
                         "stepwise and fast, per storage format")
@pytest.mark.parametrize("method", ["kvq-int4", "kvq-fp8"])
def test_smollm2_fast_flips_no_more_codes_against_hf_than_hf_against_itself(smollm2_bf16, method):
    """On SmolLM2 the fed tokens' codes flip from the second layer on between any two feeds (at 1k,
    about half of their bytes by the last layer, reports/cpu-quality-engines-2026-12-05): what must
    hold is that fast's codes are no further from hf's than hf's own stepwise feed is. Summed over
    the layers at 1k, fast differed from hf by 1.01x (int4) and 1.03x (fp8) the bytes hf1 did."""
    from kvlab.quality.spec import TaskSpec, build_items
    from kvlab.tasks import Encoder

    loaded = smollm2_bf16
    item = build_items(TaskSpec(tasks=["niah_single"], lengths=[512], depths=[0.5], samples=1),
                       Encoder(loaded.tokenizer), loaded.spec.max_context)[0]
    context = torch.tensor([item.context_ids])
    fed = torch.tensor([list(item.question_ids) + list(item.answer_ids[:-1])])
    n, end = context.shape[1], context.shape[1] + fed.shape[1]
    policy = make_policy(method)
    with policy.attach(loaded, warm=False):
        hf, _ = fed_decoder(loaded, "hf", policy, context, fed)
        stepwise, _ = fed_decoder(loaded, make_engine("hf", loaded, feed="stepwise"), policy, context, fed)
        fast, _ = fed_decoder(loaded, "fast", policy, context, fed)
    layers = range(loaded.model.config.num_hidden_layers)
    for layer in layers:
        for a, b in zip(stored(hf, layer, n), stored(fast, layer, n), strict=True):
            assert torch.equal(a, b), f"layer {layer}: the prompt's stored bits differ"
    assert fed_bytes_differing(hf, fast, 0, n, end) == 0
    own = sum(fed_bytes_differing(hf, stepwise, layer, n, end) for layer in layers)
    engines = sum(fed_bytes_differing(hf, fast, layer, n, end) for layer in layers)
    assert engines <= 2 * own, (engines, own)
