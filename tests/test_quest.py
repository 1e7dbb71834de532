"""Quest-style sparse reads, torch reference (kvlab.kernels.quest): page bounds, the selection against
brute force, exactness at a full budget, a planted needle, bounds kept on append."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab.kernels import quest
from kvlab.kernels.formats import FormatError


def cache(batch=2, heads=2, n=100, dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, n, dim, generator=gen), torch.randn(batch, heads, n, dim, generator=gen)


def dense(q, k, v, scale, n):
    batch, hq, d = q.shape
    g = hq // k.shape[1]
    out = F.scaled_dot_product_attention(q.view(batch, k.shape[1], g, d), k[:, :, :n], v[:, :, :n], scale=scale)
    return out.reshape(batch, hq, d)


def brute_force(q, k, spec, length):
    """Bounds recomputed token by token, reduced over the group, top pages with the first and latest."""
    batch, hq, d = q.shape
    hkv = k.shape[1]
    n_pages = -(-length // spec.page)
    chosen = []
    for b in range(batch):
        rows = []
        for h in range(hkv if spec.group_reduce != "head" else hq):
            heads = range(h * hq // hkv, (h + 1) * hq // hkv) if spec.group_reduce != "head" else [h]
            kv = h if spec.group_reduce != "head" else h // (hq // hkv)
            scores = []
            for p in range(n_pages):
                keys = k[b, kv, p * spec.page:min((p + 1) * spec.page, length)]
                lo, hi = keys.min(0).values, keys.max(0).values
                bound = [float(torch.maximum(q[b, i] * lo, q[b, i] * hi).sum()) for i in heads]
                scores.append(max(bound) if spec.group_reduce == "max" else sum(bound))
            forced = {0, n_pages - 1}
            rest = sorted((p for p in range(n_pages) if p not in forced), key=lambda p: -scores[p])
            rows.append(forced | set(rest[:spec.selected(k.shape[2]) - len(forced)]))
        chosen.append(rows)
    return chosen


def test_spec_checks():
    with pytest.raises(FormatError):
        quest.QuestSpec(page=12)
    with pytest.raises(FormatError):
        quest.QuestSpec(page=16, budget=16)
    with pytest.raises(FormatError):
        quest.QuestSpec(group_reduce="mean")


def test_bound_is_an_upper_bound_of_every_logit():
    k, _ = cache(n=96)
    spec = quest.QuestSpec(page=16, budget=64)
    bounds = quest.alloc_bounds(spec, 2, 2, 96, 32, dtype=torch.float32)
    quest.load_bounds(bounds, k)
    q = torch.randn(2, 4, 32)
    scores = quest.page_scores(q, bounds).view(2, 2, 2, 6)
    logits = torch.einsum("bhgd,bhtd->bhgt", q.view(2, 2, 2, 32), k).view(2, 2, 2, 6, 16)
    assert (logits.amax(-1) <= scores + 1e-5).all()


@pytest.mark.parametrize("reduce", ["max", "sum", "head"])
@pytest.mark.parametrize("length", [100, 97, 40, 9])
def test_selection_equals_brute_force(reduce, length):
    k, _ = cache(n=100)
    spec = quest.QuestSpec(page=8, budget=40, group_reduce=reduce)  # 5 pages of 13
    bounds = quest.alloc_bounds(spec, 2, 2, 100, 32, dtype=torch.float32)
    quest.load_bounds(bounds, k[:, :, :length])
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(length))
    got = quest.select_pages(q, bounds, torch.tensor([length, length]))
    assert got.shape == (2, 4 if reduce == "head" else 2, 5)
    want = brute_force(q, k, spec, length)
    for b in range(2):
        for h in range(got.shape[1]):
            pages = got[b, h].tolist()
            assert {p for p in pages if p >= 0} == want[b][h]
            assert pages.count(-1) == max(0, 5 - -(-length // 8))


def test_full_budget_is_full_attention():
    k, v = cache(n=100)
    spec = quest.QuestSpec(page=16, budget=112)
    bounds = quest.alloc_bounds(spec, 2, 2, 100, 32, dtype=torch.float32)
    quest.load_bounds(bounds, k[:, :, :77])
    q = torch.randn(2, 4, 32)
    got = quest.quest_attend(q, k, v, bounds, torch.tensor([77, 77]), 0.2)
    torch.testing.assert_close(got, dense(q, k, v, 0.2, 77))


@pytest.mark.parametrize("reduce", ["max", "sum", "head"])
def test_planted_needle_is_selected(reduce):
    """A key aligned with one query head in a middle page: its page is read at a budget of 4 of 32
    pages, and that head's output is the needle's value."""
    k, v = cache(batch=1, heads=2, n=512, dim=32, seed=3)
    k = k * 0.3
    q = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(9))
    needle = 300  # page 18 of 16-token pages
    k[0, 1, needle] = q[0, 3] / q[0, 3].norm() * 8  # KV head 1, seen by query head 3
    v[0, 1, needle] = 5.0
    spec = quest.QuestSpec(page=16, budget=64, group_reduce=reduce)
    bounds = quest.alloc_bounds(spec, 1, 2, 512, 32, dtype=torch.float32)
    quest.load_bounds(bounds, k)
    lengths = torch.tensor([512])
    pages = quest.select_pages(q, bounds, lengths)
    row = pages[0, 3] if reduce == "head" else pages[0, 1]
    assert needle // 16 in row.tolist() and 0 in row.tolist() and 31 in row.tolist()
    out = quest.quest_attend(q, k, v, bounds, lengths, 1.0)
    assert (out[0, 3] - 5.0).abs().max() < 0.05
    torch.testing.assert_close(out[0, 3], dense(q, k, v, 1.0, 512)[0, 3], atol=0.05, rtol=0)


def test_append_keeps_the_bounds_of_a_fresh_load():
    k, _ = cache(n=70)
    spec = quest.QuestSpec(page=16, budget=64)
    bounds = quest.alloc_bounds(spec, 2, 2, 70, 32)
    quest.load_bounds(bounds, k[:, :, :30].bfloat16())
    for t in range(30, 70):  # crosses pages at 32, 48 and 64
        quest.append_bounds(bounds, k[:, :, t:t + 1], torch.tensor([t]))
        ref = quest.alloc_bounds(spec, 2, 2, 70, 32)
        quest.load_bounds(ref, k[:, :, :t + 1].bfloat16())
        pages = -(-(t + 1) // 16)
        assert torch.equal(bounds.kmin[:, :, :pages], ref.kmin[:, :, :pages])
        assert torch.equal(bounds.kmax[:, :, :pages], ref.kmax[:, :, :pages])


@pytest.mark.parametrize("reduce", ["max", "sum", "head"])
def test_a_chunk_reads_each_row_as_its_own_decode_step(reduce):
    """Teacher forcing feeds tokens as one chunk: row i must select its pages and attend exactly as the
    decode step of its token does, from the bounds and tokens up to itself (not the whole chunk's)."""
    k, v = cache(n=120, seed=5)
    spec = quest.QuestSpec(page=8, budget=32, group_reduce=reduce)
    n = 37  # rows from position 83 on: page edges crossed inside the chunk
    q = torch.randn(2, 4, n, 32, generator=torch.Generator().manual_seed(6))
    bounds = quest.alloc_bounds(spec, 2, 2, 120, 32, dtype=torch.float32)
    quest.load_bounds(bounds, k)
    got = quest.chunk_attend(q, k, v, bounds, 0.3)
    for i in range(n):
        length = 120 - n + i + 1
        alone = quest.alloc_bounds(spec, 2, 2, length, 32, dtype=torch.float32)
        quest.load_bounds(alone, k[:, :, :length])
        want = quest.quest_attend(q[:, :, i], k[:, :, :length], v[:, :, :length], alone,
                                  torch.tensor([length, length]), 0.3)
        torch.testing.assert_close(got[:, :, i], want, msg=f"row {i}")
    assert not torch.allclose(got[:, :, -1], dense(q[:, :, -1], k, v, 0.3, 120), atol=1e-3)  # really sparse
