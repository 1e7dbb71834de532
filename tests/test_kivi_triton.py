"""The KIVI decode kernel (kvlab.kernels.kivi_decode) against the torch reference: compiled on a GPU,
interpreted on CPU (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlab.kernels import kivi
from kvlab.kernels.formats import FormatError
from kvlab.kernels.kivi_decode import (
    kivi_append,
    kivi_decode_attention,
    kivi_variant,
    make_kivi_workspace,
    plan_kivi_splits,
    warp_problem,
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


# -- the warp variant (kvlab.kernels.kivi_warp): head dim 128, the store layout unchanged ----------
@pytest.mark.parametrize("bits,key_bits,gqa", [(2, None, 4), (2, 4, 4), (4, None, 4), (2, None, 1), (2, 4, 1),
                                               (4, 2, 3)])
def test_warp_kernel_matches_reference(bits, key_bits, gqa):
    """k2v2, k4v2, k4v4 (and k2v4) at GQA 4, 1 and 3 against the torch reference. Rows: 11 groups
    over 3 splits of 4 (full blocks of 4 warps, and a last block whose fourth warp is past the split),
    empty, ring only (odd length), R + 2G exactly, an odd length with the ring partly full."""
    spec = kivi.KiviSpec(bits=bits, group=32, residual=32, value_group=32, key_bits=key_bits)
    lengths = [390, 0, 21, 96, 203]
    store = filled(spec, lengths, dim=128, capacity=400)
    q = torch.randn(len(lengths), 2 * gqa, 128, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    ws = make_kivi_workspace(2 * gqa, store, num_splits=3, variant="warp_asm")
    assert (ws.num_splits, ws.split_groups) == (3, 4)
    assert kivi_variant("warp_asm", store, gqa) == ("warp" if DEVICE == "cpu" else "warp_asm")
    got = kivi_decode_attention(q, store, lens, 0.125, workspace=ws, backend="triton")
    want = kivi.attend(q, store, lens, 0.125)
    torch.testing.assert_close(got.float(), want, **TOL)
    assert not got[1].any()


def test_warp_kernel_after_appends_and_with_one_split():
    """Groups flushed by the append kernel, G 16 (a warp reads one 16-token group per block), value groups
    of 64 (two per head), one split holding every group, the variant passed per call over a workspace
    made for split."""
    spec = kivi.KiviSpec(bits=2, group=16, residual=16, value_group=64, key_bits=4)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 140, 128, generator=gen).to(DEVICE)
    v = torch.randn(2, 2, 140, 128, generator=gen).to(DEVICE)
    store = kivi.alloc(spec, 2, 2, 140, 128, device=DEVICE)
    kivi.load(store, k[:, :, :100], v[:, :, :100])
    for t in range(100, 133):
        kivi_append(store, k[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([t], device=DEVICE), backend="triton")
    q = torch.randn(2, 8, 128, generator=gen).to(DEVICE)
    lens = torch.tensor([133, 117], dtype=torch.int32, device=DEVICE)
    ws = make_kivi_workspace(8, store, num_splits=1)
    got = kivi_decode_attention(q, store, lens, 0.1, workspace=ws, backend="triton", variant="warp")
    torch.testing.assert_close(got.float(), kivi.attend(q, store, lens, 0.1), **TOL)


def test_warp_variant_falls_back_where_it_cannot_read():
    """Head dim 64 of 2-bit codes (8 words a plane), 8 value groups, or more than 16 rows: ``split`` runs."""
    assert warp_problem(kivi.KiviSpec(), 128, 4) is None
    assert warp_problem(kivi.KiviSpec(bits=4), 64, 4) is None
    assert "words" in warp_problem(kivi.KiviSpec(), 64, 4)
    assert "rows" in warp_problem(kivi.KiviSpec(value_group=16), 128, 4)
    assert "rows" in warp_problem(kivi.KiviSpec(), 128, 8)
    spec = kivi.KiviSpec(bits=2, group=16, residual=32, value_group=32)
    store = filled(spec, [150, 40])
    assert kivi_variant("warp_asm", store, 4) == "split"
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    lens = torch.tensor([150, 40], dtype=torch.int32, device=DEVICE)
    got = kivi_decode_attention(q, store, lens, 0.125, backend="triton", variant="warp_asm")
    torch.testing.assert_close(got.float(), kivi.attend(q, store, lens, 0.125), **TOL)
    with pytest.raises(FormatError):
        make_kivi_workspace(8, store, variant="fold")


def _emulate(text: str, word: int) -> dict[str, int]:
    """The shifts and ``lop3`` of the unpacking PTX on one 32-bit register ``$8`` (or ``$4``)."""
    regs = {"$8": word, "$4": word}
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *args = [a.strip() for a in rest.split(",")]
        val = [regs[a] if a in regs else int(a, 0) for a in args]
        if op == "shl.b32":
            regs[dst] = (val[0] << val[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[dst] = val[0] >> val[1]
        elif op == "lop3.b32":
            assert val[3] == 0xEA  # (a & b) | c
            regs[dst] = (val[0] & val[1]) | val[2]
        else:
            raise AssertionError(f"unexpected PTX {op}")
    return regs


def test_int2_word_ptx_makes_one_plus_code_over_unit():
    """The warp_asm unpacking (compiled only) against its definition: plane P of each int16 word of a
    register pair is float16 ``1 + c / plane_unit(P)``, c at bits [2P, 2P + 2)."""
    from kvlab.kernels.kivi_warp import INT2_WORDS_PTX, plane_unit

    text = INT2_WORDS_PTX.value if hasattr(INT2_WORDS_PTX, "value") else INT2_WORDS_PTX
    gen = torch.Generator().manual_seed(0)
    words = [w | ((w * 40503 + 12345) & 0xFFFF) << 16 for w in range(0, 65536, 97)]
    words += torch.randint(0, 2**32, (256,), generator=gen, dtype=torch.int64).tolist()
    for word in words:
        regs = _emulate(text, word)
        for plane in range(8):
            halves = [regs[f"${plane}"] & 0xFFFF, regs[f"${plane}"] >> 16]
            got = torch.tensor(halves, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
            codes = torch.tensor([(word >> (16 * h + 2 * plane)) & 3 for h in range(2)], dtype=torch.float32)
            assert torch.equal(got, 1 + codes / plane_unit(plane, 2)), (hex(word), plane)


@pytest.mark.slow(reason="compiles the KIVI kernels for sm_90 with triton's ptxas in a subprocess (~30 s)")
def test_warp_kernel_compiles_for_sm90_with_fewer_instructions_per_token():
    """The PTX path the interpreter cannot run, compiled (benchmarks/kernel_sass.py --kivi, no GPU needed):
    k2v2, k4v2 and k4v4 build, and warp_asm issues under 0.4x the split kernel's SASS per quantized token."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_sass.py"
    done = subprocess.run([sys.executable, str(script), "--kivi", "k2v2", "k4v2", "k4v4", "--num-stages", "3",
                           "--variants", "kivi", "kivi_warp_asm"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout + done.stderr
    per_slot = {tuple(line.split()[:2]): float(line.split()[3]) for line in done.stdout.splitlines()
                if line.startswith("k")}
    for store in ("k2v2", "k4v2", "k4v4"):
        assert per_slot[(store, "kivi_warp_asm")] < 0.4 * per_slot[(store, "kivi")], per_slot
