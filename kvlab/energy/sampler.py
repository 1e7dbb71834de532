"""The sampler for a device: NVML's when it can read the device's energy counter, else the null one."""

from __future__ import annotations

from collections.abc import Callable

from kvlab.energy.device import cuda_sync, device_handle, gpu_info
from kvlab.energy.null import NullSampler
from kvlab.energy.nvml_sampler import NvmlSampler

Sampler = NvmlSampler | NullSampler


def _import_nvml():
    import pynvml  # from the nvidia-ml-py distribution

    return pynvml


def make_sampler(device: str, *, interval_s: float = 0.015, study_interval_s: float = 0.1,
                 nvml=None, uuid: str | None = None, sync: Callable[[], None] | None = None) -> Sampler:
    """An :class:`NvmlSampler` for a CUDA device when NVML can read its energy counter; otherwise a
    :class:`NullSampler` whose ``source`` says why. Never raises for a missing GPU or NVML."""
    dev = str(device)
    if not dev.startswith("cuda"):
        return NullSampler(f"none: device {dev!r} has no NVML energy counter")
    if sync is None:
        sync = cuda_sync(dev)
    if nvml is None:
        try:
            nvml = _import_nvml()
        except ImportError:
            return NullSampler("none: nvidia-ml-py (import pynvml) is not installed", sync)
    try:
        nvml.nvmlInit()
    except Exception as err:
        return NullSampler(f"none: NVML init failed ({err})", sync)
    try:
        handle = device_handle(nvml, dev, uuid)
        nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception as err:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
        what = "energy counter unavailable" if not isinstance(err, LookupError) else "device not found"
        return NullSampler(f"none: {what} ({err})", sync)
    return NvmlSampler(nvml, handle, sync=sync, interval_s=interval_s, study_interval_s=study_interval_s,
                       gpu=gpu_info(nvml, handle))
