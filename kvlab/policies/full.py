"""The baseline: transformers' plain dynamic cache, nothing evicted or quantized."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.policies.base import Policy, hf_model


@dataclass(frozen=True)
class FullPolicy(Policy):
    name = "full"
    summary = "the full cache at the model dtype (transformers DynamicCache)"

    def make_cache(self, model):
        from transformers import DynamicCache

        return DynamicCache(config=hf_model(model).config)
