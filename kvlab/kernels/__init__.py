"""Quantized KV storage and the decode attention that reads it (issue 13).

- :mod:`kvlab.kernels.formats`: storage formats (``bf16``, ``fp8``, ``int4``, ``int2``) as objects
  with static-buffer ``alloc``/``write`` and a pure-torch ``quantize``/``dequantize`` reference;
- :mod:`kvlab.kernels.reference`: float32 decode attention over dequantized stores (ground truth);
- :mod:`kvlab.kernels.triton_decode`: the split-K Triton kernels reading the codes directly, with a
  dispatcher that falls back to the reference on CPU tensors; two split kernels, ``split``
  (:mod:`~kvlab.kernels._decode_kernels`: code tiles dequantized to float16) and ``fold``
  (:mod:`~kvlab.kernels._fold_kernels`: scales and zeros folded into the operands; ``fold_asm``:
  the same with int4 codes unpacked by inline PTX), picked by ``LaunchConfig.variant``;
- :mod:`kvlab.kernels.triton_write`: quantize-on-write in one launch (``KVFormat.write`` on CPU).

Nothing here imports triton until a kernel runs.
"""

from kvlab.kernels.formats import FORMATS, FormatError, KVFormat, KVStore, make_format
from kvlab.kernels.reference import decode_attention_reference
from kvlab.kernels.triton_decode import (
    DecodeWorkspace,
    LaunchConfig,
    decode_attention,
    kernel_variant,
    make_workspace,
    plan_splits,
)
from kvlab.kernels.triton_write import quantize_write

__all__ = [
    "FORMATS", "FormatError", "KVFormat", "KVStore", "make_format", "decode_attention_reference",
    "DecodeWorkspace", "LaunchConfig", "decode_attention", "kernel_variant", "make_workspace", "plan_splits", "quantize_write",
]
