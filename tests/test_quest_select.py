"""The fused page scoring (kvlab.kernels.quest_select) against the torch selection of kvlab.kernels.quest:
compiled on a GPU, interpreted on CPU (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from kvlab.kernels import quest
from kvlab.kernels.formats import FormatError

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1 (set it before triton is imported)", allow_module_level=True)

TOL = {"atol": 1e-4, "rtol": 1e-5}


def filled_bounds(spec, lengths, kv_heads, capacity, head_dim, dtype, gen):
    """Bounds of random keys, row ``b`` written up to ``lengths[b]`` (pages past it never written:
    ``+-inf``, scoring NaN or ``+-inf``)."""
    batch = len(lengths)
    bounds = quest.alloc_bounds(spec, batch, kv_heads, capacity, head_dim, dtype=dtype, device=DEVICE)
    keys = (torch.randn(batch, kv_heads, capacity, head_dim, generator=gen) * 2).to(DEVICE, dtype)
    for b, n in enumerate(lengths):
        if n:
            quest.load_bounds(quest.PageBounds(spec, bounds.kmin[b:b + 1], bounds.kmax[b:b + 1]), keys[b:b + 1, :, :n])
    return bounds


def both(q, bounds, lengths):
    with warnings.catch_warnings():  # the interpreter's 0 * inf in never-written pages, masked after
        warnings.simplefilter("ignore", RuntimeWarning)
        return (quest.selection_scores(q, bounds, lengths, "triton"),
                quest.selection_scores(q, bounds, lengths, "reference"),
                quest.select_pages(q, bounds, lengths, "triton"), quest.select_pages(q, bounds, lengths, "reference"))


def assert_same_selection(got, want, got_pages, want_pages):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert not want.isnan().any() and not got.isnan().any()
    assert torch.equal(got == float("inf"), want == float("inf"))
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], **TOL)
    # random scores have no ties but page 0 and the latest (both +inf): the same set, in any order
    assert torch.equal(got_pages.sort(-1).values, want_pages.sort(-1).values)


@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 4, 3])
def test_fused_scores_and_pages_match_the_reference(group, head_dim, reduce):
    # 70 pages (not a multiple of the kernel's 32), budget 8 pages; rows: full, mid-page, at a page's
    # start (one token in it), ending a page, shorter than the budget (-1 fill), empty
    gen = torch.Generator().manual_seed(group * 1000 + head_dim)
    spec = quest.QuestSpec(page=16, budget=128, group_reduce=reduce)
    capacity = 16 * 69 + 5
    lengths = [capacity, 600, 16 * 40 + 1, 16 * 21, 50, 0]
    kv_heads = 2
    bounds = filled_bounds(spec, lengths, kv_heads, capacity, head_dim, torch.bfloat16, gen)
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    got, want, got_pages, want_pages = both(q, bounds, lens)
    assert got.shape == (len(lengths), kv_heads, spec.pages(capacity))
    assert_same_selection(got, want, got_pages, want_pages)
    assert (want_pages[4] >= 0).sum() == 2 * 4  # 50 tokens: 4 pages per head, the rest -1
    assert (want_pages[5] >= 0).sum() == 2 and (want_pages[5] == 0).sum() == 2  # empty: page 0 only


@pytest.mark.parametrize("page", [4, 16, 64])
def test_fused_scores_over_float32_bounds_int64_lengths_and_a_strided_query(page):
    gen = torch.Generator().manual_seed(page)
    spec = quest.QuestSpec(page=page, budget=4 * page, group_reduce="max")
    capacity = page * 45 - 1
    lengths = [capacity, page * 7, page * 7 + 1, page * 30 - 3]
    bounds = filled_bounds(spec, lengths, 3, capacity, 32, torch.float32, gen)
    q = torch.randn(4, 12, 2 * 32, generator=gen).to(DEVICE)[..., :32]  # head stride 64, unit head dim
    lens = torch.tensor(lengths, dtype=torch.int64, device=DEVICE)
    assert_same_selection(*both(q, bounds, lens))


def test_chunk_and_head_run_the_reference_and_auto_scores_in_torch():
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([100, 37], device=DEVICE)
    head = quest.QuestSpec(page=16, budget=32, group_reduce="head")
    bounds = filled_bounds(head, lengths.tolist(), 2, 112, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    for backend in ("triton", "auto"):  # one page set per query head: torch whatever the backend
        assert torch.equal(quest.select_pages(q, bounds, lengths, backend), quest.select_pages(q, bounds, lengths,
                                                                                                 "reference"))
    with pytest.raises(FormatError, match="group_reduce"):
        quest.fused_scores(q, bounds, lengths)
    chunk = torch.randn(2, 4, 3, 16, generator=gen).to(DEVICE)
    rows = torch.tensor([[98, 99, 100], [35, 36, 37]], device=DEVICE)
    maxed = quest.PageBounds(quest.QuestSpec(page=16, budget=32), bounds.kmin, bounds.kmax)
    assert quest.select_pages(chunk, maxed, rows, "triton").shape == (2, 2, 3, 2)
    with pytest.raises(FormatError, match="backend"):
        quest.select_pages(q, maxed, lengths, "cuda")
    # auto: the kernels on CUDA, torch's scoring elsewhere
    if DEVICE == "cpu":
        assert torch.equal(quest.selection_scores(q, maxed, lengths), quest.reference_scores(q, maxed, lengths))


def test_the_kernels_are_filed_under_page_selection_and_cache_update():
    """A graph replay knows the kernels by their names only (kvlab.engine.anatomy.KERNEL_RULES)."""
    from kvlab.engine.anatomy import classify_kernel
    from kvlab.kernels import quest_bounds, quest_select

    assert classify_kernel(quest_select.quest_select_kernel.__name__) == "page selection"
    assert classify_kernel(quest_select.quest_select_top_kernel.__name__) == "page selection"
    assert classify_kernel(quest_bounds.quest_bounds_append_kernel.__name__) == "cache update/concat"


def assert_top_pages(got, scores, k):
    """``got`` holds, per row in page order, the ``k`` best pages (ties to the lowest page numbers),
    then ``-1`` where fewer than ``k`` score above ``-inf``: what ``topk`` selects, ties aside."""
    assert got.dtype == torch.int64 and got.shape == (*scores.shape[:-1], k)
    for row, want in zip(got.reshape(-1, k).tolist(), scores.reshape(-1, scores.shape[-1]).tolist(), strict=True):
        live = [p for p, v in enumerate(want) if v > float("-inf")]
        best = sorted(live, key=lambda p: (-want[p], p))[:k]
        assert row == sorted(best) + [-1] * (k - len(best))


@pytest.mark.parametrize("n_pages,k", [(1, 1), (70, 8), (64, 64), (300, 128), (1024, 128)])
def test_top_pages_kernel_selects_what_topk_selects(n_pages, k):
    from kvlab.kernels.quest_select import launch_select_top  # imports triton

    gen = torch.Generator().manual_seed(n_pages + k)
    scores = torch.randn(3, 2, n_pages, generator=gen) * 30
    scores[0, 0, :2] = float("inf")  # page 0 and the latest
    scores[0, 1, n_pages // 2:] = float("-inf")  # a short row: pages past its length
    scores[1, 0, :] = float("-inf")
    scores[1, 1, n_pages // 3::2] = -0.0  # ties, across signed zeros
    scores[1, 1, 1::5] = 0.0
    scores[2, 0] = scores[2, 0].round()  # many ties at integers
    scores[2, 1, ::3] = -3.4e38  # the most negative float32s
    scores = scores.to(DEVICE)
    got = quest.top_pages(scores, k, "triton")
    assert_top_pages(got.cpu(), scores.cpu(), k)
    for radix_bits in (1, 4):  # the default is 2
        assert torch.equal(launch_select_top(scores, k, radix_bits=radix_bits), got)
    want = quest.top_pages(scores, k, "reference")
    untied = [(0, 0), (0, 1), (1, 0)]  # topk breaks ties in no stated order: compare the sets where none are
    for b, h in untied:
        assert torch.equal(got[b, h].sort().values, want[b, h].sort().values)


def test_append_kernel_writes_what_torch_writes():
    """Token by token over three pages and into a fresh one, bf16 and float32 bounds, a strided key."""
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.bfloat16, torch.float32):
        spec = quest.QuestSpec(page=16, budget=64)
        got = quest.alloc_bounds(spec, 2, 3, 64, 48, dtype=dtype, device=DEVICE)
        want = quest.alloc_bounds(spec, 2, 3, 64, 48, dtype=dtype, device=DEVICE)
        keys = torch.randn(2, 3, 64, 2, 48, generator=gen).to(DEVICE, torch.bfloat16)[..., 0, :]  # unit head dim
        for t in range(50):
            pos = torch.tensor([t], device=DEVICE)
            quest.append_bounds(got, keys[:, :, t:t + 1], pos, "triton")
            quest.append_bounds(want, keys[:, :, t:t + 1], pos, "reference")
            if t in (0, 15, 16, 33, 49):
                assert torch.equal(got.kmin, want.kmin) and torch.equal(got.kmax, want.kmax), t
        assert torch.isinf(got.kmin[:, :, 4:]).all()  # pages not reached keep their +-inf
    with pytest.raises(FormatError, match="unit-stride"):
        quest.append_bounds(got, keys[..., ::2], torch.tensor([0], device=DEVICE), "triton")


def test_the_benchmark_runs_interpreted_at_a_tiny_shape(tmp_path):
    """benchmarks/quest_select.py (the GPU timing of torch vs fused): its CPU smoke run agrees, a CPU run
    without --quick refuses."""
    import importlib.util
    import json
    from pathlib import Path

    if DEVICE != "cpu":
        pytest.skip("the smoke run is the CPU path")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "quest_select.py"
    spec = importlib.util.spec_from_file_location("quest_select_bench", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "qs.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert bench.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["same_pages"] and row["same_masks"] and row["max_score_diff"] < 1e-3
    with pytest.raises(SystemExit, match="--quick"):
        bench.main(["--device", "cpu"])
