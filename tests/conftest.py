"""Shared fixtures: a tiny random Llama for mechanics, SmolLM2 (real weights) for behaviour."""

import pytest


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random Llama on CPU (float32), loaded once per test session."""
    from kvlab.models import load_model

    return load_model("tiny-llama", weights="synthetic", device="cpu", seed=0)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct with its embedded real weights (about 20 s to load on 2 cores)."""
    from kvlab.models import load_model

    return load_model("smollm2-135m", device="cpu")
