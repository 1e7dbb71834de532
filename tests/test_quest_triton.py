"""The Quest sparse kernel (kvlab.kernels.quest_decode) against the torch reference: compiled on a GPU,
interpreted on CPU (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported)."""

from __future__ import annotations

import os

import pytest
import torch

from kvlab.kernels import quest
from kvlab.kernels.formats import FormatError
from kvlab.kernels.quest_decode import make_quest_workspace, plan_quest_splits, quest_decode_attention

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1 (set it before triton is imported)", allow_module_level=True)

TOL = {"atol": 3e-3, "rtol": 1e-2}


@pytest.mark.parametrize("token_dim", [1, 2])
@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("tokens_per_iter", [16, 32, 64])
def test_kernel_matches_reference(token_dim, reduce, tokens_per_iter):
    # rows: full, empty, partial last page; GQA 4; budget 4 of 13 pages; 2 splits of 2 entries or 1 of 4
    # (1, 2 or 4 pages gathered per iteration)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([200, 0, 77], dtype=torch.int32, device=DEVICE)
    k = torch.randn(3, 2, 200, 32, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(3, 2, 200, 32, generator=gen).to(DEVICE, torch.bfloat16)
    spec = quest.QuestSpec(page=16, budget=64, group_reduce=reduce)
    bounds = quest.alloc_bounds(spec, 3, 2, 200, 32, device=DEVICE)
    for b, n in enumerate(lengths.tolist()):
        quest.load_bounds(quest.PageBounds(spec, bounds.kmin[b:b + 1], bounds.kmax[b:b + 1]), k[b:b + 1, :, :n])
    q = torch.randn(3, 8, 32, generator=gen).to(DEVICE)
    pages = quest.select_pages(q, bounds, lengths)
    want = quest.sparse_attend(q, k, v, pages, lengths, 0.2, spec.page)
    if token_dim == 1:  # the fast engine's dense layout, read through its strides
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    ws = make_quest_workspace(8, 3, 2, pages.shape[2], 32, DEVICE, num_splits=3, tokens_per_iter=tokens_per_iter)
    assert (ws.num_splits, ws.pages_per_iter) == {16: (2, 1), 32: (2, 2), 64: (1, 4)}[tokens_per_iter]
    got = quest_decode_attention(q, k, v, pages, lengths, 0.2, spec.page, token_dim=token_dim, workspace=ws,
                                 backend="triton")
    assert got.shape == q.shape
    torch.testing.assert_close(got.float(), want, **TOL)
    assert not got[1].any()


def test_full_budget_kernel_is_full_attention():
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(1, 1, 64, 32, generator=gen).to(DEVICE)
    v = torch.randn(1, 1, 64, 32, generator=gen).to(DEVICE)
    spec = quest.QuestSpec(page=16, budget=64)
    bounds = quest.alloc_bounds(spec, 1, 1, 64, 32, dtype=torch.float32, device=DEVICE)
    quest.load_bounds(bounds, k[:, :, :50])
    q = torch.randn(1, 2, 32, generator=gen).to(DEVICE)
    lengths = torch.tensor([50], dtype=torch.int32, device=DEVICE)
    got = quest_decode_attention(q, k, v, quest.select_pages(q, bounds, lengths), lengths, 0.2, 16, backend="triton")
    probs = torch.softmax(torch.einsum("hd,td->ht", q[0], k[0, 0, :50]) * 0.2, -1)
    torch.testing.assert_close(got[0].float(), probs @ v[0, 0, :50], **TOL)


def test_split_plan_covers_the_list():
    for selected in (2, 5, 128):
        for batch in (1, 16):
            n, per = plan_quest_splits(batch, 8, selected, 132)
            assert n * per >= selected and (n - 1) * per < selected


def test_gathered_pages_past_a_split_end_and_the_list_end_are_skipped():
    # 7 pages of 13 selected, 4 gathered per iteration over splits of 4: the second split's one
    # iteration reads 3 entries and masks the slot past the list; -1 entries from a short row
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([208, 90], dtype=torch.int32, device=DEVICE)
    k = torch.randn(2, 2, 208, 32, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(2, 2, 208, 32, generator=gen).to(DEVICE, torch.bfloat16)
    spec = quest.QuestSpec(page=16, budget=112)
    bounds = quest.alloc_bounds(spec, 2, 2, 208, 32, device=DEVICE)
    for b, n in enumerate(lengths.tolist()):
        quest.load_bounds(quest.PageBounds(spec, bounds.kmin[b:b + 1], bounds.kmax[b:b + 1]), k[b:b + 1, :, :n])
    q = torch.randn(2, 4, 32, generator=gen).to(DEVICE)
    pages = quest.select_pages(q, bounds, lengths, "reference")
    assert pages.shape[2] == 7 and (pages[1] == -1).any()  # row 1 has 6 pages
    ws = make_quest_workspace(4, 2, 2, 7, 32, DEVICE, num_splits=2, tokens_per_iter=64)
    assert (ws.num_splits, ws.per_split, ws.pages_per_iter) == (2, 4, 4)
    got = quest_decode_attention(q, k, v, pages, lengths, 0.2, 16, workspace=ws, backend="triton")
    torch.testing.assert_close(got.float(), quest.sparse_attend(q, k, v, pages, lengths, 0.2, 16), **TOL)


def test_workspace_rejects_a_gather_that_is_not_a_power_of_two():
    with pytest.raises(FormatError, match="power of two"):
        make_quest_workspace(4, 1, 1, 8, 32, DEVICE, page=16, tokens_per_iter=48)
