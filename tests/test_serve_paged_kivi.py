"""The KIVI-style pool's paged decode kernel (code blocks through the table, the exact tail after them)
against the pool's own torch read of a decode row, in the Triton interpreter: 2 and 4 bits, K4V2,
requests with no code block yet, with whole groups and with a flush on the decode token itself, GQA;
and the serving engine's decode steps through it."""

from __future__ import annotations

import pytest
import torch
from kernel_paths import serving_logits_by_attention

from kvlab.kernels.kivi import KiviSpec
from kvlab.kernels.paged import table_slots
from kvlab.storage.kivi import KiviPool
from kvlab.storage.paged import PoolShape

TOL = {"atol": 3e-3, "rtol": 1e-2}  # float16 products, float32 accumulation
# prompts then one decode token each: 5 (all exact), 40 (codes and a tail), 47 (the decode token flushes
# a group: 48 - R = 32 quantized), 70
PROMPTS = (5, 40, 47, 70)


@pytest.mark.parametrize("spec, hq, hkv, dim", [
    (KiviSpec(bits=2, group=16, residual=16, value_group=16), 8, 2, 64),
    (KiviSpec(bits=4, group=16, residual=16, value_group=32), 4, 4, 32),
    (KiviSpec(bits=2, key_bits=4, group=32, residual=8, value_group=32), 12, 2, 64),
])
def test_paged_kivi_kernel_matches_the_pools_read(spec, hq, hkv, dim):
    gen = torch.Generator().manual_seed(0)
    g = spec.group
    per = [-(-(n + 1) // g) for n in PROMPTS]
    pool = KiviPool(spec, PoolShape(1, sum(per) + 2, g, hkv, dim), torch.float32, "cpu")
    assert pool.paged_kernel
    free = torch.randperm(sum(per) + 2, generator=gen).tolist()
    rows, held = [], []
    for n, blocks in zip(PROMPTS, per, strict=True):
        row = [free.pop() for _ in range(blocks)]
        slots = table_slots(row, n + 1, g, "cpu")
        k, v = torch.randn(n + 1, hkv, dim, generator=gen), torch.randn(n + 1, hkv, dim, generator=gen)
        k[..., 2] += 8.0  # an outlier channel: the per-channel key groups take it
        pool.write(0, slots[:n], k[:n], v[:n], owner=row[0], first=True)  # the prompt
        pool.write(0, slots[n:], k[n:], v[n:], owner=row[0])  # its first decode token
        rows.append(row + [0] * (max(per) - len(row)))
        held.append(slots)
    tables = torch.tensor(rows, dtype=torch.int32)
    lengths = torch.tensor([n + 1 for n in PROMPTS], dtype=torch.int32)
    q = torch.randn(len(PROMPTS), hq, dim, generator=gen)
    assert [pool.tails[0][r[0]].quantized for r in rows] == [spec.quantized_tokens(n + 1) for n in PROMPTS]
    # the reference: the pool's own read of each request's decode row (what the engine runs on CPU)
    want = torch.stack([pool.attend(0, q[b][:, None], held[b], dim ** -0.5, 0)[:, 0] for b in range(len(PROMPTS))])
    got = pool.decode(0, q, tables, lengths, dim ** -0.5)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got, want, **TOL)


def test_the_engine_decodes_kivi_through_the_paged_kernel():
    """Prompts in one chunk and over several, groups flushed while decoding: each step's logits as the
    pool's torch read gives them."""
    params = {"nbits": 4, "q_group_size": 16, "residual_length": 16, "value_group": 16}
    logits, kernel_rows = serving_logits_by_attention("kivi", params, 20)
    assert len(logits["triton"]) == len(logits["reference"]) > 20
    assert sum(len(rows) for rows in kernel_rows) >= 2 * 19 * 3  # layers x decode steps x requests
    for ref, got in zip(logits["reference"], logits["triton"], strict=True):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-2)

