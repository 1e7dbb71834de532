"""Executors: where a sweep's groups of runs execute, behind one writer.

- ``local``: in the sweep's own process, one model load per model (the runner's historic
  behaviour, and the default).
- ``process``: each (model, ctx, batch) group in a fresh child process (multiprocessing spawn), so
  a segfault, ``os._exit`` or an OOM kill costs the run in flight (during a warm-up, that variant's
  pending runs at that shape; during the model load, the group's), recorded as failed with its cause,
  not the sweep (:func:`kvlab.runner.drive.charged_runs`).
- ``ray``: the same groups as Ray tasks, one per GPU (``num_gpus=1``; ``num_cpus`` on CPU), on a
  local machine or a cluster (``ray_address``).

Whatever the executor, workers only measure: they stream what they measured back to the driver
(:mod:`kvlab.runner.sink`), which alone appends to the sweep folder under its lock. So run ids,
resume and manifests do not depend on the executor; the manifest's invocation lists every worker
(host, pid, GPU UUID, energy source).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from kvlab.sweep.params import EXECUTORS


def make_executor(name: str, *, ray_address: str | None = None, log: Callable[[str], None] = print):
    """The executor called ``name`` (:data:`kvlab.sweep.params.EXECUTORS`); its module is imported
    when one is made (``ray`` too), so a missing extra fails before any model loads with the install line."""
    if name not in EXECUTORS:
        raise ValueError(f"executor: {name!r} is not one of {', '.join(EXECUTORS)}")
    module, cls = EXECUTORS[name].split(":")
    return getattr(importlib.import_module(module), cls).from_options(ray_address=ray_address, log=log)
