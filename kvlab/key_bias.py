"""Outlier key channels told by a model's weights: the largest |k_proj.bias| of each layer, and the
warning a store that quantizes keys per token gets.

Why: a large k_proj bias (Qwen2's reaches 354 in layer 0) gives a few key channels a large, nearly
constant offset; a store that quantizes each token's keys with one range (kvq without a key offset,
quanto/hqq along head_dim, transformers' fp8) then loses the quiet channels and the model answers
garbage. The bias tensors alone tell, so the preflight reads just
them from the weight files (one safetensors tensor at a time, or the GGUF's tensors through its
memory-mapped header) before any model loads.
"""

from __future__ import annotations

import re
from pathlib import Path

BIAS_LIMIT = 32.0  # |k_proj.bias| above which a channel's offset dwarfs the keys' spread (~1-20)

# a layer's k_proj bias as transformers' safetensors and llama.cpp's GGUF name it
BIAS_NAMES = (re.compile(r"layers\.(\d+)\.self_attn\.k_proj\.bias$"), re.compile(r"^blk\.(\d+)\.attn_k\.bias$"))


def bias_layer(name: str) -> int | None:
    """The layer index of a k_proj bias tensor's name, or None for any other tensor."""
    for pattern in BIAS_NAMES:
        match = pattern.search(name)
        if match:
            return int(match.group(1))
    return None


def safetensors_key_bias(path: Path) -> dict[int, float]:
    """Layer -> max |k_proj.bias| in one safetensors file (only those tensors are read)."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            layer = bias_layer(name)
            if layer is not None:
                out[layer] = float(f.get_tensor(name).abs().max())
    return out


def gguf_key_bias(path: Path) -> dict[int, float]:
    """Layer -> max |k_proj.bias| in a GGUF (the reader maps the file; only the bias tensors are read)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = {}
    for tensor in GGUFReader(str(path)).tensors:
        layer = bias_layer(tensor.name)
        if layer is not None:
            values = dequantize(tensor.data, tensor.tensor_type)
            out[layer] = float(np.abs(values.astype(np.float32)).max())
    return out


def files_key_bias(files: list[Path]) -> dict[int, float]:
    """Layer -> max |k_proj.bias| over a model's weight files ({} for a model without that bias)."""
    out: dict[int, float] = {}
    for path in files:
        out.update(gguf_key_bias(path) if path.suffix == ".gguf" else safetensors_key_bias(path))
    return out


def outlier_layers(biases: dict[int, float], limit: float = BIAS_LIMIT) -> dict[int, float]:
    """The layers whose max |k_proj.bias| exceeds ``limit``, in layer order."""
    return {i: biases[i] for i in sorted(biases) if biases[i] > limit}


def outlier_keys_line(outliers: dict[int, float], label: str) -> str:
    """The one-line warning for a store (``label``) that quantizes keys per token without a key offset
    on a model with these outlier layers; it names the fix."""
    layers = ", ".join(str(i) for i in outliers)
    return (f"this model has outlier key channels (|k_proj.bias| up to {max(outliers.values()):.0f}, layers {layers}) "
            f"and {label} quantizes keys per token without a key offset: expect garbage output; use kvq-int4/"
            f"kvq-fp8 with key_offset=prompt-mean (their default) or kivi (per-channel keys)")
