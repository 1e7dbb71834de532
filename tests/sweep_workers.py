"""Module-level loaders and samplers for executor tests: picklable, so a spawned child process or a
Ray worker (with tests/ on its PYTHONPATH) can import them."""

from __future__ import annotations

import os
import signal
import time


def cpu_loader(name, **kw):
    """The tiny model on CPU whatever device the params name (fake-GPU scheduling tests)."""
    from kvlab.models import load_model

    kw["device"] = "cpu"
    return load_model(name, **kw)


def crashing_loader(name, *, method, prompt_id, signum=signal.SIGKILL, **kw):
    """Loads normally, then makes this worker process die by ``signum`` in the measured run of
    ``method`` on ``prompt_id`` (not its warm-up: the method's first call in a worker, with one
    warm-up per variant and shape), as a segfault or the OOM killer would. Only a model this loader loaded crashes, so a
    reused worker process stays sane for other loaders."""
    import kvlab.measure as measure
    from kvlab.models import load_model

    real = getattr(measure.measure_generation, "real", measure.measure_generation)

    calls: dict[tuple, int] = {}

    def measure_or_die(loaded, policy, **m):
        crash = getattr(loaded, "crash_on", None)
        shape = (policy.name, m["ctx"], m["batch"])
        calls[shape] = calls.get(shape, 0) + 1
        if crash == (policy.name, m["prompt_id"]) and calls[shape] > 1:  # the first call is the warm-up
            os.kill(os.getpid(), signum)
            time.sleep(60)  # the signal lands first
        return real(loaded, policy, **m)

    measure_or_die.real = real
    measure.measure_generation = measure_or_die
    loaded = load_model(name, **kw)
    loaded.crash_on = (method, prompt_id)
    return loaded


def fake_gpu_sampler(device, interval_s=0.015, **kw):
    """A sampler on the fake NVML (two GPUs): it binds whichever GPU CUDA_VISIBLE_DEVICES gives."""
    from fake_nvml import FakeNvml

    from kvlab.energy import make_sampler

    return make_sampler(device, interval_s=interval_s, nvml=FakeNvml(), sync=lambda: None, **kw)
