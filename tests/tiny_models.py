"""Tiny random models the tests build themselves (no download, no GGUF)."""

import torch


def load_tiny_d32():
    """tiny-llama with head_dim 32: the preset's 16 is smaller than the smallest int group (32), so
    this is the tiny model every quantized format of the registry can store."""
    from transformers import AutoModelForCausalLM

    from kvlab.models import LoadedModel, preset_config, spec_from_config

    config = preset_config("tiny-llama")
    config.head_dim = 32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    return LoadedModel(model, None, spec_from_config(config, name="tiny-llama-d32", dtype="float32"),
                       "synthetic", "tiny-llama-d32", "cpu", "float32")

