"""The serving engine's decode attention over block tables, one layer, side by side on one card: the
kvq pools' fused paged kernel (:func:`kvlab.kernels.paged.paged_kvq_decode`) against the same pool read
through its torch reference (what the engine ran on CUDA before the kernel: each request's held slots
dequantized, then attended, :meth:`kvlab.storage.kvq.KVQPool.attend`) and against the model-dtype pool's
paged kernel (:func:`kvlab.kernels.paged.paged_decode`). Not a test: a script for a GPU call.

    python benchmarks/serve_paged_kvq.py --out serve_paged_kvq.json                     # ~1 min on a GPU
    TRITON_INTERPRET=1 python benchmarks/serve_paged_kvq.py --device cpu --quick        # smoke test

At ``--shape`` (Llama-3.1-8B's attention: Hq 32, Hkv 8, D 128), bf16, pool blocks of ``--block-size``
tokens scattered as an allocator hands them out, every request ``--ctx`` tokens (the first one 100
short: a partial last block), per ``--batches`` and ``--formats``: rows ``dense`` (bf16 pool, paged
kernel), ``<format>`` (kvq pool, paged kernel) and ``<format>:reference`` (kvq pool, torch reference;
``--reference-max-batch`` bounds its batches, its Python loop costs a host sync per request). Each row
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
from kvlab.kernels.paged import paged_kvq_reference, table_slots  # noqa: E402
from kvlab.repeats import alternate  # noqa: E402
from kvlab.storage.dense import DensePool  # noqa: E402
from kvlab.storage.kvq import KVQPool  # noqa: E402
from kvlab.storage.paged import PoolShape  # noqa: E402


def pools_and_tables(batch, ctx, hq, hkv, d, block_size, formats, device):
    """A bf16 pool and one kvq pool per format holding the same K/V (prompt-mean key offset), block
    tables, lengths and a query batch."""
    gen = torch.Generator().manual_seed(batch * 31 + ctx)
    lengths = [max(1, ctx - 100)] + [ctx] * (batch - 1)
    per = -(-ctx // block_size)
    shape = PoolShape(1, batch * per + 1, block_size, hkv, d)
    order = torch.randperm(batch * per, generator=gen).tolist()
    rows = [order[i * per:(i + 1) * per] for i in range(batch)]
    dense = DensePool(shape, torch.bfloat16, device)
    kvq = {f: KVQPool(parse_format(f), shape, torch.bfloat16, device, "prompt-mean") for f in formats}
    for row, n in zip(rows, lengths, strict=True):
        slots = table_slots(row, n, block_size, device)
        k = torch.randn(n, hkv, d, generator=gen).to(device, torch.bfloat16)
        k[..., 7] += 6  # an outlier channel, as real keys have
        v = torch.randn(n, hkv, d, generator=gen).to(device, torch.bfloat16)
        for pool in (dense, *kvq.values()):
            pool.write(0, slots, k, v, owner=row[0], first=True)
    tables = torch.tensor(rows, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, generator=gen).to(device, torch.bfloat16)
    return dense, kvq, tables, torch.tensor(lengths, dtype=torch.int32, device=device), q


def reference_read(pool, q, tables, lengths, block_size, scale):
    """The engine's read before the kernel: per request, its held slots through ``pool.attend``."""
    out = [pool.attend(0, q[b][:, None], table_slots(row, n, block_size, q.device), scale, 0)[:, 0]
           for b, (row, n) in enumerate(zip(tables.tolist(), lengths.tolist(), strict=True))]
    return torch.stack(out)


def said(ratio: dict) -> str:
    """A ratio with its interval, or its value and n where it has none."""
    if ratio["lo"] is None:
        return f"{ratio['value']:.3f} (n={ratio['n']}, no interval)"
    return f"{ratio['value']:.3f} [{ratio['lo']:.3f}, {ratio['hi']:.3f}]"


def run_case(batch: int, ctx: int, args, clock) -> list[dict]:
    """Every row of one (batch, ctx) case, timed in one alternation; printed as they come."""
    hq, hkv, d = args.shape
    scale, bs = d ** -0.5, args.block_size
    dense, kvq, tables, lengths, q = pools_and_tables(batch, ctx, hq, hkv, d, bs, args.formats, args.device)
    fns = {"dense": lambda: dense.decode(0, q, tables, lengths, scale)}
    errors = {}
    for fmt, pool in kvq.items():
        fns[fmt] = lambda pool=pool: pool.decode(0, q, tables, lengths, scale)
        ref = paged_kvq_reference(q, pool.k[0], pool.v[0], tables, lengths, bs, scale)
        errors[fmt] = float((fns[fmt]().float() - ref).norm() / ref.norm())
        if batch <= args.reference_max_batch:
            fns[f"{fmt}:reference"] = lambda pool=pool: reference_read(pool, q, tables, lengths, bs, scale)
    for fn in fns.values():  # compile and warm up outside the timed rounds
        fn()
    times = alternate({name: (lambda fn=fn: clock.sample_ms(fn, args.iters)) for name, fn in fns.items()}, args.repeats)
    rows = []
    for name, t in times.items():
        fmt = name.split(":")[0]
        row = {"ctx": ctx, "batch": batch, "row": name, "ms": statistics.median(t), "ms_all": t, "n": len(t),
               "vs_dense": ratio_interval(t, times["dense"]).to_dict(), "rel_err": errors.get(name)}
        if f"{fmt}:reference" in times and name == fmt:
            row["vs_reference"] = ratio_interval(t, times[f"{fmt}:reference"]).to_dict()
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
    p.add_argument("--reference-max-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="tiny shapes for a CPU smoke test (TRITON_INTERPRET=1)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.ctx, args.shape, args.formats = [2], [40], [4, 2, 32], ["int4-g32"]
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
