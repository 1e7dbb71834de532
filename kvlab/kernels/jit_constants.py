"""The format codes and constants of :mod:`kvlab.kernels.formats` as Triton constexprs (imports triton).

jit code reads no module globals but constexprs, so the kernels import them from here.
"""

from __future__ import annotations

import triton.language as tl

from kvlab.kernels import formats

FMT_BF16 = tl.constexpr(formats.FMT_BF16)
FMT_FP8 = tl.constexpr(formats.FMT_FP8)
FMT_INT = tl.constexpr(formats.FMT_INT)
FP8_MAX = tl.constexpr(formats.FP8_MAX)
