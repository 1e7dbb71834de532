"""The KIVI cache layer for the hf engine (kvlab.storage.kivi): it holds what the fast engine's
store holds at every length, and a tiny model generates through it."""

from __future__ import annotations

import torch

from kvlab.kernels import kivi
from kvlab.storage.kivi import KiviLayer, kivi_cache

SPEC = kivi.KiviSpec(bits=2, group=16, residual=32, value_group=32)


def test_layer_matches_the_static_store_at_every_length():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 90, 64, generator=gen)
    v = torch.randn(1, 2, 90, 64, generator=gen)
    layer = KiviLayer(SPEC)
    out = layer.update(k[:, :, :40], v[:, :, :40])
    assert torch.equal(out[0], k[:, :, :40])  # the prefill attends exactly
    store = kivi.alloc(SPEC, 1, 2, 90, 64)
    kivi.load(store, k[:, :, :40], v[:, :, :40])
    t = 40
    for n in (1, 1, 7, 1, 25, 1, 14):  # single tokens and chunks, across flushes
        keys, values = layer.update(k[:, :, t:t + n], v[:, :, t:t + n])
        for i in range(t, t + n):
            kivi.append(store, k[:, :, i:i + 1], v[:, :, i:i + 1], torch.tensor([i]))
        t += n
        want_k, want_v = kivi.dequantize(store, t)
        assert torch.equal(keys, want_k) and torch.equal(values, want_v), t
        assert layer.get_seq_length() == t and layer.quantized == SPEC.quantized_tokens(t)


def test_tiny_model_generates_through_the_cache():
    from tiny_models import load_tiny_d32

    loaded = load_tiny_d32()
    model = loaded.model
    ids = torch.randint(0, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(1))
    cache = kivi_cache(model.config.num_hidden_layers, SPEC)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 66) and cache.get_seq_length() == 65
