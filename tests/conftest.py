"""Shared fixtures: a tiny random Llama for mechanics, SmolLM2 (real weights) for behaviour."""

import os

import pytest
import torch

# Without a GPU triton runs kernels only interpreted, and a kernel is interpreted only if
# TRITON_INTERPRET=1 was set before triton was first imported (tests/test_kernels_triton.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture(scope="module")
def ray_fake_gpus():
    """A new local Ray cluster (never one already running here) with two fake GPUs for scheduling."""
    from pathlib import Path

    ray = pytest.importorskip("ray")
    repo = Path(__file__).resolve().parent.parent
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{repo}:{repo / 'tests'}"}})
    yield ray
    ray.shutdown()
