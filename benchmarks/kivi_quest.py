"""KIVI-style and Quest-style decode attention on the GPU (issue 29): error against the references,
then kernel time beside the bf16 and int4 reads. Not a test: a script to run on the H200.

    python benchmarks/kivi_quest.py --out kivi_quest.json                   # ~2 min
    python benchmarks/kivi_quest.py --lengths 16384 --batches 1 16 --kivi-variants split warp_asm \
        --skip fused quest --out kivi_warp.json                             # the KIVI kernels beside flash

At the Llama-3.1-8B attention shape (Hq 32, Hkv 8, D 128), ``--lengths`` (16k, 32k) and ``--batches``
(1, 16), per row:

- ``flash-bf16``: flash attention's varlen kernel on the fast engine's dense ``[B, C, Hkv, D]`` cache;
- ``fused-bf16`` / ``fused-int4-g64``: kvlab's split-K kernel (:func:`kvlab.kernels.decode_attention`);
- ``kivi2-g32``, ``kivi2-g16``, ``kivi-k4v2``, ``kivi4``: :func:`kvlab.kernels.kivi_decode.kivi_decode_attention`
  (R 128), once per ``--kivi-variants`` kernel (``split``, the default, names the row by the store's label
  alone; ``warp``/``warp_asm`` append ``:variant``, and ``variant`` says which kernel ran);
- ``quest-B:tN``: page selection (:func:`kvlab.kernels.quest.select_pages` with ``--backend``: the
  scoring and top-pages kernels for triton, torch for reference; benchmarks/quest_select.py compares
  them) plus the sparse kernel gathering N tokens per iteration (``--quest-tokens-per-iter``) over the
  dense cache, budget B tokens (``--budgets``, pages of 16), with the selection's own time
  (``select_ms``) and the kernel's (``attend_ms``) beside the total.

Times: median of CUDA-event-timed replays of a CUDA graph holding ``copies`` launches over
distinct copies of the inputs (enough copies to exceed 256 MiB, so the reads come from HBM, not L2),
divided by ``copies``. Every read of a (length, batch) case is built first and the replays alternate
(ABAB...: each read, and each Quest row's selection and sparse kernel, once per round, ``--reps``
rounds), so clock and thermal drift land on every read alike (``alternated_with``: the other reads
of the round). ``bytes`` is what one launch must read of K/V (codes, scales, ring; for Quest
the bounds plus the selected pages); ``GB/s`` = bytes / time. ``rel_err``: ||out - ref|| / ||ref||
against the float32 reference of the same storage. ``--device cpu --quick`` with TRITON_INTERPRET=1
smoke-tests the script.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvlab.card import device_card  # noqa: E402
from kvlab.kernels import (  # noqa: E402
    decode_attention,
    decode_attention_reference,
    kivi,
    make_format,
    make_workspace,
    quest,
)
from kvlab.kernels.kivi_decode import (  # noqa: E402
    VARIANTS,
    kivi_decode_attention,
    kivi_variant,
    make_kivi_workspace,
)
from kvlab.kernels.quest_decode import make_quest_workspace, quest_decode_attention  # noqa: E402
from kvlab.repeats import alternate  # noqa: E402

L2_BYTES = 256 << 20


def timed(fn, copies: int, device, reps: int) -> float:
    """Median ms per call of ``fn(i)`` for ``i`` over the copies, through a CUDA graph on CUDA."""
    return timed_alternating({"fn": fn}, copies, device, reps)["fn"]


def timed_alternating(fns: dict, copies: int, device, reps: int) -> dict:
    """:func:`timed` of several callables whose replays alternate (ABAB...: clock and thermal drift
    land on each alike), each its median ms per call; NaN off CUDA (after one eager pass each)."""
    for fn in fns.values():
        for i in range(copies):
            fn(i)
    if device.type != "cuda":
        return dict.fromkeys(fns, float("nan"))
    graphs = {key: _graph_of(fn, copies) for key, fn in fns.items()}

    def replay_ms(graph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / copies

    times = alternate({key: (lambda graph=graph: replay_ms(graph)) for key, graph in graphs.items()}, reps)
    return {key: statistics.median(t) for key, t in times.items()}


def _graph_of(fn, copies: int):
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    return graph


def rel_err(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def run_case(batch, length, args, device, rows):
    hq, hkv, d = 32, 8, 128
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(batch * 7 + length)
    k = (torch.randn(batch, hkv, length, d, generator=gen) * 2).to(device, torch.bfloat16)
    k[..., 7] += 6  # an outlier channel, as real keys have
    v = torch.randn(batch, hkv, length, d, generator=gen).to(device, torch.bfloat16)
    q = torch.randn(batch, hq, d, generator=gen).to(device, torch.bfloat16)
    lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
    dense_bytes = 2 * k.numel() * 2
    copies = 1 if args.quick else max(1, min(16, math.ceil(L2_BYTES / dense_bytes)))

    def record(name, ms, nbytes, err, **extra):
        row = {"batch": batch, "length": length, "read": name, "ms": ms, "bytes": nbytes,
               "GB/s": nbytes / ms / 1e6 if ms == ms and ms > 0 else None, "rel_err": err, **extra}
        rows.append(row)
        print(json.dumps(row), flush=True)

    # every read of the case is built first, then timed in one alternation (ABAB...: each read once per
    # round, ``--reps`` rounds), so clock and thermal drift land on every read alike
    reads = {}  # name -> (fn(i), bytes, rel_err, extra fields)
    dense = [(k.contiguous(), v.contiguous()) for _ in range(copies)]
    dense_ref = decode_attention_reference(q.float(), make_format("bf16").quantize(k),
                                           make_format("bf16").quantize(v), lengths, scale)
    if device.type == "cuda":  # flash on the dense [B, H, C, D] cache (the fast engine's head-major store)
        from kvlab.storage.slots import cumulative_offsets, flash_decode, segment_lengths

        offsets = cumulative_offsets(batch * hkv, length, device)
        segments = segment_lengths(lengths, hkv)
        q4 = q.unsqueeze(2)
        out = flash_decode(q4, *dense[0], segments, scale, *offsets)
        reads["flash-bf16"] = (lambda i: flash_decode(q4, *dense[i], segments, scale, *offsets), dense_bytes,
                               rel_err(out, dense_ref), {})

    for name, group in (("bf16", None), ("int4", 64)) if "fused" not in args.skip else ():
        fmt = make_format(name, group)
        stores = [(fmt.quantize(k), fmt.quantize(v)) for _ in range(copies)]
        ws = make_workspace(hq, stores[0][0])
        out = decode_attention(q, *stores[0], lengths, scale, workspace=ws, backend=args.backend)
        ref = decode_attention_reference(q, *stores[0], lengths, scale)
        reads[f"fused-{fmt.label}"] = (
            lambda i, stores=stores, ws=ws: decode_attention(q, *stores[i], lengths, scale, workspace=ws,
                                                             backend=args.backend),
            stores[0][0].nbytes() * 2, rel_err(out, ref), {})

    for spec in (kivi.KiviSpec(bits=2), kivi.KiviSpec(bits=2, group=16, value_group=16),
                 kivi.KiviSpec(bits=2, key_bits=4), kivi.KiviSpec(bits=4)):
        stores = []
        for _ in range(copies):
            store = kivi.alloc(spec, batch, hkv, length, d, device)
            kivi.load(store, k, v)
            stores.append(store)
        ref = kivi.attend(q, stores[0], lengths, scale)
        for variant in args.kivi_variants:
            ws = make_kivi_workspace(hq, stores[0], variant=variant)
            out = kivi_decode_attention(q, stores[0], lengths, scale, workspace=ws, backend=args.backend)
            name = spec.label if variant == "split" else f"{spec.label}:{variant}"
            reads[name] = (lambda i, stores=stores, ws=ws: kivi_decode_attention(q, stores[i], lengths, scale,
                                                                                 workspace=ws, backend=args.backend),
                           stores[0].nbytes(), rel_err(out, ref),
                           {"err_vs_bf16": rel_err(out, dense_ref),
                            "variant": kivi_variant(variant, stores[0], hq // hkv), "num_splits": ws.num_splits})

    quest_cases = [(b, t) for b in args.budgets for t in args.quest_tokens_per_iter] if "quest" not in args.skip else []
    parts = {}  # a Quest row's selection and sparse kernel, timed in the same alternation as its step
    for budget, per_iter in quest_cases:
        spec = quest.QuestSpec(page=16, budget=budget)
        bounds = quest.alloc_bounds(spec, batch, hkv, length, d, device=device)
        quest.load_bounds(bounds, k)
        pages = quest.select_pages(q, bounds, lengths, args.backend)
        ws = make_quest_workspace(hq, batch, hkv, pages.shape[2], d, device, page=16, tokens_per_iter=per_iter)
        out = quest_decode_attention(q, *dense[0], pages, lengths, scale, 16, token_dim=2, workspace=ws,
                                     backend=args.backend)
        ref = quest.sparse_attend(q, k, v, pages, lengths, scale, 16)

        def attend(i, pages=pages, ws=ws):
            return quest_decode_attention(q, *dense[i], pages, lengths, scale, 16, token_dim=2, workspace=ws,
                                          backend=args.backend)

        def step(i, bounds=bounds, ws=ws):
            pages = quest.select_pages(q, bounds, lengths, args.backend)
            return quest_decode_attention(q, *dense[i], pages, lengths, scale, 16, token_dim=2, workspace=ws,
                                          backend=args.backend)

        name = f"quest-{budget}:t{per_iter}"
        read = bounds.kmin.numel() * 2 * 2 + 2 * batch * hkv * pages.shape[2] * 16 * d * 2
        reads[name] = (step, read, rel_err(out, ref), {"pages": pages.shape[2], "num_splits": ws.num_splits})
        parts[name] = {"select_ms": lambda i, bounds=bounds: quest.select_pages(q, bounds, lengths, args.backend),
                       "attend_ms": attend}

    fns = {name: fn for name, (fn, *_) in reads.items()}
    fns.update({(name, part): fn for name, p in parts.items() for part, fn in p.items()})
    ms = timed_alternating(fns, copies, device, args.reps)
    for name, (_, nbytes, err, extra) in reads.items():
        timed_parts = {part: ms[(name, part)] for part in parts.get(name, {})}
        record(name, ms[name], nbytes, err, **timed_parts, **extra, alternated_with=len(reads) - 1, reps=args.reps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--quest-tokens-per-iter", type=int, nargs="+", default=[64],
                        help="tokens the sparse kernel gathers per iteration (pages of 16: 16, 32, 64, ...)")
    parser.add_argument("--kivi-variants", nargs="+", default=["split"], choices=VARIANTS,
                        help="KIVI decode kernels to time side by side (kvlab.kernels.kivi_decode.VARIANTS)")
    parser.add_argument("--skip", nargs="+", default=[], choices=["fused", "quest"],
                        help="leave out kvlab's fused bf16/int4 rows or the Quest rows (flash and KIVI always run)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        args.lengths, args.batches, args.budgets = [300], [1], [64]
    rows = []
    card = device_card(args.device)
    for length in args.lengths:
        for batch in args.batches:
            try:
                run_case(batch, length, args, device, rows)
            except Exception as err:  # report and go on: one failing case must not lose the others
                traceback.print_exc()
                rows.append({"batch": batch, "length": length, "error": repr(err)})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.out:  # each row names its card
                args.out.write_text(json.dumps([{**r, "card": card} for r in rows], indent=1))


if __name__ == "__main__":
    main()
