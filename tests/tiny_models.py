"""Tiny random models the tests build themselves (no download, no GGUF), and registry knobs that fit them."""

import dataclasses

import torch


def load_tiny_d32(dtype=torch.float32, init_range: float | None = None):
    """tiny-llama with head_dim 32: the preset's 16 is smaller than the smallest int group (32), so
    this is the tiny model every quantized format of the registry can store (``dtype``: its weights'
    and activations' dtype, e.g. bfloat16 as on the GPU; ``init_range``: the weights' init std, the
    config's 0.02 when None)."""
    from transformers import AutoModelForCausalLM

    from kvlab.models import LoadedModel, preset_config, spec_from_config

    config = preset_config("tiny-llama")
    config.head_dim = 32
    if init_range is not None:
        config.initializer_range = init_range
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    name = str(dtype).removeprefix("torch.")
    return LoadedModel(model, None, spec_from_config(config, name="tiny-llama-d32", dtype=name),
                       "synthetic", "tiny-llama-d32", "cpu", name)



def registry_kwargs(name: str, pyramid_beta: int | None = None) -> dict:
    """Each registry method with knobs that fit a prompt of 64-100 tokens and head_dim 32
    (``pyramid_beta``: PyramidKV's beta, e.g. 2 for layers of different lengths at 64 tokens)."""
    from kvlab.policies import POLICIES, EvictionPolicy, QuantizedPolicy

    cls = POLICIES[name]
    knobs = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    if issubclass(cls, EvictionPolicy):
        kw["keep"] = 0.3
        if "window_size" in knobs:
            kw["window_size"] = 8
        if "beta" in knobs and pyramid_beta is not None:
            kw["beta"] = pyramid_beta
        if name == "kvzap":  # no surrogate is trained for a random model
            kw["surrogate"] = "random"
    elif issubclass(cls, QuantizedPolicy) and "q_group_size" in knobs:
        kw["q_group_size"] = 32
    elif name == "kvq-rot":  # its format's groups must divide head_dim 32
        kw["format"] = "int4-g32"
    return kw
