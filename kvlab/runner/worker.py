"""A worker's side of an executor: measure one group of runs and stream everything back.

The same function serves a spawned child process and a Ray task. It builds its own energy
sampler, bound to the GPU this process was given (``kvlab.energy.make_sampler`` resolves it by
UUID), and a budget holding what the driver had left when it sent the group.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab import models
from kvlab.card import device_card
from kvlab.energy import make_sampler
from kvlab.runner.sink import ForwardingSink
from kvlab.sweep.group import run_group
from kvlab.sweep.params import SweepParams
from kvlab.sweep.plan import Budget, RunSpec


@dataclass
class GroupJob:
    """One group of pending runs (one model load) and what a worker needs to measure them."""

    params: SweepParams
    runs: list[RunSpec]
    sweep_name: str
    max_runs: int | None = None
    time_left_s: float | None = None
    loader: Callable[..., Any] | None = None
    sampler_factory: Callable[..., Any] | None = None


class ReportingBudget(Budget):
    """The worker's share of the sweep's budget; each unit spent is also reported to the driver."""

    def __init__(self, send: Callable[[tuple], None], **kw):
        super().__init__(**kw)
        self._send = send

    def spent(self, seconds: float, measured: bool) -> None:
        super().spent(seconds, measured)
        self._send(("spent", seconds, measured))


def worker_info(device: str, sampler, executor: str) -> dict[str, Any]:
    """Who measured: host, pid, the card (:func:`kvlab.card.device_card`: the GPU's name, UUID, driver,
    power limit and clocks; ``cpu`` and nulls on CPU), what the scheduler set."""
    return {
        "executor": executor, "host": socket.gethostname(), "pid": os.getpid(), "device": str(device),
        **device_card(device, gpu=getattr(sampler, "gpu", None)),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "energy_source": getattr(sampler, "source", None),
    }


def run_job(job: GroupJob, send: Callable[[tuple], None], executor: str) -> None:
    """Measure ``job.runs`` here, sending every message through ``send``; raises what it cannot record."""
    params = job.params
    if params.threads is not None:
        import torch

        torch.set_num_threads(params.threads)
    sink = ForwardingSink(send)
    budget = ReportingBudget(send, max_runs=job.max_runs, time_budget_s=job.time_left_s)
    factory = job.sampler_factory or make_sampler
    sampler = factory(params.device, interval_s=params.energy_interval_ms / 1000.0)
    try:
        sink.worker(worker_info(params.device, sampler, executor))
        run_group(params, job.runs, sink, budget, loader=job.loader or models.load_model, sampler=sampler,
                  sweep_name=job.sweep_name)
    finally:
        sampler.close()
