"""Outlier key channels read from a model's weights, and the warning a per-token key store gets.

Why: a model whose ``k_proj`` has a large bias (Qwen2's reaches 354 in layer 0) gives a few key
channels a large, nearly constant offset; a store that quantizes each token's keys with one range
(kvq without a key offset, quanto/hqq along head_dim, transformers' fp8) then loses the quiet
channels and the model answers garbage. The weights tell before
any prompt runs.
"""

from __future__ import annotations

import warnings

from kvlab.policies.base import hf_model

BIAS_LIMIT = 32.0  # |k_proj.bias| above which a channel's offset dwarfs the keys' spread (~1-20)


class OutlierKeysWarning(UserWarning):
    """A per-token key store on a model with outlier key channels."""


def key_bias_outliers(model, limit: float = BIAS_LIMIT) -> dict[int, float]:
    """Layer index -> the largest |k_proj.bias| of each layer whose bias exceeds ``limit`` (none: {})."""
    out = {}
    for i, layer in enumerate(getattr(getattr(hf_model(model), "model", None), "layers", []) or []):
        bias = getattr(getattr(getattr(layer, "self_attn", None), "k_proj", None), "bias", None)
        if bias is not None and bias.numel():
            top = float(bias.detach().abs().max())
            if top > limit:
                out[i] = top
    return out


def warn_per_token_keys(model, label: str) -> str | None:
    """Warn (and return the line) when ``model`` has outlier key channels; ``label`` names the store
    that quantizes keys per token without a key offset."""
    outliers = key_bias_outliers(model)
    if not outliers:
        return None
    layers = ", ".join(str(i) for i in outliers)
    line = (f"this model has outlier key channels (|k_proj.bias| up to {max(outliers.values()):.0f}, layers {layers}) "
            f"and {label} quantizes keys per token without a key offset: expect garbage output; use kvq-int4/"
            f"kvq-fp8 with key_offset=prompt-mean (their default) or kivi (per-channel keys)")
    warnings.warn(line, OutlierKeysWarning, stacklevel=2)
    return line
