"""The KIVI decode kernel (kvlab.kernels.kivi_decode) against the torch reference: compiled on a GPU,
interpreted on CPU (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported)."""

from __future__ import annotations

import os

import pytest
import torch

from kvlab.kernels import kivi
from kvlab.kernels.kivi_decode import (
    kivi_append,
    kivi_decode_attention,
    make_kivi_workspace,
    plan_kivi_splits,
)

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1 (set it before triton is imported)", allow_module_level=True)

TOL = {"atol": 3e-3, "rtol": 1e-2}


def filled(spec, lengths, heads=2, dim=64, capacity=150, seed=0):
    """A store whose row ``b`` holds ``lengths[b]`` tokens (rows loaded one by one)."""
    gen = torch.Generator().manual_seed(seed)
    store = kivi.alloc(spec, len(lengths), heads, capacity, dim, device=DEVICE)
    for b, n in enumerate(lengths):
        k = torch.randn(1, heads, n, dim, generator=gen) * 2
        v = torch.randn(1, heads, n, dim, generator=gen)
        k[..., 3] += 8  # an outlier channel
        kivi.load(store.rows(slice(b, b + 1)), k.to(DEVICE), v.to(DEVICE))
    return store


@pytest.mark.parametrize("bits,key_bits", [(2, None), (4, None), (2, 4)])
def test_kernel_matches_reference(bits, key_bits):
    # rows: codes and ring, empty, ring only, exactly R + G (one group just flushed); GQA 4
    spec = kivi.KiviSpec(bits=bits, group=16, residual=32, value_group=32, key_bits=key_bits)
    lengths = [150, 0, 20, 48]
    store = filled(spec, lengths)
    q = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    ws = make_kivi_workspace(8, store, num_splits=3)
    got = kivi_decode_attention(q, store, lens, 0.125, workspace=ws, backend="triton")
    want = kivi.attend(q, store, lens, 0.125)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.float(), want, **TOL)
    assert not got[1].any()  # an empty row attends to nothing


def test_kernel_after_appends_across_a_flush():
    spec = kivi.KiviSpec(bits=2, group=16, residual=32, value_group=32)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(2, 1, 70, 64, generator=gen).to(DEVICE)
    v = torch.randn(2, 1, 70, 64, generator=gen).to(DEVICE)
    store = kivi.alloc(spec, 2, 1, 70, 64, device=DEVICE)
    kivi.load(store, k[:, :, :60], v[:, :, :60])
    q = torch.randn(2, 3, 64, generator=gen).to(DEVICE)  # GQA 3 (padded to 16 rows)
    for t in range(60, 66):  # 64 = R + 2G: a group flushes at t = 63
        kivi.append(store, k[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([t], device=DEVICE))
    lens = torch.tensor([66, 66], dtype=torch.int32, device=DEVICE)
    got = kivi_decode_attention(q, store, lens, 0.125, backend="triton")
    torch.testing.assert_close(got.float(), kivi.attend(q, store, lens, 0.125), **TOL)


def test_split_plan_covers_every_group():
    for groups in (1, 7, 100, 511):
        for batch in (1, 16):
            n, per = plan_kivi_splits(batch, 8, groups, 132)
            assert n * per >= groups and (n - 1) * per < groups


@pytest.mark.parametrize("key_bits,residual", [(None, 32), (4, 32), (None, 0)])
def test_append_kernel_matches_torch_append(key_bits, residual):
    """Bit for bit (interpreted; compiled code may move a code on a rounding tie by one) over steps
    that cross flushes; the trash group aside (the kernel never writes it). With R = 0 the group
    flushed holds the token just written."""
    spec = kivi.KiviSpec(bits=2, group=16, residual=residual, value_group=16, key_bits=key_bits)
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(2, 2, 90, 64, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(2, 2, 90, 64, generator=gen).to(DEVICE, torch.bfloat16)
    ours, ref = (kivi.alloc(spec, 2, 2, 90, 64, device=DEVICE) for _ in range(2))
    for store in (ours, ref):
        kivi.load(store, k[:, :, :44], v[:, :, :44])
    for t in range(44, 82):  # flushes at t = 47, 63 and 79 (either residual)
        pos = torch.tensor([t], device=DEVICE)
        kivi_append(ours, k[:, :, t:t + 1], v[:, :, t:t + 1], pos, backend="triton")
        kivi.append(ref, k[:, :, t:t + 1], v[:, :, t:t + 1], pos)
    for got, want in zip(kivi.dequantize(ours, 82), kivi.dequantize(ref, 82), strict=True):
        if DEVICE == "cpu":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=0.35, rtol=0)  # at most one code step apart
