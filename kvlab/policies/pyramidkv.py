"""PyramidKV: SnapKV scores with per-layer budgets shrinking linearly from the first layer.

Budget (kvpress's formula, driven by ``keep``): with mean m = n x keep, the first layer keeps
``hi = 2m - m/beta`` and the last ``lo = m/beta`` (``hi`` capped at ``n - window`` and ``lo``
rebalanced); layer l keeps ``round(hi - l (hi - lo)/(L - 1))``. When that pyramid does not fit
(``not n >= hi >= lo >= window``, e.g. short prompts; or a single layer) every layer falls back to SnapKV's
floor(n x keep) (kvpress rounds there; flooring keeps the fallback equal to SnapKV and to
``kvlab.budget``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.policies.base import int_param
from kvlab.policies.snapkv import SnapKVPolicy


def pyramid_budget(n: int, keep: float, window: int, beta: int, layer_idx: int, num_layers: int) -> int:
    mean = n * keep
    lo = mean / beta
    hi = 2 * mean - lo
    if hi >= n - window:
        hi = n - window
        lo = 2 * mean - hi
    if num_layers == 1 or not n >= hi >= lo >= window:
        return max(1, math.floor(mean))
    step = (hi - lo) / (num_layers - 1)
    return max(1, min(n, round(hi - layer_idx * step)))


@dataclass(frozen=True)
class PyramidKVPolicy(SnapKVPolicy):
    name = "pyramidkv"
    summary = "SnapKV scores, per-layer budgets shrinking linearly with depth (mean = keep)"

    beta: int = int_param(20, "pyramid steepness: last layer keeps mean/beta", minimum=1)

    def budget(self, n, layer_idx, num_layers):
        return pyramid_budget(n, self.keep, self.window_size, self.beta, layer_idx, num_layers)
