"""Quest's bounds beside a transformers cache layer (kvlab.storage.quest): kept on prefill,
appends and chunks, and the sparse read at a full budget is the dense one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.kernels import quest
from kvlab.storage.quest import QuestLayer, quest_cache


def test_bounds_follow_updates():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 2, 120, 32, generator=gen)
    v = torch.randn(2, 2, 120, 32, generator=gen)
    spec = quest.QuestSpec(page=16, budget=64)
    layer = QuestLayer(spec, layer_idx=2)
    t = 0
    for n in (37, 1, 1, 9, 1, 30, 41):  # a prefill, single tokens, chunks; page edges crossed
        layer.update(k[:, :, t:t + n], v[:, :, t:t + n])
        t += n
        ref = quest.alloc_bounds(spec, 2, 2, t, 32, dtype=torch.float32)
        quest.load_bounds(ref, k[:, :, :t])
        got = layer.bounds()
        assert torch.equal(got.kmin, ref.kmin) and torch.equal(got.kmax, ref.kmax), t


def test_full_budget_attend_is_dense():
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(1, 2, 70, 32, generator=gen)
    v = torch.randn(1, 2, 70, 32, generator=gen)
    layer = quest_cache(3, quest.QuestSpec(page=16, budget=80)).layers[2]
    assert layer.sparse
    layer.update(k, v)
    q = torch.randn(1, 4, 1, 32, generator=gen)
    got = layer.attend(q, 0.2)
    want = F.scaled_dot_product_attention(q, k, v, scale=0.2, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want)
