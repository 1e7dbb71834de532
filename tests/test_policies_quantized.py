"""Quantized caches (quanto, HQQ, FP8) and evict-then-quantize on a tiny random Llama."""

import math

import pytest
import torch
from packaging.version import Version

from kvlab.budget import cache_bytes
from kvlab.engine.engines import generate_text
from kvlab.engine.generation import cache_kwarg, prefill
from kvlab.models import load_model
from kvlab.policies import EvictionError, cache_stats, kept_positions, make_policy
from kvlab.policies.quantized.storage import FP8_MIN_TRANSFORMERS, installed_version

N = 100
G = 16  # tiny-llama's head_dim: the group size has to divide it


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama", weights="synthetic", seed=0)


def prompt(batch=1, n=N, seed=1):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


needs_fp8 = pytest.mark.skipif(Version(installed_version("transformers")) < Version(FP8_MIN_TRANSFORMERS),
                               reason="transformers < 5.21 has no fp8 cache")
QUANTIZED = [("quanto", {"nbits": 4, "q_group_size": G}), ("quanto", {"nbits": 2, "q_group_size": G}),
             ("hqq", {"nbits": 4, "q_group_size": G}), pytest.param("fp8", {}, marks=needs_fp8)]


@pytest.mark.parametrize("method,params", QUANTIZED)
def test_quantized_cache_generates_with_both_loops(lm, method, params):
    p = make_policy(method, **params)
    p.check(lm)
    p.warmup(lm)
    ours = generate_text(lm, prompt(), p, 10)
    assert ours.tokens.shape == (1, 10)
    stats = ours.cache_after_prefill
    assert stats["logical_tokens"] == stats["physical_tokens"] == N
    cache = p.make_cache(lm.model)
    out = lm.model.generate(prompt(), **{cache_kwarg(lm.model): cache}, max_new_tokens=10, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    assert torch.equal(out[:, N:], ours.tokens)


@pytest.mark.parametrize("method,params", QUANTIZED)
def test_quantized_bytes_after_prefill_match_the_budget(lm, method, params):
    """After prefill transformers holds no residual: every token is packed (plus scales)."""
    p = make_policy(method, **params)
    cache = p.make_cache(lm.model)
    prefill(lm.model, prompt(batch=2), cache)
    got = cache_stats(cache)["bytes"]
    if method == "fp8":  # per-tensor: one float32 scale per K and V tensor
        assert got == cache_bytes(lm.spec, N, batch=2, bits=8, group_size=None, residual=0) + 2 * 2 * 4
    else:
        bits = params["nbits"]
        assert got == cache_bytes(lm.spec, N, batch=2, bits=bits, group_size=G, residual=0)
        assert got <= cache_bytes(lm.spec, N, batch=2, bits=bits, group_size=G, residual=128)
    assert got < cache_bytes(lm.spec, N, batch=2, bits=32)


def test_evict_then_quantize(lm):
    """SnapKV keep 0.25 + quanto int4: the same positions as SnapKV alone, stored packed."""
    combined = make_policy("snapkv", keep=0.25, window_size=8, quant={"backend": "quanto", "nbits": 4,
                                                                        "q_group_size": G, "residual_length": 8})
    alone = make_policy("snapkv", keep=0.25, window_size=8)
    cache, ref = combined.make_cache(lm.model), alone.make_cache(lm.model)
    prefill(lm.model, prompt(), cache)
    prefill(lm.model, prompt(), ref)
    for a, b in zip(kept_positions(cache), kept_positions(ref), strict=True):
        assert torch.equal(a, b)
    k = math.floor(N * 0.25)
    stats = cache_stats(cache)
    assert (stats["logical_tokens"], stats["physical_tokens"]) == (N, k)
    assert stats["bytes"] == cache_bytes(lm.spec, N, bits=4, group_size=G, residual=0, keep=0.25)
    for layer, ref_layer in zip(cache.layers, ref.layers, strict=True):
        dequant = layer._dequantize(layer._quantized_keys)
        assert dequant.shape == ref_layer.keys.shape
        assert (dequant - ref_layer.keys).abs().max() < 0.5 * ref_layer.keys.abs().max()

    # decode past two residual flushes (residual_length 8): logical and physical stay right
    g = generate_text(lm, prompt(), combined, 20)
    assert g.cache_final["logical_tokens"] == N + 19 and g.cache_final["physical_tokens"] == k + 19
    out = lm.model.generate(prompt(), **{cache_kwarg(lm.model): combined.make_cache(lm.model)},
                            max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out[:, N:], g.tokens)


@pytest.mark.parametrize("backend", ["quanto", "hqq", pytest.param("fp8", marks=needs_fp8)])
def test_keep_one_then_quantize_equals_plain_quantized(lm, backend):
    quant = {"backend": backend} if backend == "fp8" else {"backend": backend, "q_group_size": G}
    plain = make_policy(backend, **({} if backend == "fp8" else {"q_group_size": G}))
    combined = make_policy("knorm", keep=1.0, quant=quant)
    a, b = generate_text(lm, prompt(), plain, 12), generate_text(lm, prompt(), combined, 12)
    assert torch.equal(a.tokens, b.tokens)
    assert a.cache_final["bytes"] == b.cache_final["bytes"]


@pytest.mark.parametrize("method", ["tova", "streamingllm", "pyramidkv"])
def test_other_methods_evict_then_quantize(lm, method):
    extra = {"window_size": 8} if method == "pyramidkv" else {}
    p = make_policy(method, keep=0.5, quant={"backend": "hqq", "nbits": 4, "q_group_size": G}, **extra)
    g = generate_text(lm, prompt(), p, 6)
    assert g.cache_after_prefill["physical_tokens"] == 50
    assert g.cache_after_prefill["bytes"] == pytest.approx(
        cache_bytes(lm.spec, N, bits=4, group_size=G, residual=0, keep=0.5), rel=0.05)


def test_quantized_caches_are_fresh_and_not_croppable(lm):
    p = make_policy("snapkv", keep=0.5, window_size=8, quant={"backend": "quanto", "q_group_size": G})
    a, b = p.make_cache(lm.model), p.make_cache(lm.model)
    assert a is not b and a.layers[0] is not b.layers[0]
    prefill(lm.model, prompt(), a)
    with pytest.raises(EvictionError, match="cannot be cropped"):
        a.crop(-1)


def test_inference_mode_works(lm):
    for method, params in QUANTIZED[:1] + [("snapkv", {"keep": 0.5, "window_size": 8,
                                                       "quant": {"backend": "quanto", "q_group_size": G}})]:
        p = make_policy(method, **params)
        cache = p.make_cache(lm.model)
        with torch.inference_mode():
            prefill(lm.model, prompt(), cache)
            prefill(lm.model, prompt(n=1), cache)
        assert cache.get_seq_length() == N + 1


HAS_FP8 = Version(installed_version("transformers")) >= Version(FP8_MIN_TRANSFORMERS)


@pytest.mark.skipif(not HAS_FP8, reason=f"fp8 needs transformers >= {FP8_MIN_TRANSFORMERS}")
def test_fp8_saturates_tokens_beyond_the_prefill_scale(lm, monkeypatch):
    """The scale is frozen at prefill; a louder token later must saturate at +-448, not overflow."""
    from kvlab.policies.quantized.storage import saturating_fp8_layer_class

    cache = make_policy("fp8").make_cache(lm.model)
    assert all(type(layer) is saturating_fp8_layer_class() for layer in cache.layers)
    layer = saturating_fp8_layer_class()()
    monkeypatch.setattr(layer, "fp8_dtype", torch.float32)  # keep the values that reach the cast
    ones = torch.ones(1, 1, 4, 8)
    layer.update(ones, ones)
    layer.update(-10 * ones[:, :, :1], 10 * ones[:, :, :1])
    keys, key_scale = layer._quantized_keys
    values, _ = layer._quantized_values
    assert key_scale.item() == pytest.approx(1 / layer.fp8_max)
    m = layer.fp8_max  # unclamped, the loud token would reach 10 * 448
    torch.testing.assert_close(keys, torch.tensor([m] * 4 + [-m]).view(1, 1, 5, 1).expand(1, 1, 5, 8))
    torch.testing.assert_close(values.amax(), torch.tensor(m))


def test_quanto_cpu_build_is_pending_until_its_build_folder_has_a_version_file(monkeypatch, tmp_path):
    from types import SimpleNamespace

    import optimum.quanto.library.extensions as quanto_ext

    from kvlab.policies.quantized.storage import quanto_cpu_build_pending

    monkeypatch.setattr(quanto_ext, "get_extension", lambda name: SimpleNamespace(build_directory=str(tmp_path)))
    assert quanto_cpu_build_pending()  # a fresh install: quanto will compile on the first CPU run
    (tmp_path / "pytorch_version.txt").write_text("2.13.0")
    assert not quanto_cpu_build_pending()
