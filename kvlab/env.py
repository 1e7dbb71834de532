"""Provenance snapshots: code, packages and GPU state, taken at the start and end of a sweep.

Everything here is best effort: a fact that cannot be read is ``None``, never an error, so a
snapshot works on a laptop, in CI and on a VM whose NVML refuses some queries.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from kvlab import hostload
from kvlab.energy import cuda_index, find_handle, torch_device_uuid
from kvlab.records import utc_now

PACKAGES = (
    "kvlab", "torch", "transformers", "optimum-quanto", "hqq", "nvidia-ml-py", "numpy", "pandas",
    "pyarrow", "pydantic", "accelerate", "gguf", "tqdm",
)
REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info() -> dict[str, Any]:
    """HEAD commit of the kvlab checkout and whether the tree had local changes.

    A copy without ``.git`` (e.g. a working tree shipped to a GPU machine) can say its commit
    through the ``KVLAB_GIT_SHA`` environment variable.
    """
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if sha else None
    if sha is None and os.environ.get("KVLAB_GIT_SHA"):
        return {"git_sha": os.environ["KVLAB_GIT_SHA"], "git_dirty": None, "git_sha_from": "KVLAB_GIT_SHA"}
    return {"git_sha": sha, "git_dirty": bool(status) if status is not None else None}


def package_versions(names=PACKAGES) -> dict[str, str | None]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def torch_info(device: str | None = None) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {}
    info: dict[str, Any] = {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["cudnn"] = torch.backends.cudnn.version()
        index = cuda_index(device if device and str(device).startswith("cuda") else "cuda")
        props = torch.cuda.get_device_properties(index)
        info.update(torch_device_name=props.name, torch_device_index=index,
                    torch_total_memory=int(props.total_memory))
    return info


def _nvml_read(nvml, fn: str, *args, scale: float | None = None):
    try:
        value = getattr(nvml, fn)(*args)
    except Exception:
        return None
    if isinstance(value, bytes):
        value = value.decode()
    if scale is not None and value is not None:
        value = value / scale
    return value


def gpu_state(device: str | None, nvml=None, uuid: str | None = None) -> dict[str, Any]:
    """Name, UUID, driver, power limit, clocks, temperature and more of the NVML device behind a
    torch CUDA device (matched by UUID). Empty for CPU devices or without NVML."""
    if not device or not str(device).startswith("cuda"):
        return {}
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
    except Exception as err:
        return {"nvml_error": str(err)}
    try:
        uuid = uuid or torch_device_uuid(str(device))
        h = find_handle(nvml, uuid)
        if h is None:
            return {"nvml_error": f"no NVML device has the UUID {uuid}"}
        r = _nvml_read
        mem = r(nvml, "nvmlDeviceGetMemoryInfo", h)
        return {
            "gpu_name": r(nvml, "nvmlDeviceGetName", h),
            "gpu_uuid": r(nvml, "nvmlDeviceGetUUID", h),
            "driver": r(nvml, "nvmlSystemGetDriverVersion"),
            "nvml_version": r(nvml, "nvmlSystemGetNVMLVersion"),
            "cuda_driver_version": r(nvml, "nvmlSystemGetCudaDriverVersion"),
            "pci_bus_id": getattr(r(nvml, "nvmlDeviceGetPciInfo", h), "busId", None),
            "power_limit_w": r(nvml, "nvmlDeviceGetEnforcedPowerLimit", h, scale=1000.0),
            "power_w": r(nvml, "nvmlDeviceGetPowerUsage", h, scale=1000.0),
            "energy_counter_j": r(nvml, "nvmlDeviceGetTotalEnergyConsumption", h, scale=1000.0),
            "temperature_c": r(nvml, "nvmlDeviceGetTemperature", h, 0),
            "sm_clock_mhz": r(nvml, "nvmlDeviceGetClockInfo", h, 1),
            "mem_clock_mhz": r(nvml, "nvmlDeviceGetClockInfo", h, 2),
            "sm_clock_max_mhz": r(nvml, "nvmlDeviceGetMaxClockInfo", h, 1),
            "mem_clock_max_mhz": r(nvml, "nvmlDeviceGetMaxClockInfo", h, 2),
            "clock_event_reasons": r(nvml, "nvmlDeviceGetCurrentClocksEventReasons", h),
            "pstate": r(nvml, "nvmlDeviceGetPerformanceState", h),
            "persistence_mode": r(nvml, "nvmlDeviceGetPersistenceMode", h),
            "virtualization_mode": r(nvml, "nvmlDeviceGetVirtualizationMode", h),
            "memory_total_bytes": getattr(mem, "total", None),
            "memory_used_bytes": getattr(mem, "used", None),
        }
    except Exception as err:
        return {"nvml_error": str(err)}
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def snapshot(device: str | None = None, nvml=None, uuid: str | None = None) -> dict[str, Any]:
    """Everything a reader needs to trust or reproduce a number, as plain JSON values."""
    return {
        "taken_at": utc_now(),
        **git_info(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),  # set by kvlab/__init__ (CPU runs)
        "rapl": hostload.rapl_status(),  # CPU energy counter, if the machine exposes one
        "packages": package_versions(),
        **torch_info(device),
        "gpu": gpu_state(device, nvml=nvml, uuid=uuid),
    }
