"""The kvq pool's fused paged decode kernel (codes read through block tables, dequantized in registers)
against its torch reference, in the Triton interpreter on CPU: fp8, int4 and int2, with and without the
key offset, ragged lengths across a batch, GQA, blocks scattered as a pool hands them out; and the
serving engine's decode steps through it."""

from __future__ import annotations

import pytest
import torch
from kernel_paths import serving_logits_by_attention

from kvlab.kernels.formats import parse_format
from kvlab.kernels.paged import paged_kvq_decode, paged_kvq_reference, table_slots
from kvlab.storage.kvq import KVQPool
from kvlab.storage.paged import PoolShape

TOL = {"atol": 3e-3, "rtol": 1e-2}  # float16 products, float32 accumulation (the contiguous kernels' tolerance)
LENGTHS = (1, 17, 40, 5)  # ragged: one token, block boundaries crossed, a partial last block


def filled_pool(fmt: str, hkv: int, dim: int, block_size: int, key_offset: str, seed: int = 0):
    """A one-layer kvq pool holding ``LENGTHS`` requests' K/V in scattered blocks (keys with one loud,
    nearly constant channel, as a k_proj bias gives): the pool, block tables and lengths."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in LENGTHS) + 3
    pool = KVQPool(parse_format(fmt), PoolShape(1, num_blocks, block_size, hkv, dim), torch.float32, "cpu", key_offset)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    rows = []
    for n in LENGTHS:
        row = [free.pop() for _ in range(-(-n // block_size))]
        keys = torch.randn(n, hkv, dim, generator=gen)
        keys[..., 3] += 20.0
        first = min(n, 9)  # the prompt's chunk fits the request's key offset; later tokens reuse it
        slots = table_slots(row, n, block_size, "cpu")
        values = torch.randn(n, hkv, dim, generator=gen)
        pool.write(0, slots[:first], keys[:first], values[:first], owner=row[0], first=True)
        if n > first:
            pool.write(0, slots[first:], keys[first:], values[first:], owner=row[0])
        rows.append(row)
    width = max(len(r) for r in rows) + 1  # a padded table, as the engine builds one
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    return pool, tables, torch.tensor(LENGTHS, dtype=torch.int32)


@pytest.mark.parametrize("key_offset", ["none", "prompt-mean"])
@pytest.mark.parametrize("fmt, hq, hkv, dim, block_size", [
    ("fp8", 8, 2, 32, 16),
    ("int4-g32", 4, 4, 32, 4),  # blocks smaller than a tile: a tile spans several blocks
    ("int4-g64", 12, 2, 64, 16),  # GQA 6, padded to 16 rows
    ("int2-g64", 9, 3, 64, 16),
    ("int2-g32", 6, 2, 64, 8),
])
def test_paged_kvq_kernel_matches_the_reference(fmt, hq, hkv, dim, block_size, key_offset):
    pool, tables, lengths = filled_pool(fmt, hkv, dim, block_size, key_offset)
    assert pool.paged_kernel
    q = torch.randn(len(LENGTHS), hq, dim, generator=torch.Generator().manual_seed(1))
    ref = paged_kvq_reference(q, pool.k[0], pool.v[0], tables, lengths, block_size, dim ** -0.5)
    got = pool.decode(0, q, tables, lengths, dim ** -0.5)
    assert got.dtype == q.dtype and got.shape == ref.shape
    torch.testing.assert_close(got, ref, **TOL)
    # the kernel reads the codes it was given: a request's blocks moved elsewhere change its row only
    other = tables.clone()
    other[1, 0] = tables[2, 0]
    moved = paged_kvq_decode(q, pool.k[0], pool.v[0], other, lengths, block_size, dim ** -0.5)
    assert not torch.allclose(moved[1], got[1], **TOL)
    torch.testing.assert_close(moved[[0, 2, 3]], got[[0, 2, 3]])


@pytest.mark.parametrize("fmt, key_offset", [("int4-g32", "prompt-mean"), ("fp8", "none")])
def test_the_reference_is_the_pools_own_read(fmt, key_offset):
    """What the engine reads on CPU (the pool's ``attend`` over a request's held slots) is the reference."""
    pool, tables, lengths = filled_pool(fmt, 2, 32, 8, key_offset, seed=2)
    q = torch.randn(len(LENGTHS), 4, 32, generator=torch.Generator().manual_seed(3))
    ref = paged_kvq_reference(q, pool.k[0], pool.v[0], tables, lengths, 8, 0.2)
    for b, n in enumerate(LENGTHS):
        held = table_slots(tables[b].tolist(), n, 8, "cpu")
        torch.testing.assert_close(pool.attend(0, q[b][:, None], held, 0.2, 0)[:, 0], ref[b], atol=1e-5, rtol=1e-5)


def test_a_head_dim_the_kernels_cannot_read_keeps_the_reference():
    assert not KVQPool(parse_format("int2-g32"), PoolShape(1, 2, 4, 1, 32), torch.float32, "cpu").paged_kernel
    assert KVQPool(parse_format("int4-g32"), PoolShape(1, 2, 4, 1, 32), torch.float32, "cpu").paged_kernel


@pytest.mark.parametrize("method", ["kvq-int4", "kvq-fp8"])
def test_the_engine_decodes_kvq_through_the_paged_kernel(method):
    """Prompts of several chunks, decode steps batched through the kernel: each request's logits as the
    torch reference reads the same codes."""
    params = {"q_group_size": 32} if method == "kvq-int4" else {}
    logits, kernel_rows = serving_logits_by_attention(method, params, 5)
    assert len(logits["triton"]) == len(logits["reference"]) > 5
    assert sum(len(rows) for rows in kernel_rows) >= 2 * 4 * 3  # layers x decode steps x requests, at least
    for ref, got in zip(logits["reference"], logits["triton"], strict=True):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-2)

