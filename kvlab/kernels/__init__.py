"""Quantized KV storage and the decode attention that reads it.

- :mod:`kvlab.kernels.formats`: storage formats (``bf16``, ``fp8``, ``int4``, ``int2``) as objects:
  static-buffer ``alloc``/``write``, a pure-torch ``quantize``/``dequantize`` reference, their name
  (``int4-g64``), and what the kernels read from them (kernel code, packing, group, tuned launch
  geometry);
- :mod:`kvlab.kernels.reference`: float32 decode attention over dequantized stores (ground truth);
- :mod:`kvlab.kernels.decode`: decode attention reading the codes directly, with a dispatcher that
  falls back to the reference on CPU tensors; three split kernels, ``split``
  (:mod:`~kvlab.kernels.decode_split`: code tiles dequantized to float16), ``fold``
  (:mod:`~kvlab.kernels.decode_fold`: scales and zeros folded into the operands; ``fold_asm``: the
  same with int4 codes unpacked by inline PTX) and ``warp`` (:mod:`~kvlab.kernels.decode_warp`: fold
  with a split per warp and codes read as int16 words, int4 and fp8; ``warp_asm``: with PTX
  unpacking), picked by ``LaunchConfig.variant``, and their shared
  steps and reduce kernel (:mod:`~kvlab.kernels.decode_reduce`);
- :mod:`kvlab.kernels.append`: quantize-on-write in one launch (:mod:`~kvlab.kernels.append_kernel`;
  ``KVFormat.write`` on CPU).

Nothing here imports triton until a kernel runs.
"""

from kvlab.kernels.append import quantize_write
from kvlab.kernels.decode import (
    DecodeWorkspace,
    decode_attention,
    kernel_variant,
    make_workspace,
    plan_splits,
)
from kvlab.kernels.formats import (
    FORMATS,
    FormatError,
    KVFormat,
    KVStore,
    LaunchConfig,
    format_label,
    make_format,
    parse_format,
)
from kvlab.kernels.reference import decode_attention_reference

__all__ = [
    "FORMATS", "FormatError", "KVFormat", "KVStore", "LaunchConfig", "format_label", "make_format", "parse_format",
    "decode_attention_reference", "DecodeWorkspace", "decode_attention", "kernel_variant", "make_workspace",
    "plan_splits", "quantize_write",
]
