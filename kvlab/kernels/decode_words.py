"""Code words to float16 planes, the step every ``warp`` decode kernel starts its products with
(:mod:`kvlab.kernels.decode_warp`, :mod:`kvlab.kernels.kivi_warp`; imports triton; import lazily).

A word is an int16 holding four int4 codes or two float8_e4m3 codes of one slot; pairs of words share
a register, so each PTX instruction converts two codes. Three unpackings: ``1 + c / 16`` (one shift
and one AND-OR per quarter, :data:`INT4_WORDS_PTX`; 2-bit words through :func:`words_ptx`), in place
as float16 subnormals ``c * 2**(PLACE_BITS[q] - 24)`` (5 instructions per register instead of 8, no
offset to take off, :data:`INT4_PLACE_PTX`), and float8 bytes (:data:`FP8_WORDS_PTX`). Each has a
portable twin the CPU interpreter runs (:func:`word_quarter`, :func:`word_place`,
:func:`word_byte_fp8`); tests/test_kernels.py runs the PTX through an emulator against them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.jit_constants import FMT_FP8


def words_ptx(masks: tuple[int, ...]) -> tl.constexpr:
    """PTX making float16 ``1 + c / L`` pairs of a register of two int16 words, two codes per
    instruction, for int4 (:data:`INT4_WORDS_PTX`) and 2-bit words (``kivi_warp.INT2_WORDS_PTX``)
    alike: the words shifted so that quarter ``q`` (bits ``[4q, 4q + 4)``) lands at bits ``[6, 10)``,
    the top of 1.0's mantissa, then one ``lop3`` ``(t & mask) | 0x3C00`` per mask. Output
    ``$(q * len(masks) + i)`` is quarter ``q`` under ``masks[i]``; the words are the last operand."""
    words = f"${4 * len(masks)}"
    lines = ["", "{", ".reg .b32 t;"]
    for q, (op, bits) in enumerate((("shl", 6), ("shl", 2), ("shr", 2), ("shr", 6))):
        lines.append(f"{op}.b32 t, {words}, {bits};")
        lines += [f"lop3.b32 ${q * len(masks) + i}, t, 0x{mask:08X}, 0x3C003C00, 0xEA;"
                  for i, mask in enumerate(masks)]
    return tl.constexpr("\n".join(lines + ["}", ""]))  # a constexpr: jit code may read no other globals


# $4: two int16 words (first slot in the low half); $0..$3: quarter q (bits [4q, 4q + 4)) of both
# words as float16 1 + c / 16: one shift and one AND-OR per quarter, two codes at a time.
INT4_WORDS_PTX = words_ptx((0x03C003C0,))

# $4: two int16 words; $0..$3: quarter q of both words as the float16 subnormal c * 2**(PLACE_BITS[q] - 24)
# (exponent field 0, the code in the mantissa at bit PLACE_BITS[q]: no 1.0 to take off): quarters 0 and 1
# masked where they lie, 2 and 3 after one shift right by 6 (to bits [2, 6) and [6, 10)): 5 instructions, not 8.
INT4_PLACE_PTX = tl.constexpr("""
{
.reg .b32 t;
and.b32 $0, $4, 0x000F000F;
and.b32 $1, $4, 0x00F000F0;
shr.b32 t, $4, 6;
and.b32 $2, t, 0x003C003C;
and.b32 $3, t, 0x03C003C0;
}
""")
PLACE_BITS = (0, 4, 2, 6)  # quarter q of INT4_PLACE_PTX is c * 2**(PLACE_BITS[q] - 24) (its code's lowest bit)

# $2: two int16 words of two float8_e4m3 codes each; $0: both words' low bytes, $1: their high
# bytes, as float16 pairs (first word in the low half).
FP8_WORDS_PTX = tl.constexpr("""
{
.reg .b32 t;
.reg .b16 lo, hi;
prmt.b32 t, $2, 0, 0x3120;
mov.b32 {lo, hi}, t;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}
""")


@triton.jit
def word_quarter(w, Q: tl.constexpr):
    """Quarter ``Q`` (bits ``[4Q, 4Q + 4)``) of int16 words as float16 ``1 + c / 16``, exactly (the
    portable twin of :data:`INT4_WORDS_PTX`)."""
    if Q < 2:
        field = (w << (6 - 4 * Q)) & 0x03C0
    else:
        field = (w >> (4 * Q - 6)) & 0x03C0
    return (field | 0x3C00).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def word_place(w, Q: tl.constexpr):
    """Quarter ``Q`` of int16 words as the float16 subnormal ``c * 2**(PLACE_BITS[Q] - 24)``, exactly (the
    portable twin of :data:`INT4_PLACE_PTX`): quarters 0 and 1 where they lie, 2 and 3 shifted right by 6."""
    if Q < 2:
        field = w & (0xF << (4 * Q))
    else:
        field = (w >> 6) & (0xF << (4 * Q - 6))
    return field.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def word_byte_fp8(w, Q: tl.constexpr):
    """Byte ``Q`` of int16 words read as float8_e4m3, as float16 (the portable twin of :data:`FP8_WORDS_PTX`)."""
    return (w >> (8 * Q)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def int4_words(w):
    """The four quarters of int16 words (PTX, compiled only; pairs of words in one register)."""
    return tl.inline_asm_elementwise(
        asm=INT4_WORDS_PTX, constraints="=r,=r,=r,=r,r", args=[w],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def int4_placed(w):
    """The four quarters of int16 words unpacked in place (PTX, compiled only; pairs of words in one register)."""
    return tl.inline_asm_elementwise(
        asm=INT4_PLACE_PTX, constraints="=r,=r,=r,=r,r", args=[w],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def fp8_words(w):
    """Both float8 bytes of int16 words as float16 (PTX, compiled only)."""
    return tl.inline_asm_elementwise(
        asm=FP8_WORDS_PTX, constraints="=r,=r,r", args=[w], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def code_planes(w, FMT: tl.constexpr, ASM: tl.constexpr, IN_PLACE: tl.constexpr):
    """The planes of a word tile (int4: four quarters, ``IN_PLACE``: unpacked in place; fp8: two bytes, the
    last two repeat them)."""
    if FMT == FMT_FP8:
        if ASM:
            a, b = fp8_words(w)
        else:
            a = word_byte_fp8(w, 0)
            b = word_byte_fp8(w, 1)
        return a, b, a, b
    elif IN_PLACE:
        if ASM:
            return int4_placed(w)
        return word_place(w, 0), word_place(w, 1), word_place(w, 2), word_place(w, 3)
    elif ASM:
        return int4_words(w)
    else:
        return word_quarter(w, 0), word_quarter(w, 1), word_quarter(w, 2), word_quarter(w, 3)
