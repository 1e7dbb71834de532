"""kivi-rot: KIVI's store behind the seeded Hadamard rotation (kvlab.storage.rotated_kivi, kvlab.storage.basis).
It holds KIVI's codes of the rotated K/V (the same shapes and bytes as kivi), hands back what the fast
store attends, attends as the unrotated reference over the same dequantized K/V, and generates the
same tokens through hf and fast."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import load_tiny_d32

from kvlab.engine.fast import FastEngine
from kvlab.engine.generation import greedy_decode, prefill
from kvlab.kernels import kivi
from kvlab.kernels import turboquant as tq
from kvlab.models import get_spec
from kvlab.policies import PolicyError, cache_stats, make_policy
from kvlab.storage.base import ModelShape
from kvlab.storage.basis import ModelBasis, RotatedBasis
from kvlab.storage.kivi import KiviLayer, KiviSlotStore

SPEC = kivi.KiviSpec(bits=2, group=16, residual=32, value_group=32)
PARAMS = {"residual_length": 16, "q_group_size": 16, "value_group": 16}  # groups flush in the prompt and in decode


def kv(n=90, heads=2, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, n, dim, generator=gen), torch.randn(1, heads, n, dim, generator=gen)


def test_rotated_queries_and_outputs_are_attention_in_the_model_basis():
    basis = RotatedBasis.seeded(2, 64, 0, "cpu")
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 6, 64, generator=gen), torch.randn(3, 2, 20, 64, generator=gen), torch.randn(3, 2, 20, 64, generator=gen)

    def attend(q, k, v):  # GQA: 3 query heads per KV head
        scores = torch.einsum("bhgd,bhtd->bhgt", q.view(3, 2, 3, 64), k)
        return torch.einsum("bhgt,bhtd->bhgd", scores.softmax(-1), v).reshape(3, 6, 64)

    want = attend(q, k, v)
    got = basis.output(attend(basis.queries(q), basis.stored(k), basis.stored(v)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(basis.read_back(basis.stored(k)), k, rtol=1e-5, atol=1e-5)
    assert torch.equal(basis.matrix, tq.rotations(2, 64, 0))  # the rotations turboquant and kvq-rot use


def test_rotated_layer_is_kivi_of_the_rotated_kv_rotated_back():
    """The reference: KIVI's own store loaded with the rotated K/V, dequantized, rotated back; at every
    length, for single tokens and chunks; the codes have kivi's shapes and bytes."""
    k, v = kv()
    basis = RotatedBasis.seeded(2, 64, 0, "cpu")
    layer = KiviLayer(SPEC, basis=lambda h, d, device: basis)
    plain = KiviLayer(SPEC)
    out = layer.update(k[:, :, :40], v[:, :, :40])
    plain.update(k[:, :, :40], v[:, :, :40])
    assert torch.equal(out[0], k[:, :, :40])  # the prefill attends exactly
    store = kivi.alloc(SPEC, 1, 2, 90, 64)
    kivi.load(store, basis.stored(k[:, :, :40]), basis.stored(v[:, :, :40]))
    t = 40
    for n in (1, 7, 1, 25, 16):
        keys, values = layer.update(k[:, :, t:t + n], v[:, :, t:t + n])
        plain.update(k[:, :, t:t + n], v[:, :, t:t + n])
        for i in range(t, t + n):
            kivi.append(store, basis.stored(k[:, :, i:i + 1]), basis.stored(v[:, :, i:i + 1]), torch.tensor([i]))
        t += n
        want_k, want_v = (basis.read_back(x) for x in kivi.dequantize(store, t))
        assert torch.equal(keys, want_k) and torch.equal(values, want_v), t
        assert layer.quantized == plain.quantized == SPEC.quantized_tokens(t)
        assert [[c.shape for c in group] for group in layer.codes] == [[c.shape for c in group] for group in plain.codes]
        assert layer.nbytes() == plain.nbytes()
    assert layer.codes  # groups were flushed
    ring = t - layer.quantized  # the ring is exact up to bf16 in the rotated basis
    torch.testing.assert_close(keys[:, :, -ring:], k[:, :, t - ring:t], rtol=0, atol=0.02)


def test_rotation_lowers_the_value_error_of_an_outlier_coordinate():
    """Values with one loud coordinate per token: per-token groups of 32 take its range; the rotation
    spreads it over the head (the reason to rotate). Keys per channel do not care (their channels'
    ranges are their own either way), so only the values' error is asserted."""
    k, v = kv(n=160)
    v[..., 5] = v[..., 5] * 20
    errors = {}
    for name, basis in (("plain", ModelBasis()), ("rot", RotatedBasis.seeded(2, 64, 0, "cpu"))):
        layer = KiviLayer(SPEC, basis=lambda h, d, device, b=basis: b)
        layer.update(k[:, :, :150], v[:, :, :150])
        _, values = layer.update(k[:, :, 150:151], v[:, :, 150:151])
        nq = layer.quantized
        errors[name] = ((values[:, :, :nq] - v[:, :, :nq]).norm() / v[:, :, :nq].norm()).item()
    assert errors["rot"] < 0.8 * errors["plain"], errors


@pytest.fixture(scope="module")
def tiny32():
    return load_tiny_d32()


@pytest.mark.parametrize("params", [PARAMS, {"key_bits": 4, "residual_length": 32}])
def test_fast_equals_hf_token_for_token_with_kivis_bytes(tiny32, params):
    model = tiny32.model
    prompt = torch.randint(3, 500, (2, 100), generator=torch.Generator().manual_seed(1))
    stats = {}
    for method in ("kivi-rot", "kivi"):
        policy = make_policy(method, **params)
        with policy.attach(tiny32, warm=False):
            cache = policy.make_cache(model)
            first = prefill(model, prompt, cache)[:, -1].argmax(-1)
            ref = greedy_decode(model, cache, first, 24, 100)
            decoder = FastEngine(tiny32).decoder(policy, 2, 100, 24)
            prefilled = decoder.prefill_cache()
            first = prefill(model, prompt, prefilled)[:, -1].argmax(-1)
            decoder.load(prefilled)
            fast = decoder.decode(first, 24, 100)
        assert torch.equal(ref, fast), (method, (ref != fast).nonzero()[:1].tolist())
        assert isinstance(decoder.store, KiviSlotStore)
        stats[method] = (cache_stats(cache)["bytes"], decoder.stats(24)["bytes"], decoder.columns()["kv_format"])
    assert stats["kivi-rot"][:2] == stats["kivi"][:2] and stats["kivi-rot"][0] == stats["kivi-rot"][1]
    assert stats["kivi-rot"][2] == "rot-" + stats["kivi"][2]


def test_kivi_rot_labels_params_and_checks():
    rot, plain = make_policy("kivi-rot", key_bits=4), make_policy("kivi", key_bits=4)
    assert rot.label == "kivi-rot k4v2" and plain.label == "kivi k4v2" and rot.bits == plain.bits == 3
    assert "seed" not in plain.params() and rot.params()["seed"] == 0
    assert rot.storage().token_bytes(2, 128) == plain.storage().token_bytes(2, 128)
    with pytest.raises(PolicyError, match="seed must be >= 0"):
        make_policy("kivi-rot", seed=-1)
    spec = get_spec("qwen2.5-coder-1.5b")
    with pytest.raises(PolicyError, match="power-of-two head_dim, and .* 96: use kivi"):
        rot.storage().check(ModelShape(replace(spec, head_dim=96), ("full_attention",) * spec.num_layers), False)
    rot.storage().check(ModelShape(spec, ("full_attention",) * spec.num_layers), False)
