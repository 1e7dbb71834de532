"""Triton quantize-on-write (imports triton; import this lazily through kvlab.kernels.append).

One launch per store instead of the dozen small torch ops of ``KVFormat.write``: program ``i`` of
the grid ``(B * Hkv * n,)`` quantizes one token of one KV head and writes its codes, scale and zero
into slot ``positions[b, t]`` (``pos_sb = 0`` when one slot list serves every row), after
subtracting the row's and head's key offset when ``OFFSET`` is set. The arithmetic
repeats :mod:`kvlab.kernels.formats` step by step (IEEE divisions through ``div_rn``, zeros rounded
down and scales rounded up to float16 by stepping their bits, codes as ``floor(v + 0.5)``, bf16 and
fp8 rounding in integer arithmetic), so the interpreter reproduces the torch reference bit for bit;
compiled code may fuse a multiply-add and move a code sitting exactly on a rounding tie by one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.jit_constants import FMT_BF16, FMT_FP8, FP8_MAX


@triton.jit
def f16_step(value, up: tl.constexpr):
    """The next float16 above (``up``) or below ``value``, as torch.nextafter does."""
    bits = value.to(tl.int16, bitcast=True)
    if up:  # only used for scales, which are >= 0
        stepped = bits + 1
    else:
        stepped = tl.where(bits < 0, bits + 1, bits - 1)  # sign bit set (-0 included): the magnitude grows
        stepped = tl.where(bits == 0, tl.full(bits.shape, -32767, tl.int16), stepped)  # +0 -> 0x8001
    return stepped.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def bf16_bits(x):
    """float32 -> bfloat16 bits, rounding to nearest even (finite inputs), as torch's cast does."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _e4m3_bits(c):
    """float32 in [-448, 448] -> float8_e4m3fn bits, rounding to nearest even, subnormals included.

    Spelled out in integer and exact power-of-two arithmetic because triton's interpreter converts
    to fp8 by truncation; the GPU runs the same steps, so both match torch's cast bit for bit.
    """
    a = tl.abs(c)
    exponent = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # subnormals share 2^-6's step
    step_exp = exponent - 3  # 3 mantissa bits
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    rounded = ((a * inv_step + 12582912.0) - 12582912.0) * step  # rint by the 1.5 * 2^23 trick, exact
    qbits = rounded.to(tl.int32, bitcast=True)
    q_exp = (qbits >> 23) - 127
    normal = ((q_exp + 7) << 3) | ((qbits >> 20) & 7)
    subnormal = (rounded * 512.0).to(tl.int32)
    sign = (c.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (tl.where(q_exp >= -6, normal, subnormal) | sign).to(tl.uint8)


@triton.jit(do_not_specialize=["Hkv", "n", "T", "x_sb", "x_sh", "x_st", "pos_sb"])
def quantize_write_kernel(
    x_ptr, pos_ptr, codes_ptr, scale_ptr, zero_ptr, offset_ptr,
    Hkv, n, T, x_sb, x_sh, x_st, pos_sb,
    D: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr, PACK: tl.constexpr, QGROUP: tl.constexpr,
    SCALE_F16: tl.constexpr, OFFSET: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid % n
    bh = pid // n
    b = bh // Hkv
    h = bh % Hkv
    slot = tl.load(pos_ptr + b * pos_sb + t).to(tl.int64)
    row = bh.to(tl.int64) * T + slot
    offs_d = tl.arange(0, D)
    x = tl.load(x_ptr + b.to(tl.int64) * x_sb + h * x_sh + t * x_st + offs_d).to(tl.float32)
    if OFFSET:  # a key offset [B, Hkv, D] float32 (kvlab.kernels.key_offset), subtracted in float32
        x = x - tl.load(offset_ptr + bh.to(tl.int64) * D + offs_d)

    if FMT == FMT_BF16:
        tl.store(codes_ptr + row * D + offs_d, bf16_bits(x))
    elif FMT == FMT_FP8:
        amax = tl.max(tl.abs(x), 0)
        scale = tl.math.div_rn(tl.maximum(amax, 1e-30), tl.full([], FP8_MAX, tl.float32))
        codes = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.full([D], 1.0, tl.float32) * scale), -FP8_MAX), FP8_MAX)
        tl.store(codes_ptr + row * D + offs_d, _e4m3_bits(codes))
        tl.store(scale_ptr + row, scale)
    else:
        NG: tl.constexpr = D // QGROUP
        DP: tl.constexpr = D // PACK
        LEVELS: tl.constexpr = (1 << BITS) - 1
        xg = tl.reshape(x, [NG, QGROUP])
        low = tl.min(xg, 1)
        high = tl.max(xg, 1)
        if SCALE_F16:
            zero = low.to(tl.float16)
            zero = tl.where(zero.to(tl.float32) > low, f16_step(zero, False), zero).to(tl.float32)
            exact = tl.math.div_rn(high - zero, tl.full([NG], LEVELS, tl.float32))
            scale = exact.to(tl.float16)
            scale = tl.where(scale.to(tl.float32) < exact, f16_step(scale, True), scale).to(tl.float32)
        else:
            zero = low
            scale = tl.math.div_rn(high - zero, tl.full([NG], LEVELS, tl.float32))
        inv = tl.where(scale > 0, tl.math.div_rn(tl.full([NG], 1.0, tl.float32), tl.where(scale > 0, scale, 1.0)),
                       0.0)
        v = (xg - zero[:, None]) * inv[:, None]
        codes = tl.minimum(tl.maximum(tl.floor(v + 0.5), 0.0), LEVELS * 1.0).to(tl.int32)
        pairs = tl.reshape(codes, [DP, PACK])
        shifts = tl.arange(0, PACK) * BITS
        packed = tl.sum(pairs << shifts[None, :], 1)
        tl.store(codes_ptr + row * DP + tl.arange(0, DP), packed.to(tl.uint8))
        offs_g = tl.arange(0, NG)
        tl.store(scale_ptr + row * NG + offs_g, scale)
        tl.store(zero_ptr + row * NG + offs_g, zero)
