"""Shared fixtures: a tiny random Llama for mechanics, SmolLM2 (real weights) for behaviour."""

import os

# Under pytest-xdist (``-n``, the default in pyproject.toml) each worker gets one intra-op thread, set
# before torch is imported: N workers with N threads each on N cores would spend the suite's time in
# OpenMP spinning. Subprocesses (the CLI, notebooks) inherit it. A serial run (``-n0``) keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

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


@pytest.fixture(scope="session")
def ray_fake_gpus():
    """A new local Ray cluster (never one already running here) with two fake GPUs for scheduling, started
    once per test session: a start costs about 15 s on 2 cores, and the Ray tests (one xdist group, so
    one worker) share it. tests/test_ray_carry.py's sweep starts its own (RAY_ADDRESS=local)."""
    from pathlib import Path

    ray = pytest.importorskip("ray")
    repo = Path(__file__).resolve().parent.parent
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{repo}:{repo / 'tests'}"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_gpu_sweep(ray_fake_gpus, tmp_path_factory):
    """``(summary, folder)`` of one ray sweep over the two fake GPUs (tiny model on CPU, fake NVML
    samplers): what tests/test_runner.py (each task its GPU, each sampler that GPU) and
    tests/test_multigpu.py (no two windows overlap on a GPU) check, run once (about 30 s)."""
    from sweep_workers import cpu_loader, fake_gpu_sampler

    from kvlab.sweep.driver import run_sweep
    from kvlab.sweep.params import parse_params

    folder = tmp_path_factory.mktemp("ray-gpu-sweep")
    params = parse_params({"name": "two", "models": "tiny-llama", "weights": "synthetic", "device": "cuda",
                           "methods": ["full", "streamingllm"], "keep": 0.5, "ctx": [32, 64], "batch": 1,
                           "new_tokens": 3, "prompts": 2, "threads": 1, "executor": "ray"})
    summary = run_sweep(params, folder, progress=False, check_device=False, loader=cpu_loader,
                        sampler_factory=fake_gpu_sampler, log=lambda m: None)
    return summary, folder


@pytest.fixture(scope="session")
def smollm2_needle(smollm2):
    """The ~2k-token needle prompt of tests/test_policies_smollm2.py, built once per session."""
    from test_policies_smollm2 import needle_prompt

    return needle_prompt(smollm2.tokenizer)


@pytest.fixture(scope="session")
def smollm2_answer(smollm2, smollm2_needle):
    """``answer(method, **params)``: SmolLM2's 12-token reply to the needle prompt under that policy,
    generated once per session (a 2k-token prefill on real weights is the cost) and shared by every
    test that reads the same (method, params): (generate_text's result, the needle's value)."""
    from kvlab.engine.engines import generate_text
    from kvlab.policies import make_policy

    done = {}

    def answer(method, **params):
        key = (method, tuple(sorted(params.items())))
        if key not in done:
            context, question, _, _ = smollm2_needle
            done[key] = generate_text(smollm2, context, make_policy(method, **params), 12, question_ids=question)
        return done[key], smollm2_needle[2]

    return answer
