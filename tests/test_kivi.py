"""The KIVI-style store's torch reference (kvlab.kernels.kivi): round trip, append at group boundaries,
attention against dense SDPA, and the per-channel keys against kvlab's per-token int2 on outlier channels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab.kernels import kivi, make_format
from kvlab.kernels.formats import FormatError

SPEC = kivi.KiviSpec(bits=2, group=16, residual=32, value_group=32)


def kv(batch=2, heads=2, n=150, dim=64, seed=0, outlier=None):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, heads, n, dim, generator=gen)
    v = torch.randn(batch, heads, n, dim, generator=gen)
    if outlier is not None:  # a channel large in every token, as KIVI found in real keys
        k[..., outlier] = k[..., outlier] * 4 + 15
    return k, v


def test_boundary_is_a_function_of_length():
    s = kivi.KiviSpec(group=32, residual=128)
    assert [s.quantized_tokens(n) for n in (0, 128, 159, 160, 191, 192, 1000)] == [0, 0, 0, 32, 32, 64, 864]
    for n in range(0, 400):  # the ring always holds R <= r < R + G once there are R tokens
        r = n - s.quantized_tokens(n)
        assert (r == n) if n < s.window else (s.residual <= r < s.window)
    assert kivi.KiviSpec().group == 32 and kivi.KiviSpec().residual == 128
    assert kivi.KiviSpec().label == "kivi2-g32-r128" and kivi.KiviSpec(key_bits=4).label == "kivi-k4v2-g32-r128"


def test_bad_spec_and_head_dim():
    with pytest.raises(FormatError):
        kivi.KiviSpec(bits=3)
    with pytest.raises(FormatError):
        kivi.alloc(SPEC, 1, 1, 64, 48)  # not a multiple of the value group


@pytest.mark.parametrize("bits,key_bits", [(2, None), (4, None), (2, 4)])
def test_round_trip_within_half_a_step(bits, key_bits):
    spec = kivi.KiviSpec(bits=bits, group=16, residual=32, value_group=32, key_bits=key_bits)
    k, v = (x.bfloat16().float() for x in kv())  # the store quantizes the bf16 values
    n = k.shape[2]
    store = kivi.alloc(spec, 2, 2, n, 64)
    kivi.load(store, k, v)
    keys, values = kivi.dequantize(store, n)
    nq = spec.quantized_tokens(n)
    kscale = store.k_scale[:, :, :nq // spec.group].float().repeat_interleave(spec.group, dim=2)
    assert ((keys[:, :, :nq] - k[:, :, :nq]).abs() <= kscale / 2 + 1e-5).all()
    vscale = store.v_scale[:, :, :nq].float().repeat_interleave(spec.value_group, dim=-1)
    assert ((values[:, :, :nq] - v[:, :, :nq]).abs() <= vscale / 2 + 1e-5).all()
    # the ring is exact up to bf16
    torch.testing.assert_close(keys[:, :, nq:], k[:, :, nq:].bfloat16().float(), rtol=0, atol=0)
    torch.testing.assert_close(values[:, :, nq:], v[:, :, nq:].bfloat16().float(), rtol=0, atol=0)


@pytest.mark.parametrize("start", [0, 47, 70])
def test_append_matches_loading_everything(start):
    """Appending one token at a time (graph-safe flush) stores exactly what loading the whole prefix
    stores, at every length, across group boundaries."""
    k, v = kv(n=120)
    store = kivi.alloc(SPEC, 2, 2, 120, 64)
    kivi.load(store, k[:, :, :start], v[:, :, :start])
    for t in range(start, 120):
        kivi.append(store, k[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([t]))
        ref = kivi.alloc(SPEC, 2, 2, 120, 64)
        kivi.load(ref, k[:, :, :t + 1], v[:, :, :t + 1])
        for got, want in zip(kivi.dequantize(store, t + 1), kivi.dequantize(ref, t + 1), strict=True):
            assert torch.equal(got, want), f"length {t + 1}"
    assert store.spec.quantized_tokens(120) == 80


def test_append_flushes_only_full_groups():
    k, v = kv(batch=1, heads=1, n=49)
    store = kivi.alloc(SPEC, 1, 1, 64, 64)
    kivi.load(store, k[:, :, :47], v[:, :, :47])
    assert not store.k_scale[:, :, 0].any()  # 47 < R + G: nothing quantized yet
    kivi.append(store, k[:, :, 47:48], v[:, :, 47:48], torch.tensor([47]))
    assert store.k_scale[:, :, 0].any()  # 48 = R + G: tokens 0..15 became group 0
    before = store.k_scale.clone()
    kivi.append(store, k[:, :, 48:49], v[:, :, 48:49], torch.tensor([48]))
    assert torch.equal(store.k_scale[:, :, :-1], before[:, :, :-1])  # only the trash group may change


def sdpa(q, k, v, scale):
    batch, hq, d = q.shape
    g = hq // k.shape[1]
    out = F.scaled_dot_product_attention(q.view(batch, k.shape[1], g, d), k, v, scale=scale)
    return out.reshape(batch, hq, d)


def test_attend_is_exact_attention_over_what_is_stored():
    k, v = kv(n=150)
    store = kivi.alloc(SPEC, 2, 2, 150, 64)
    kivi.load(store, k, v)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3))
    keys, values = kivi.dequantize(store, 150)
    torch.testing.assert_close(kivi.attend(q, store, torch.tensor([150, 150]), 0.125), sdpa(q, keys, values, 0.125))
    # short enough to sit wholly in the ring: the full cache's attention (up to bf16)
    short = kivi.alloc(SPEC, 2, 2, 40, 64)
    kivi.load(short, k[:, :, :40], v[:, :, :40])
    torch.testing.assert_close(kivi.attend(q, short, torch.tensor([40, 40]), 0.125),
                               sdpa(q, k[:, :, :40], v[:, :, :40], 0.125), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bits,tol", [(4, 0.15), (2, 0.6)])
def test_attend_close_to_dense(bits, tol):
    """Within the quantization error: no worse than kvlab's per-token format of the same bits (the
    outputs of random K/V are small averages, hence the loose relative bounds)."""
    spec = kivi.KiviSpec(bits=bits, group=16, residual=32, value_group=32)
    k, v = kv(n=200)
    store = kivi.alloc(spec, 2, 2, 200, 64)
    kivi.load(store, k, v)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(4))
    want = sdpa(q, k, v, 0.125)
    error = (kivi.attend(q, store, torch.tensor([200, 200]), 0.125) - want).norm() / want.norm()
    fmt = make_format(f"int{bits}", 32)
    per_token = sdpa(q, fmt.quantize(k).dequantize(), fmt.quantize(v).dequantize(), 0.125)
    assert error < min(tol, (per_token - want).norm() / want.norm())


def test_per_channel_keys_beat_per_token_int2_on_an_outlier_channel():
    """A channel that is large in every token stretches every per-token group's range (kvq-int2), but
    only its own per-channel range in KIVI."""
    k, v = kv(n=544, outlier=5, seed=1)
    spec = kivi.KiviSpec(bits=2, group=32, residual=128, value_group=32)
    store = kivi.alloc(spec, 2, 2, 544, 64)
    kivi.load(store, k, v)
    nq = spec.quantized_tokens(544)
    assert nq == 416
    keys, values = kivi.dequantize(store, 544)
    int2 = make_format("int2", 32)
    per_token = int2.quantize(k).dequantize()
    kivi_err = (keys[:, :, :nq] - k[:, :, :nq]).norm() / k[:, :, :nq].norm()
    int2_err = (per_token[:, :, :nq] - k[:, :, :nq]).norm() / k[:, :, :nq].norm()
    assert kivi_err < 0.5 * int2_err, (kivi_err, int2_err)
    # and attention: KIVI (with its exact ring) against int2 everywhere
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(5))
    want = sdpa(q, k, v, 0.125)
    kivi_out = kivi.attend(q, store, torch.tensor([544, 544]), 0.125)
    int2_out = sdpa(q, per_token, int2.quantize(v).dequantize(), 0.125)
    assert (kivi_out - want).norm() < 0.5 * (int2_out - want).norm()


def test_rows_view_writes_through():
    k, v = kv(n=80)
    store = kivi.alloc(SPEC, 2, 2, 80, 64)
    kivi.load(store.rows(slice(1, 2)), k[1:], v[1:])
    keys, _ = kivi.dequantize(store, 80)
    assert not keys[0].any() and keys[1].any()
