"""KV storage formats and the reference decode attention (CPU, pure torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvlab.kernels import FORMATS, FormatError, decode_attention, decode_attention_reference, make_format
from kvlab.kernels.decode import plan_splits
from kvlab.kernels.packing import pack, unpack

INT_FORMATS = [(name, group) for name in ("int4", "int2") for group in (32, 64, 128)]


def kv(shape, seed=0, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * 2 + offset


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip_keeps_every_code(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), generator=torch.Generator().manual_seed(bits)).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_puts_neighbours_in_one_byte_lowest_bits_first():
    codes = torch.tensor([1, 2, 3, 0, 3, 3, 3, 3], dtype=torch.uint8)
    assert pack(codes, 2).tolist() == [1 | 2 << 2 | 3 << 4, 255]
    assert pack(codes, 4).tolist() == [1 | 2 << 4, 3, 3 | 3 << 4, 3 | 3 << 4]


def test_bf16_round_trip_is_a_bf16_cast():
    x = kv((2, 3, 5, 64))
    fmt = make_format("bf16")
    assert torch.equal(fmt.dequantize(fmt.quantize(x)), x.bfloat16().float())


@pytest.mark.parametrize("offset", [0.0, 40.0])
def test_fp8_error_is_within_half_an_e4m3_step(offset):
    x = kv((2, 3, 17, 128), offset=offset)
    fmt = make_format("fp8")
    q = fmt.quantize(x)
    assert q.codes.dtype == torch.float8_e4m3fn and q.scale.shape == (2, 3, 17) and q.scale.dtype == torch.float32
    err = (fmt.dequantize(q) - x).abs()
    # 3 mantissa bits: relative step 2^-3 (half: 2^-4); subnormal step 2^-9 code units.
    bound = x.abs() * 2**-4 + q.scale.unsqueeze(-1) * 2**-10 + 1e-6
    assert (err <= bound).all()
    # The largest element of each token maps to the saturation point 448 and comes back (nearly) exact.
    amax = x.abs().amax(-1)
    assert torch.allclose(q.codes.float().abs().amax(-1), torch.full_like(amax, 448.0))


def test_fp8_saturates_instead_of_overflowing():
    fmt = make_format("fp8")
    store = fmt.alloc(1, 1, 2, 16)
    x = torch.zeros(1, 1, 1, 16)
    x[..., 0] = 1e6
    fmt.write(store, x, torch.tensor([0]))
    assert torch.isfinite(store.dequantize()).all()
    assert store.dequantize()[0, 0, 0, 0].item() == pytest.approx(1e6, rel=1e-6)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("name,group", INT_FORMATS)
@pytest.mark.parametrize("offset", [0.0, 50.0])
def test_int_error_is_at_most_half_a_scale(name, group, scale_dtype, offset):
    x = kv((2, 3, 9, 128), seed=group, offset=offset)
    fmt = make_format(name, group=group, scale_dtype=scale_dtype)
    q = fmt.quantize(x)
    assert q.codes.shape == (2, 3, 9, 128 * fmt.bits // 8)
    assert q.scale.shape == q.zero.shape == (2, 3, 9, 128 // group) and q.scale.dtype == scale_dtype
    err = (fmt.dequantize(q) - x).abs().unflatten(-1, (128 // group, group))
    half_step = q.scale.float().unsqueeze(-1) / 2
    assert (err <= half_step * (1 + 1e-5) + 1e-5).all()
    # The codes use the whole range: every group has a 0 and a top code.
    codes = unpack(q.codes, fmt.bits).unflatten(-1, (128 // group, group))
    assert (codes.amin(-1) == 0).all() and (codes.amax(-1) >= fmt.levels - 1).all()


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("per_row", [False, True])
def test_write_into_slots_equals_quantize_of_the_same_tokens(name, per_row):
    fmt = make_format(name)
    batch, heads, cap, dim, n = 3, 2, 11, 64, 4
    store = fmt.alloc(batch, heads, cap, dim)
    x = kv((batch, heads, n, dim), seed=3)
    if per_row:
        positions = torch.tensor([[0, 1, 2, 3], [7, 8, 9, 10], [5, 2, 9, 0]], dtype=torch.int32)
    else:
        positions = torch.tensor([6, 1, 10, 3], dtype=torch.int32)
    fmt.write(store, x, positions)
    expected = fmt.quantize(x)
    rows = positions if per_row else positions.expand(batch, n)
    written = torch.zeros(batch, cap, dtype=torch.bool)
    for b in range(batch):
        for i, slot in enumerate(rows[b].tolist()):
            written[b, slot] = True
            for got, want in zip(store.tensors(), expected.tensors(), strict=True):
                assert torch.equal(got[b, :, slot].float(), want[b, :, i].float())
    untouched = store.dequantize().permute(0, 2, 1, 3)[~written]
    assert (untouched == 0).all()


def test_write_appends_one_token_per_step_like_decode():
    fmt = make_format("int4", group=32)
    store = fmt.alloc(2, 2, 8, 64)
    x = kv((2, 2, 8, 64), seed=5)
    for step in range(8):
        fmt.write(store, x[:, :, step:step + 1], torch.tensor([step]))
    assert torch.equal(store.dequantize(), fmt.dequantize(fmt.quantize(x)))
    assert store.dequantize(3).shape == (2, 2, 3, 64)


@pytest.mark.parametrize("name,group,expected", [
    ("bf16", None, 8 * 128 * 2),
    ("fp8", None, 8 * (128 + 4)),
    ("int4", 64, 8 * (64 + 2 * 2 * 2)),
    ("int4", 32, 8 * (64 + 2 * 4 * 2)),
    ("int2", 128, 8 * (32 + 2 * 1 * 2)),
])
def test_bytes_per_token_counts_codes_and_scales(name, group, expected):
    fmt = make_format(name, group=group)
    assert fmt.bytes_per_token(8, 128) == expected
    store = fmt.alloc(2, 8, 5, 128)
    assert store.nbytes() == expected * 2 * 5


@pytest.mark.parametrize("call,match", [
    (lambda: make_format("int3"), "formats: bf16, fp8, int4, int2"),
    (lambda: make_format("int4", group=48), "group must be one of"),
    (lambda: make_format("fp8", group=64), "takes no group"),
    (lambda: make_format("int4", group=128).alloc(1, 1, 4, 64), r"pick a group \(q_group_size\) from 32, 64"),
    (lambda: make_format("bf16").alloc(1, 1, 0, 64), "capacity must be >= 1"),
    (lambda: make_format("bf16").alloc(1, 1, 4, 60), "multiple of 16"),
])
def test_bad_format_parameters_name_the_fix(call, match):
    with pytest.raises(FormatError, match=match):
        call()


def test_write_rejects_wrong_shapes():
    fmt = make_format("fp8")
    store = fmt.alloc(2, 2, 4, 64)
    with pytest.raises(FormatError, match=r"write expects \[B=2, Hkv=2, n, D=64\]"):
        fmt.write(store, torch.zeros(2, 3, 1, 64), torch.tensor([0]))
    with pytest.raises(FormatError, match="positions must be"):
        fmt.write(store, torch.zeros(2, 2, 1, 64), torch.tensor([0, 1]))


def filled_stores(name, batch, kv_heads, capacity, dim, seed=0, group=None):
    fmt = make_format(name, group=group)
    k, v = fmt.alloc(batch, kv_heads, capacity, dim), fmt.alloc(batch, kv_heads, capacity, dim)
    slots = torch.arange(capacity)
    fmt.write(k, kv((batch, kv_heads, capacity, dim), seed=seed), slots)
    fmt.write(v, kv((batch, kv_heads, capacity, dim), seed=seed + 1), slots)
    return k, v


def sdpa_per_row(q, k_store, v_store, lengths, scale):
    """float32 SDPA (enable_gqa) on each row's dequantized prefix: an independent check of the reference."""
    rows = []
    for b, length in enumerate(lengths.tolist()):
        if length == 0:
            rows.append(torch.zeros_like(q[b], dtype=torch.float32))
            continue
        k = k_store.dequantize(length)[b:b + 1]
        v = v_store.dequantize(length)[b:b + 1]
        out = F.scaled_dot_product_attention(q[b:b + 1, :, None].float(), k, v, scale=scale, enable_gqa=True)
        rows.append(out[0, :, 0])
    return torch.stack(rows)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("batch,kv_heads,group,dim,capacity,lengths", [
    (1, 1, 1, 64, 1, [1]),
    (2, 2, 4, 128, 37, [37, 5]),
    (3, 4, 2, 64, 100, [0, 99, 64]),
    (2, 1, 8, 128, 70, [7, 70]),
])
def test_reference_matches_sdpa_on_dequantized_tensors(name, batch, kv_heads, group, dim, capacity, lengths):
    k, v = filled_stores(name, batch, kv_heads, capacity, dim)
    q = kv((batch, kv_heads * group, dim), seed=9).bfloat16()
    lengths = torch.tensor(lengths, dtype=torch.int32)
    scale = dim ** -0.5
    got = decode_attention_reference(q, k, v, lengths, scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, sdpa_per_row(q, k, v, lengths, scale), atol=1e-5, rtol=1e-5)


def test_reference_ignores_slots_past_the_length():
    k, v = filled_stores("int4", 1, 2, 20, 64)
    q = kv((1, 4, 64), seed=2)
    lengths = torch.tensor([9], dtype=torch.int32)
    before = decode_attention_reference(q, k, v, lengths, 0.125)
    k.codes[:, :, 9:] = 255
    v.scale[:, :, 9:] = 1e3
    assert torch.equal(decode_attention_reference(q, k, v, lengths, 0.125), before)


def test_dispatcher_falls_back_to_the_reference_on_cpu():
    k, v = filled_stores("fp8", 2, 2, 30, 64)
    q = kv((2, 6, 64), seed=4)
    lengths = torch.tensor([30, 11], dtype=torch.int32)
    want = decode_attention_reference(q, k, v, lengths, 0.1)
    assert torch.equal(decode_attention(q, k, v, lengths, 0.1), want)
    out = torch.empty(2, 6, 64)
    assert decode_attention(q, k, v, lengths, 0.1, out=out) is out and torch.equal(out, want)
    with pytest.raises(FormatError, match="backend must be one of"):
        decode_attention(q, k, v, lengths, 0.1, backend="cuda")
    with pytest.raises(FormatError, match="lengths must be an int32 tensor"):
        decode_attention(q, k, v, torch.tensor([1.0, 2.0]), 0.1)
    with pytest.raises(FormatError, match="not a multiple of Hkv"):
        decode_attention(q[:, :5], k, v, lengths, 0.1)


@pytest.mark.parametrize("batch,kv_heads,capacity", [(1, 8, 16384), (16, 8, 16384), (32, 8, 16384),
                                                      (1, 1, 32769), (4, 2, 7), (1, 8, 100)])
def test_split_plan_fills_the_gpu_and_covers_the_capacity(batch, kv_heads, capacity):
    splits, split_len = plan_splits(batch, kv_heads, capacity, sm_count=132)
    assert split_len % 64 == 0
    assert (splits - 1) * split_len < capacity <= splits * split_len  # covers, and no split is empty
    assert 1 <= splits <= 128
    if capacity >= 64 * 132:  # one long sequence still fills every SM (MQA: up to the 128-split cap)
        assert batch * kv_heads * splits >= min(132, 100 * batch * kv_heads)


def test_split_plan_for_one_llama_sequence_at_16k():
    assert plan_splits(1, 8, 16384, sm_count=132) == (64, 256)


def test_variant_of_a_config_defaults_to_the_module_constant(monkeypatch):
    from kvlab.kernels import LaunchConfig, decode, formats

    store = make_format("int4", group=64).alloc(1, 1, 4, 128)
    monkeypatch.setattr(decode, "DEFAULT_VARIANT", "fold")
    assert decode.kernel_variant(LaunchConfig(), store) == "fold"
    assert decode.kernel_variant(LaunchConfig(variant="split"), store) == "split"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert decode.kernel_variant(LaunchConfig(variant="fold_asm"), store) == "fold_asm"
    for other in (make_format("fp8"), make_format("int2", group=64)):  # PTX unpacking is int4's only
        assert decode.kernel_variant(LaunchConfig(variant="fold_asm"), other.alloc(1, 1, 4, 128)) == "fold"
    assert decode.kernel_variant(LaunchConfig(variant="warp_asm"), store) == "warp_asm"
    assert decode.kernel_variant(LaunchConfig(variant="warp_asm"), make_format("fp8").alloc(1, 1, 4, 128)) == "warp_asm"
    bf16 = make_format("bf16").alloc(1, 1, 4, 128)  # the warp kernel reads int4 and fp8 only: fold runs
    assert decode.kernel_variant(LaunchConfig(variant="warp_asm"), bf16) == "fold"
    assert decode.kernel_variant(LaunchConfig(variant="warp"), bf16) == "fold"
    assert decode.kernel_variant(LaunchConfig(variant="warp2_asm"), store) == "warp2_asm"
    assert decode.kernel_variant(LaunchConfig(variant="warp2_asm"), bf16) == "fold"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs no PTX
    assert decode.kernel_variant(LaunchConfig(variant="fold_asm"), store) == "fold"
    assert decode.kernel_variant(LaunchConfig(variant="warp_asm"), store) == "warp"
    assert decode.kernel_variant(LaunchConfig(variant="warp2_asm"), store) == "warp2"
    monkeypatch.setattr(formats, "TUNED_CONFIGS", {"int4-g64": LaunchConfig(block_n=256, variant="split")})
    assert store.format.launch_config.block_n == 256
    assert make_format("fp8").launch_config == LaunchConfig()


@pytest.mark.slow(reason="a fresh interpreter importing torch: several seconds on a loaded machine")
def test_kernels_import_and_run_on_cpu_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from kvlab.kernels import decode_attention, make_format\n"
            "f = make_format('int4'); k, v = f.alloc(1, 1, 4, 64), f.alloc(1, 1, 4, 64)\n"
            "out = decode_attention(torch.ones(1, 2, 64), k, v, torch.tensor([4], dtype=torch.int32), 1.0)\n"
            "assert out.shape == (1, 2, 64)\n"
            "try:\n"
            "    decode_attention(torch.ones(1, 2, 64), k, v, torch.tensor([4], dtype=torch.int32), 1.0,"
            " backend='triton')\n"
            "except RuntimeError as err:\n"
            "    assert 'need triton' in str(err), err\n"
            "else:\n"
            "    raise AssertionError('no error without triton')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _run_ptx(text: str, regs: dict[str, int]) -> dict[str, int]:
    """Emulate the few PTX integer instructions the int4 unpacking uses (prmt default mode, shl, lop3)."""
    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *args = [a.strip() for a in rest.split(",")]
        if op == "prmt.b32":
            a, b, sel = val(args[0]), val(args[1]), val(args[2])
            src = a | (b << 32)
            regs[dst] = sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "shl.b32":
            regs[dst] = (val(args[0]) << val(args[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[dst] = val(args[0]) >> val(args[1])
        elif op == "and.b32":
            regs[dst] = val(args[0]) & val(args[1])
        elif op == "mov.b32":  # mov.b32 {lo, hi}, x: split into 16-bit halves
            lo, hi = (x.strip("{} ") for x in rest.split("}")[0].split(","))
            regs[lo], regs[hi] = val(args[-1]) & 0xFFFF, val(args[-1]) >> 16
        elif op == "cvt.rn.f16x2.e4m3x2":  # two e4m3 bytes -> two float16 (low byte to the low half)
            pair = torch.tensor([val(args[0]) & 0xFF, val(args[0]) >> 8], dtype=torch.uint8)
            halves = pair.view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
            regs[dst] = int(halves[0]) | int(halves[1]) << 16
        elif op == "lop3.b32":
            a, b, c, lut = (val(x) for x in args)
            regs[dst] = sum((((lut >> ((((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1))) & 1) << i)
                            for i in range(32))
        else:
            raise AssertionError(f"unexpected PTX {op}")
    return regs


def test_int4_unpacking_ptx_makes_the_codes_the_portable_path_makes():
    """fold_asm's PTX (run on GPUs only) against fold's arithmetic: float16 1 + c/16 of each nibble, in order."""
    pytest.importorskip("triton")
    from kvlab.kernels.decode_fold import INT4_PLANES_PTX

    text = INT4_PLANES_PTX.value if hasattr(INT4_PLANES_PTX, "value") else INT4_PLANES_PTX
    gen = torch.Generator().manual_seed(0)
    quads = [[b, (b + 85) % 256, 255 - b, (b * 7) % 256] for b in range(256)]
    quads += torch.randint(0, 256, (256, 4), generator=gen).tolist()
    for quad in quads:
        word = sum(b << (8 * i) for i, b in enumerate(quad))
        out = _run_ptx(text, {"$4": word, "t0": 0, "t1": 0})
        halves = [out[f"${r}"] >> (16 * h) & 0xFFFF for r in range(4) for h in range(2)]
        got = torch.tensor(halves, dtype=torch.int32).to(torch.int16).view(torch.float16).float().view(2, 4)
        codes = torch.tensor([[b & 15 for b in quad], [b >> 4 for b in quad]], dtype=torch.float32)
        assert torch.equal(got, 1 + codes / 16), (quad, got)


def _ptx_text(name: str) -> str:
    from kvlab.kernels import decode_words

    text = getattr(decode_words, name)
    return text.value if hasattr(text, "value") else text


def _halves(reg: int) -> list[int]:
    return [reg & 0xFFFF, reg >> 16]


def _as_half(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.float16).float()


def test_int4_word_ptx_makes_the_codes_the_portable_path_makes():
    """warp_asm's PTX on a pair of int16 words (two slots): quarter q of both as float16 1 + c/16, first
    word in the low half, as decode_words.word_quarter makes them."""
    pytest.importorskip("triton")
    text = _ptx_text("INT4_WORDS_PTX")
    gen = torch.Generator().manual_seed(1)
    pairs = [[w, (w * 2654435761) & 0xFFFF] for w in range(0, 65536, 97)]
    pairs += torch.randint(0, 65536, (256, 2), generator=gen).tolist()
    for pair in pairs:
        out = _run_ptx(text, {"$4": pair[0] | pair[1] << 16, "t": 0})
        got = _as_half([h for r in range(4) for h in _halves(out[f"${r}"])]).view(4, 2)
        codes = torch.tensor([[(w >> (4 * q)) & 15 for w in pair] for q in range(4)], dtype=torch.float32)
        assert torch.equal(got, 1 + codes / 16), (pair, got)


def test_int4_place_ptx_makes_the_codes_the_portable_path_makes():
    """warp2_asm's PTX on a pair of int16 words: quarter q of both as the float16 c * 2**(PLACE_BITS[q] - 24),
    exactly and with no constant offset (code 0 is 0.0: the tensor core never accumulates a 1 it must take off
    again), first word in the low half, as decode_words.word_place makes them (q 0 and 1 masked in place, 2 and 3
    shifted)."""
    pytest.importorskip("triton")
    from kvlab.kernels.decode_words import PLACE_BITS

    text = _ptx_text("INT4_PLACE_PTX")
    gen = torch.Generator().manual_seed(2)
    pairs = [[w, (w * 2654435761) & 0xFFFF] for w in range(0, 65536, 97)]
    pairs += torch.randint(0, 65536, (256, 2), generator=gen).tolist()
    weights = torch.tensor([2.0 ** (b - 24) for b in PLACE_BITS])[:, None]
    for pair in pairs:
        out = _run_ptx(text, {"$4": pair[0] | pair[1] << 16, "t": 0})
        got = _as_half([h for r in range(4) for h in _halves(out[f"${r}"])]).view(4, 2)
        codes = torch.tensor([[(w >> (4 * q)) & 15 for w in pair] for q in range(4)], dtype=torch.float32)
        assert torch.equal(got, codes * weights), (pair, got)


def test_fp8_word_ptx_converts_both_bytes_of_both_words():
    """warp_asm's fp8 PTX: $0 holds the low bytes (even elements) of both words, $1 the high bytes, each
    as the float16 of its e4m3 code (every byte value, NaN codes included)."""
    pytest.importorskip("triton")
    text = _ptx_text("FP8_WORDS_PTX")
    for lo in range(256):
        pair = [lo | ((lo * 37 + 11) % 256) << 8, ((lo * 101 + 7) % 256) | (255 - lo) << 8]
        out = _run_ptx(text, {"$2": pair[0] | pair[1] << 16, "t": 0, "lo": 0, "hi": 0})
        got = _as_half([h for r in range(2) for h in _halves(out[f"${r}"])]).view(2, 2)
        codes = torch.tensor([[w & 0xFF for w in pair], [w >> 8 for w in pair]], dtype=torch.uint8)
        want = codes.view(torch.float8_e4m3fn).float()
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), pair


@pytest.mark.slow(reason="compiles six decode kernels for sm_90 with triton's ptxas in a subprocess (~40 s)")
def test_warp_kernels_compile_for_sm90_with_fewer_instructions_per_slot():
    """The PTX paths the interpreter cannot run, compiled (benchmarks/kernel_sass.py, no GPU needed): every
    group of int4 and fp8 builds, and warp_asm issues well under fold_asm's / fold's SASS per KV slot."""
    pytest.importorskip("triton")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_sass.py"
    done = subprocess.run([sys.executable, str(script), "--block-n", "128", "--num-stages", "3", "--formats", "fp8",
                           "int4-g32", "int4-g64", "int4-g128", "--variants", "fold", "fold_asm", "warp_asm",
                           "warp2_asm"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout + done.stderr
    per_slot = {tuple(line.split()[:2]): float(line.split()[3]) for line in done.stdout.splitlines()
                if line.startswith(("fp8", "int4"))}
    assert per_slot[("int4-g64", "warp_asm")] < 0.6 * per_slot[("int4-g64", "fold_asm")]
    assert per_slot[("fp8", "warp_asm")] < 0.6 * per_slot[("fp8", "fold")]
    assert per_slot[("int4-g64", "warp2_asm")] < 0.9 * per_slot[("int4-g64", "warp_asm")]  # in-place quarters
    assert {("int4-g32", "warp_asm"), ("int4-g128", "warp_asm"), ("int4-g128", "warp2_asm")} <= set(per_slot)
