"""GPU energy from NVML: counter windows, a power-polling thread, the study's 10 Hz method, idle.

Why each channel (see shared/reference/energy.md):

- **Totals** come from ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since driver load), read right
  after ``synchronize`` at both window edges. It is the only channel that does not lag.
- **Timelines and phase splits** come from a background thread polling instant power
  (``NVML_FI_DEV_POWER_INSTANT``), averaged power (``NVML_FI_DEV_POWER_AVERAGE``), the counter and
  used memory every 10-20 ms. Instant power apportions the counter total between phases:
  ``E_phase = E_total * integral(P, phase) / integral(P, window)``.
- **The study's method** (``nvmlDeviceGetPowerUsage`` sampled at 10 Hz and integrated) is kept
  alongside for comparison. On Ampere and newer it is a 1 s trailing average, so it under-counts
  windows of a few seconds.

The NVML device is matched to the torch device by UUID, because NVML ignores
``CUDA_VISIBLE_DEVICES``: torch's UUID of the device where torch can tell, else the entry of
``CUDA_VISIBLE_DEVICES`` (an index or a UUID, as Ray or SLURM set it for a worker given one GPU)
resolved through NVML; never GPU 0 by index. Without NVML (CPU, no driver, no counter)
:func:`make_sampler` returns a :class:`NullSampler` whose windows carry host timings, null energies
and the reason in ``source``.

One job per module: ``integrate`` (math over sampled timelines), ``window`` (a window's phases and
result), ``poller`` (the power-polling thread), ``idle`` (the idle baseline), ``nvml_sampler`` and
``null`` (the two samplers), ``device`` (which NVML device is this torch device) and ``sampler``
(:func:`make_sampler`, the entry point). This package exposes the names other modules use.
"""

from kvlab.energy.device import (
    cuda_index,
    cuda_sync,
    find_handle,
    norm_uuid,
    torch_device_uuid,
    visible_device_uuid,
)
from kvlab.energy.null import NullSampler
from kvlab.energy.nvml_sampler import NvmlSampler
from kvlab.energy.sampler import Sampler, make_sampler
from kvlab.energy.window import WindowResult

__all__ = [
    "NullSampler", "NvmlSampler", "Sampler", "WindowResult", "cuda_index", "cuda_sync", "find_handle",
    "make_sampler", "norm_uuid", "torch_device_uuid", "visible_device_uuid",
]
