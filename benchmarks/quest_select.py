"""Quest's decode page selection on the GPU (issue 29): the torch path (~15 small kernels) against the
fused scoring kernel (:mod:`kvlab.kernels.quest_select`) plus ``topk``. Not a test: a script to run on
an H100/H200.

    python benchmarks/quest_select.py --out quest_select.json               # ~1 min
    TRITON_INTERPRET=1 python benchmarks/quest_select.py --device cpu --quick   # smoke test, no GPU

At the Llama-3.1-8B attention shape (Hq 32, Hkv 8, D 128, bf16 bounds, pages of 16), ``--lengths``
(16k, 32k), ``--batches`` (1, 16) and ``--budgets`` (512, 2048 tokens), per row: ``torch_ms`` and
``fused_ms`` (:func:`kvlab.kernels.quest.select_pages` with ``backend='reference'`` / ``'triton'``: the
scoring kernel and the top-pages kernel), ``ratio`` = torch / fused, ``fused_scores_ms`` (the scoring
kernel alone), ``topk_ms`` / ``top_kernel_ms`` (torch's ``topk`` and ``-1`` fill against the top-pages
kernel, on the same scores; ``top_kernel_ms_radixR``: its threshold search ``R`` bits per reduction),
``append_torch_ms`` / ``append_kernel_ms`` (one token's bounds append,
:func:`kvlab.kernels.quest.append_bounds`), ``bounds_GB/s`` (the bounds read once per call over the
scoring kernel's time),
whether the page sets agree (``same_pages``, sorted per row; a near tie of two pages can swap one) and
the largest score difference where both are finite. Times: median of CUDA-event-timed replays of a
CUDA graph of ``copies`` calls over distinct copies of the bounds (past L2), divided by ``copies``
(:func:`kivi_quest.timed_alternating`: the reads compared in a group alternate, ABAB: the selections,
the top-pages variants, the appends); the append runs on one copy (its bytes are a page's bounds).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kivi_quest import L2_BYTES, timed_alternating  # noqa: E402

from kvlab.card import device_card  # noqa: E402
from kvlab.kernels import quest  # noqa: E402
from kvlab.kernels.quest_select import launch_select_top  # noqa: E402


def run_case(batch, length, budget, args, device, rows):
    hq, hkv, d = 32, 8, 128
    gen = torch.Generator().manual_seed(batch * 7 + length)
    k = (torch.randn(batch, hkv, length, d, generator=gen) * 2).to(device, torch.bfloat16)
    k[..., 7] += 6  # an outlier channel, as real keys have
    q = torch.randn(batch, hq, d, generator=gen).to(device, torch.bfloat16)
    lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
    lengths[0] = max(1, length - 100)  # one row ending mid-page, short of the capacity
    spec = quest.QuestSpec(page=16, budget=budget)
    bounds = quest.alloc_bounds(spec, batch, hkv, length, d, device=device)
    quest.load_bounds(bounds, k)
    del k
    bound_bytes = 2 * bounds.kmin.numel() * bounds.kmin.element_size()
    copies = 1 if args.quick else max(1, min(16, math.ceil(L2_BYTES / bound_bytes)))
    copies_of = [bounds] + [quest.PageBounds(spec, bounds.kmin.clone(), bounds.kmax.clone()) for _ in range(copies - 1)]

    want = quest.selection_scores(q, bounds, lengths, "reference")
    got = quest.selection_scores(q, bounds, lengths, "triton")
    want_pages = quest.select_pages(q, bounds, lengths, "reference")
    got_pages = quest.select_pages(q, bounds, lengths, "triton")
    finite = want.isfinite() & got.isfinite()
    same_inf = bool(torch.equal(want.isfinite(), got.isfinite()))
    same_pages = bool(torch.equal(want_pages.sort(-1).values, got_pages.sort(-1).values))
    k_sel = want_pages.shape[-1]
    ms = timed_alternating({  # torch's selection and the kernels', replays alternating
        "torch": lambda i: quest.select_pages(q, copies_of[i], lengths, "reference"),
        "fused": lambda i: quest.select_pages(q, copies_of[i], lengths, "triton"),
        "scores": lambda i: quest.selection_scores(q, copies_of[i], lengths, "triton")}, copies, device, args.reps)
    torch_ms, fused_ms, scores_ms = ms["torch"], ms["fused"], ms["scores"]
    tops = timed_alternating({  # torch's topk, the top-pages kernel and its radix widths, alternating
        "topk": lambda i: quest.top_pages(got, k_sel, "reference"),
        "kernel": lambda i: quest.top_pages(got, k_sel, "triton"),
        **{r: (lambda i, r=r: launch_select_top(got, k_sel, radix_bits=r)) for r in (1, 2, 4)}}, copies, device, args.reps)
    topk_ms, top_kernel_ms = tops["topk"], tops["kernel"]
    top_radix_ms = {r: tops[r] for r in (1, 2, 4)}
    # the bounds' append of one decode token: torch's ops against the kernel (on a spare copy)
    key = torch.randn(batch, hkv, 1, d, generator=gen).to(device, torch.bfloat16)
    pos = torch.tensor([length - 3], device=device)
    spare = quest.PageBounds(spec, bounds.kmin.clone(), bounds.kmax.clone())
    appends = timed_alternating({"torch": lambda i: quest.append_bounds(spare, key, pos, "reference"),
                                 "kernel": lambda i: quest.append_bounds(spare, key, pos, "triton")}, 1, device, args.reps)
    append_torch_ms, append_kernel_ms = appends["torch"], appends["kernel"]
    row = {"batch": batch, "length": length, "budget": budget, "pages": bounds.kmin.shape[2],
           "selected": k_sel, "torch_ms": torch_ms, "fused_ms": fused_ms,
           "fused_scores_ms": scores_ms, "ratio": torch_ms / fused_ms if fused_ms > 0 else None,
           "topk_ms": topk_ms, "top_kernel_ms": top_kernel_ms,
           **{f"top_kernel_ms_radix{r}": ms for r, ms in top_radix_ms.items()},
           "append_torch_ms": append_torch_ms, "append_kernel_ms": append_kernel_ms,
           "bounds_GB/s": bound_bytes / scores_ms / 1e6 if scores_ms > 0 else None,
           "same_pages": same_pages, "same_masks": same_inf,
           "max_score_diff": float((want[finite] - got[finite]).abs().max()) if finite.any() else 0.0}
    rows.append(row)
    print(json.dumps(row), flush=True)
    if not (same_pages and same_inf):
        print(f"WARNING: the fused selection differs from torch's at batch {batch}, length {length}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test under TRITON_INTERPRET=1)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("quest_select.py times CUDA kernels and no CUDA device is visible; on a CPU run "
                 "TRITON_INTERPRET=1 python benchmarks/quest_select.py --device cpu --quick")
    if device.type != "cuda" and not args.quick:
        sys.exit("on a CPU only --quick runs (the Triton interpreter at a tiny shape, no timings)")
    if args.quick:
        args.lengths, args.batches, args.budgets = [300], [2], [64]
    rows = []
    card = device_card(args.device)
    for length in args.lengths:
        for batch in args.batches:
            for budget in args.budgets:
                try:
                    run_case(batch, length, budget, args, device, rows)
                except Exception as err:  # report and go on: one failing case must not lose the others
                    traceback.print_exc()
                    rows.append({"batch": batch, "length": length, "budget": budget, "error": repr(err)})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if args.out:  # each row names its card
                    args.out.write_text(json.dumps([{**r, "card": card} for r in rows], indent=1))
    return 1 if any("error" in r or not r["same_pages"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
