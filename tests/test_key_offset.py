"""The per-channel key offset of the per-token key stores (kvlab.kernels.key_offset): the hf layer and
the write paths (torch reference, Triton write kernel under the interpreter) store ``k - m`` with the
offset fitted on the prompt, attention is unchanged by it, and it rescues keys with outlier channels."""

from __future__ import annotations

import os

import pytest
import torch

from kvlab.kernels import FormatError, make_format, parse_format, quantize_write
from kvlab.kernels.key_offset import KEY_OFFSETS, shifted
from kvlab.storage.kvq import KVQLayer


def outlier_keys(batch=2, heads=2, n=40, dim=64, seed=0):
    """Keys with a few near-constant loud channels (as Qwen2's k_proj bias gives), and values."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, heads, n, dim, generator=g)
    k[..., dim - 6:] += torch.linspace(-350, 300, 6)  # constant offsets, +- 1 noise on top
    return k, torch.randn(batch, heads, n, dim, generator=g)


def attend(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / k.shape[-1] ** 0.5, -1) @ v


def test_prompt_mean_is_the_channel_mean_and_none_stores_keys_as_they_are():
    k, _ = outlier_keys()
    m = KEY_OFFSETS["prompt-mean"].fit(k)
    assert m.shape == (2, 2, 64) and m.dtype == torch.float32 and torch.allclose(m, k.mean(-2))
    assert KEY_OFFSETS["none"].fit(k) is None and shifted(k, None) is k


@pytest.mark.parametrize("fmt", ["int4-g32", "fp8", "int2-g32"])
def test_layer_stores_keys_minus_the_prompts_mean_and_attention_does_not_see_it(fmt):
    f = parse_format(fmt)
    k, v = outlier_keys()
    k1, v1 = k[:, :, -1:] + 0.5, v[:, :, -1:]  # a decode-time append, quantized with the prompt's offset
    layer = KVQLayer(fmt, key_offset="prompt-mean")
    assert layer.update(k, v)[0] is k  # the prefill attends exactly
    keys, values = layer.update(k1, v1)
    m = k.mean(-2, keepdim=True)
    assert torch.equal(layer.key_offset, k.mean(-2))
    assert torch.equal(keys, f.dequantize(f.quantize(torch.cat([k, k1], 2) - m)))  # fixed at prefill
    assert torch.equal(values, f.dequantize(f.quantize(torch.cat([v, v1], 2))))  # values as before
    q = torch.randn(2, 2, 3, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4
    keys, values, m = keys.double(), values.double(), m.double()  # float64: no rounding of keys + 350
    torch.testing.assert_close(attend(q, keys, values), attend(q, keys + m, values), atol=1e-9, rtol=1e-9)
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.key_offset, k[1:].mean(-2))
    layer.reset()
    assert layer.key_offset is None


@pytest.mark.parametrize("fmt,gain", [("int4-g64", 5), ("fp8", 3), ("int2-g64", 1.3)])
def test_offset_rescues_keys_with_outlier_channels(fmt, gain):
    """Attention output error with and without the offset on keys whose loud channels are constant."""
    f = parse_format(fmt)
    k, v = outlier_keys()
    q = torch.randn(2, 2, 8, 64, generator=torch.Generator().manual_seed(4))
    q[..., -6:] *= 10  # queries that read the loud channels, as Qwen's layer 0 does
    exact = attend(q, k, v)
    errors = {}
    for rule in ("none", "prompt-mean"):
        m = KEY_OFFSETS[rule].fit(k)
        kq = f.dequantize(f.quantize(shifted(k, m)))
        errors[rule] = float((attend(q, kq, v) - exact).norm() / exact.norm())
    assert errors["prompt-mean"] * gain < errors["none"], errors


def test_write_with_an_offset_is_the_write_of_the_shifted_keys():
    fmt = make_format("int4", group=32)
    k, _ = outlier_keys(n=5)
    want, got = (fmt.alloc(2, 2, 8, 64) for _ in range(2))
    m = k.mean(-2)
    slots = torch.tensor([0, 3, 1, 7, 2])
    fmt.write(want, k - m.unsqueeze(-2), slots)
    quantize_write(got, k, slots, offset=m)
    assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors(), strict=True))
    with pytest.raises(FormatError, match="offset must be a contiguous float32"):
        quantize_write(got, k, slots, offset=m[:, :1])


triton = pytest.importorskip("triton") if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available() \
    else None


@pytest.mark.skipif(triton is None, reason="no GPU and TRITON_INTERPRET is not 1")
@pytest.mark.parametrize("name,group", [("int4", 64), ("int2", 32), ("fp8", None)])
def test_write_kernel_subtracts_the_offset_as_the_reference_does(name, group):
    """The Triton write kernel (interpreted on CPU: bit for bit) subtracts the offset in float32, for a
    whole store and for a row slice of it (the fast engine's row-group prefill)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fmt = make_format(name, group=group)
    k, _ = outlier_keys(batch=3, n=4)
    k = k.to(device)
    m = k[:, :, :3].mean(-2).contiguous()
    positions = torch.tensor([[1, 5, 0, 2], [2, 3, 4, 7], [6, 0, 1, 3]], device=device)
    want, got = (fmt.alloc(3, 2, 8, 64, device=device) for _ in range(2))
    quantize_write(want, k, positions, backend="reference", offset=m)
    quantize_write(got, k, positions, backend="triton", offset=m)
    allowed = 0 if device == "cpu" else 4
    assert sum(int((a != b).sum()) for a, b in zip(got.tensors(), want.tensors(), strict=True)) <= allowed
    part_want, part_got = (fmt.alloc(3, 2, 8, 64, device=device) for _ in range(2))
    slots = torch.arange(4, device=device)
    quantize_write(part_want.rows(slice(1, 3)), k[1:], slots, backend="reference", offset=m[1:])
    quantize_write(part_got.rows(slice(1, 3)), k[1:], slots, backend="triton", offset=m[1:])
    assert sum(int((a != b).sum()) for a, b in zip(part_got.tensors(), part_want.tensors(), strict=True)) <= allowed


def test_per_token_key_stores_warn_on_a_model_with_outlier_key_channels():
    """The weights tell: a large k_proj.bias (Qwen2's 354) warns for a store without a key offset."""
    from types import SimpleNamespace

    from kvlab.policies import make_policy
    from kvlab.policies.quantized.key_outliers import (
        OutlierKeysWarning,
        key_bias_outliers,
        warn_per_token_keys,
    )

    def layer(bias):
        return SimpleNamespace(self_attn=SimpleNamespace(k_proj=SimpleNamespace(bias=bias)))
    model = SimpleNamespace(model=SimpleNamespace(layers=[layer(torch.tensor([-354.0, 2.0])), layer(None),
                                                          layer(torch.tensor([5.0, 43.0]))]))
    assert key_bias_outliers(model) == {0: 354.0, 2: 43.0}
    assert key_bias_outliers(SimpleNamespace(model=SimpleNamespace(layers=[layer(None)]))) == {}
    with pytest.warns(OutlierKeysWarning, match=r"up to 354, layers 0, 2\) and kvq int4-g64 quantizes keys per token"):
        assert warn_per_token_keys(model, "kvq int4-g64")
    specs = {m: make_policy(m, **kw).spec for m, kw in (("kvq-int4", {}), ("kvq-fp8", {"key_offset": "none"}),
                                                         ("quanto", {}))}
    assert {m: s.impl.per_token_keys(s) for m, s in specs.items()} == {"kvq-int4": False, "kvq-fp8": True,
                                                                       "quanto": True}


def test_reply_kl_is_zero_for_the_full_cache_and_flags_a_collapse():
    from tiny_models import load_tiny_d32

    from kvlab.policies import make_policy
    from kvlab.quality.reply import reply_kl, reply_verdict

    lm = load_tiny_d32()
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    reply = [5, 9, 17, 3, 44]
    assert reply_kl(lm, make_policy("full"), prompt, reply) == pytest.approx(0.0, abs=1e-6)
    assert reply_kl(lm, make_policy("kvq-int2", q_group_size=32), prompt, reply) > 0
    assert reply_kl(lm, make_policy("full"), prompt, reply[:1]) is None
    assert reply_verdict(7.25).startswith("FIDELITY COLLAPSES: KL 7.25") and reply_verdict(0.02).startswith("KL 0.020")
