"""Outlier key channels read from a loaded model, and the warning a per-token key store gets
(:mod:`kvlab.key_bias` reads the same from the weight files before the load, for the CLIs)."""

from __future__ import annotations

import warnings

from kvlab.key_bias import BIAS_LIMIT, outlier_keys_line, outlier_layers
from kvlab.policies.base import hf_model


class OutlierKeysWarning(UserWarning):
    """A per-token key store on a model with outlier key channels."""


def key_bias_outliers(model, limit: float = BIAS_LIMIT) -> dict[int, float]:
    """Layer index -> the largest |k_proj.bias| of each layer whose bias exceeds ``limit`` (none: {})."""
    biases = {}
    for i, layer in enumerate(getattr(getattr(hf_model(model), "model", None), "layers", []) or []):
        bias = getattr(getattr(getattr(layer, "self_attn", None), "k_proj", None), "bias", None)
        if bias is not None and bias.numel():
            biases[i] = float(bias.detach().abs().max())
    return outlier_layers(biases, limit)


def warn_per_token_keys(model, label: str) -> str | None:
    """Warn (and return the line) when ``model`` has outlier key channels; ``label`` names the store
    that quantizes keys per token without a key offset."""
    outliers = key_bias_outliers(model)
    if not outliers:
        return None
    line = outlier_keys_line(outliers, label)
    warnings.warn(line, OutlierKeysWarning, stacklevel=2)
    return line
