"""The ``local`` executor: every run in the sweep's own process, one model load per model."""

from __future__ import annotations

from kvlab.runner.worker import worker_info
from kvlab.sweep.group import run_group


class LocalExecutor:
    name = "local"

    @classmethod
    def from_options(cls, *, ray_address: str | None = None, log=print):
        """The executor :func:`kvlab.runner.make_executor` makes from a sweep's options."""
        return cls()

    def check(self, *, loader, sampler_factory) -> None:
        """Nothing to check before the lock: this executor takes any callables."""

    def run(self, params, pending, sink, budget, *, sweep_name, loader, sampler_factory) -> None:
        sampler = sampler_factory(params.device, interval_s=params.energy_interval_ms / 1000.0)
        try:
            sink.worker(worker_info(params.device, sampler, executor=self.name))
            run_group(params, pending, sink, budget, loader=loader, sampler=sampler, sweep_name=sweep_name)
        finally:
            sampler.close()
