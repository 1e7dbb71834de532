"""The serving engine's decode attention over block tables, one layer, side by side on one card: the
kvq and KIVI-style pools' fused paged kernels (:func:`kvlab.kernels.paged.paged_kvq_decode`,
:func:`~kvlab.kernels.paged.paged_kivi_decode`) against the same pools read through their torch
reference (what the engine ran on CUDA before the kernels: each request's held slots dequantized, then
attended, ``KVQPool.attend`` / ``KiviPool.attend``) and against the model-dtype pool's paged kernel
(:func:`kvlab.kernels.paged.paged_decode`). Not a test: a script for a GPU call.

    python benchmarks/serve_paged_decode.py --out serve_paged_decode.json               # ~1 min on a GPU
    TRITON_INTERPRET=1 python benchmarks/serve_paged_decode.py --device cpu --quick     # smoke test

At ``--shape`` (Llama-3.1-8B's attention: Hq 32, Hkv 8, D 128), bf16, pool blocks of ``--block-size``
tokens scattered as an allocator hands them out, every request ``--ctx`` tokens (the first one 100
short: a partial last block), per ``--batches``, ``--formats`` and ``--kivi``: rows ``dense`` (bf16
pool, paged kernel), ``<format>`` / ``<kivi>`` (kvq / KIVI-style pool, paged kernel; KIVI R 128, its
blocks of ``--kivi-group`` tokens, one key group each) and ``<row>:reference`` (the same pool, torch
reference; ``--reference-max-batch`` bounds its batches, its Python loop costs a host sync per request). Each row
runs ``--iters`` calls per sample, eager (the engine's kvq decode steps are eager), rows alternating
round by round (ABAB..., ``--repeats`` rounds, :func:`kvlab.repeats.alternate`). Printed side by side:
median ms, and each row's mean time over ``dense``'s and each kernel's over its reference's with a
Welch-log interval (:mod:`kvlab.intervals`; none below 3 rounds a side, ``n`` printed). ``rel_err``:
||kernel - reference|| / ||reference|| on the same codes. The JSON keeps every sample and the card.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_timing import Clock  # noqa: E402

from kvlab.card import device_card  # noqa: E402
from kvlab.intervals import ratio_interval  # noqa: E402
from kvlab.kernels.formats import parse_format  # noqa: E402
from kvlab.kernels.kivi import KiviSpec  # noqa: E402
from kvlab.kernels.paged import paged_kvq_reference, table_slots  # noqa: E402
from kvlab.repeats import alternate  # noqa: E402
from kvlab.storage.dense import DensePool  # noqa: E402
from kvlab.storage.kivi import KiviPool  # noqa: E402
from kvlab.storage.kvq import KVQPool  # noqa: E402
from kvlab.storage.paged import PoolShape  # noqa: E402

KIVI = {"kivi2": {"bits": 2}, "kivi-k4v2": {"bits": 2, "key_bits": 4}, "kivi4": {"bits": 4}}  # --kivi rows


def filled(pools: dict, block_size: int, lengths: list[int], hkv: int, d: int, device, seed: int):
    """``pools`` (name -> pool of ``block_size`` blocks) each holding the same K/V per request (keys with
    an outlier channel, as real keys have), in blocks scattered as an allocator hands them out; the
    block tables."""
    gen = torch.Generator().manual_seed(seed)
    per = -(-max(lengths) // block_size)
    order = torch.randperm(len(lengths) * per, generator=gen).tolist()
    rows = [order[i * per:(i + 1) * per] for i in range(len(lengths))]
    for row, n in zip(rows, lengths, strict=True):
        slots = table_slots(row, n, block_size, device)
        k = torch.randn(n, hkv, d, generator=gen).to(device, torch.bfloat16)
        k[..., 7] += 6
        v = torch.randn(n, hkv, d, generator=gen).to(device, torch.bfloat16)
        for pool in pools.values():
            pool.write(0, slots, k, v, owner=row[0], first=True)
    return torch.tensor(rows, dtype=torch.int32, device=device)


def reference_read(pool, q, tables, lengths, block_size, scale):
    """The engine's read before the kernel: per request, its held slots through ``pool.attend``."""
    out = [pool.attend(0, q[b][:, None], table_slots(row, n, block_size, q.device), scale, 0)[:, 0]
           for b, (row, n) in enumerate(zip(tables.tolist(), lengths.tolist(), strict=True))]
    return torch.stack(out)


def kivi_reference_read(pool, q, tables, lengths, scale):
    """:func:`reference_read` of a KIVI-style pool: each request's decode row as ``KiviPool.attend``
    reads it right after the row's write (codes, then the exact tail)."""
    for row in tables.tolist():
        tail = pool.tails[0][row[0]]
        pool.chunks[0][row[0]] = (tail.quantized, tail.k.float(), tail.v.float())
    return reference_read(pool, q, tables, lengths, pool.block_size, scale)


def said(ratio: dict) -> str:
    """A ratio with its interval, or its value and n where it has none."""
    if ratio["lo"] is None:
        return f"{ratio['value']:.3f} (n={ratio['n']}, no interval)"
    return f"{ratio['value']:.3f} [{ratio['lo']:.3f}, {ratio['hi']:.3f}]"


def run_case(batch: int, ctx: int, args, clock) -> list[dict]:
    """Every row of one (batch, ctx) case, timed in one alternation; printed as they come."""
    hq, hkv, d = args.shape
    scale, bs, device = d ** -0.5, args.block_size, args.device
    lengths = [max(1, ctx - 100)] + [ctx] * (batch - 1)
    shape = PoolShape(1, batch * -(-ctx // bs) + 1, bs, hkv, d)
    pools = {"dense": DensePool(shape, torch.bfloat16, device),
             **{f: KVQPool(parse_format(f), shape, torch.bfloat16, device, "prompt-mean") for f in args.formats}}
    tables = filled(pools, bs, lengths, hkv, d, device, seed=batch * 31 + ctx)
    g = args.kivi_group
    kivi_shape = PoolShape(1, batch * -(-ctx // g) + 1, g, hkv, d)
    kivi = {name: KiviPool(KiviSpec(group=g, **KIVI[name]), kivi_shape, torch.bfloat16, device) for name in args.kivi}
    kivi_tables = filled(kivi, g, lengths, hkv, d, device, seed=batch * 31 + ctx)
    length = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, generator=torch.Generator().manual_seed(ctx)).to(device, torch.bfloat16)
    dense = pools.pop("dense")
    fns = {"dense": lambda: dense.decode(0, q, tables, length, scale)}
    errors = {}
    for fmt, pool in pools.items():
        fns[fmt] = lambda pool=pool: pool.decode(0, q, tables, length, scale)
        errors[fmt] = paged_kvq_reference(q, pool.k[0], pool.v[0], tables, length, bs, scale)
        if batch <= args.reference_max_batch:
            fns[f"{fmt}:reference"] = lambda pool=pool: reference_read(pool, q, tables, length, bs, scale)
    for name, pool in kivi.items():
        fns[name] = lambda pool=pool: pool.decode(0, q, kivi_tables, length, scale)
        errors[name] = kivi_reference_read(pool, q, kivi_tables, length, scale).float()
        if batch <= args.reference_max_batch:
            fns[f"{name}:reference"] = lambda pool=pool: kivi_reference_read(pool, q, kivi_tables, length, scale)
    errors = {name: float((fns[name]().float() - ref).norm() / ref.norm()) for name, ref in errors.items()}
    for fn in fns.values():  # compile and warm up outside the timed rounds
        fn()
    times = alternate({name: (lambda fn=fn: clock.sample_ms(fn, args.iters)) for name, fn in fns.items()}, args.repeats)
    rows = []
    for name, t in times.items():
        base = name.split(":")[0]
        row = {"ctx": ctx, "batch": batch, "row": name, "ms": statistics.median(t), "ms_all": t, "n": len(t),
               "block_size": g if base in kivi else bs,
               "vs_dense": ratio_interval(t, times["dense"]).to_dict(), "rel_err": errors.get(name)}
        if f"{base}:reference" in times and name == base:
            row["vs_reference"] = ratio_interval(t, times[f"{base}:reference"]).to_dict()
        rows.append(row)
        print(f"ctx={ctx:6d} b={batch:3d} {name:20s} {row['ms']:9.3f} ms  x dense {said(row['vs_dense'])}"
              + (f"  x reference {said(row['vs_reference'])}" if "vs_reference" in row else "") + f"  (n={row['n']})")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--ctx", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--shape", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
    p.add_argument("--formats", nargs="+", default=["fp8", "int4-g64", "int2-g64"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kivi", nargs="*", default=list(KIVI), choices=list(KIVI))
    p.add_argument("--kivi-group", type=int, default=32, help="KIVI key group = its pool's block size (R = 128)")
    p.add_argument("--reference-max-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="tiny shapes for a CPU smoke test (TRITON_INTERPRET=1)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.ctx, args.shape, args.formats = [2], [40], [4, 2, 32], ["int4-g32"]
        args.kivi, args.kivi_group = ["kivi4"], 16
        args.iters, args.repeats = 1, 3
    clock = Clock(args.device)
    results = []
    for ctx in args.ctx:
        for batch in args.batches:
            results += run_case(batch, ctx, args, clock)
    if args.out:
        Path(args.out).write_text(json.dumps({"card": device_card(args.device), "args": vars(args), "rows": results},
                                             indent=1))


if __name__ == "__main__":
    main()
