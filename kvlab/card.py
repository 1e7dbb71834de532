"""The card a number was measured on, as the fields every record and benchmark JSON carries.

Two runs compare only on one card: the same name can hide another board, power limit or driver
(two H200s of one campaign differed), so each artifact names the card by UUID with its driver,
power limit and maximum clocks. On a CPU ``card`` is ``cpu`` and the GPU fields are null. The
NVML reads themselves are :func:`kvlab.energy.device.gpu_info`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from kvlab.energy.device import device_handle, gpu_info

GPU_FIELDS = ("gpu_name", "gpu_uuid", "driver", "power_limit_w", "sm_clock_max_mhz", "mem_clock_max_mhz")
CARD_FIELDS = ("card", *GPU_FIELDS)


def cpu_card() -> dict[str, Any]:
    return {"card": "cpu", **dict.fromkeys(GPU_FIELDS)}


def unmeasured_card(device: Any, reported: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The card fields of a record written where no model loaded (a failed load, a worker that
    died): ``reported`` (the fields the worker named) when it names a card, ``cpu`` on a CPU, else
    ``card`` and the GPU fields null (which GPU it would have run on is not known here)."""
    if reported and reported.get("card"):
        return {k: reported.get(k) for k in CARD_FIELDS}
    if not str(device).startswith("cuda"):
        return cpu_card()
    return dict.fromkeys(CARD_FIELDS)


def card_from_gpu(gpu: Mapping[str, Any]) -> dict[str, Any]:
    """The card fields from a :func:`kvlab.energy.device.gpu_info` dict (a sampler's ``gpu``)."""
    fields = {k: gpu.get(k) for k in GPU_FIELDS}
    return {"card": fields["gpu_name"] or "gpu", **fields}


def device_card(device: Any, gpu: Mapping[str, Any] | None = None, nvml=None) -> dict[str, Any]:
    """The card fields of a run: from ``gpu`` (its energy sampler's NVML facts) when it names a UUID;
    else ``cpu`` off CUDA, or torch's ``device`` read through NVML (once per device), falling back to
    torch's name and UUID where NVML cannot answer."""
    if gpu and gpu.get("gpu_uuid"):  # the card the run's energy sampler reads
        return card_from_gpu(gpu)
    dev = str(device)
    if not dev.startswith("cuda"):
        return cpu_card()
    if nvml is not None:
        return card_from_gpu(read_gpu(dev, nvml))
    return dict(_cached_card(dev))


@functools.lru_cache(maxsize=8)
def _cached_card(device: str) -> dict[str, Any]:
    try:
        import pynvml as nvml  # from the nvidia-ml-py distribution
    except ImportError:
        nvml = None
    return card_from_gpu(read_gpu(device, nvml))


def read_gpu(device: str, nvml) -> dict[str, Any]:
    """:func:`gpu_info` of the NVML device behind ``device``; torch's name and UUID alone when NVML is
    missing or finds no such device (never raises)."""
    if nvml is not None:
        try:
            nvml.nvmlInit()
        except Exception:
            nvml = None
    if nvml is not None:
        try:
            return gpu_info(nvml, device_handle(nvml, device))
        except Exception:
            pass
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
    return _torch_gpu(device)


def _torch_gpu(device: str) -> dict[str, Any]:
    try:
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        return {"gpu_name": props.name, "gpu_uuid": f"GPU-{props.uuid}"}
    except Exception:
        return {}
