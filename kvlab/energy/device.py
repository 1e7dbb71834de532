"""Which NVML device is this torch device: UUIDs, ``CUDA_VISIBLE_DEVICES``, PCI bus ids, static facts.

NVML ignores ``CUDA_VISIBLE_DEVICES``, so the device is matched by UUID: torch's UUID of the device
where torch can tell, else the entry of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID, as Ray or
SLURM set it for a worker given one GPU) resolved through NVML; never GPU 0 by index.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def norm_uuid(uuid: Any) -> str:
    """A GPU's UUID as one key whatever its spelling: lower case, without ``GPU-``/``MIG-``."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return text


def cuda_index(device) -> int:
    """The index of a torch CUDA device (``"cuda"`` alone: the current one), for the calls that
    refuse a device without one (``set_per_process_memory_fraction``)."""
    import torch

    dev = torch.device(device)
    return dev.index if dev.index is not None else torch.cuda.current_device()


def torch_device_uuid(device: str) -> str:
    """UUID of a torch CUDA device as NVML spells it (without the ``GPU-`` prefix)."""
    import torch

    return norm_uuid(torch.cuda.get_device_properties(cuda_index(device)).uuid)


def find_handle(nvml, uuid: str):
    """The NVML handle whose UUID matches ``uuid`` (prefix-insensitive), or None."""
    want = norm_uuid(uuid)
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        if norm_uuid(nvml.nvmlDeviceGetUUID(handle)) == want:
            return handle
    return None


def _device_index(device: str) -> int:
    text = str(device)
    return int(text.split(":", 1)[1]) if ":" in text else 0


def visible_device_uuid(nvml, device: str, environ: dict[str, str] | None = None) -> str | None:
    """UUID (as NVML spells it) of the GPU torch calls ``device``, read from ``CUDA_VISIBLE_DEVICES``.

    Entry N of the variable is ``cuda:N``: an NVML index (CUDA and NVML agree on the order when
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or the GPUs are alike, as on one node) or a UUID (whole, or a
    prefix as CUDA accepts it). Unset, ``cuda:N`` is NVML index N. None when no NVML device matches
    (e.g. a MIG slice), so the caller falls back to torch's own UUID.
    """
    environ = os.environ if environ is None else environ
    index = _device_index(device)
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in raw.split(",")] if raw is not None else None
    try:
        if entries is None:
            return str(_decoded(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index))))
        if index >= len(entries) or not entries[index]:
            return None
        entry = entries[index]
        if entry.isdigit():
            return str(_decoded(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(int(entry)))))
        want = norm_uuid(entry)
        found = [_decoded(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
                 for i in range(nvml.nvmlDeviceGetCount())]
        matches = [u for u in found if norm_uuid(u).startswith(want)]
        return str(matches[0]) if len(matches) == 1 else None
    except Exception:
        return None


def _decoded(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def torch_uuid_or_none(device: str) -> str | None:
    """:func:`torch_device_uuid` where torch sees a GPU, else None (never raises)."""
    try:
        import torch

        return torch_device_uuid(device) if torch.cuda.is_available() else None
    except Exception:
        return None


def torch_device_pci(device: str) -> str | None:
    """PCI bus id of a torch CUDA device in NVML's spelling (``00000000:19:00.0``), if torch has it."""
    import torch

    props = torch.cuda.get_device_properties(cuda_index(device))
    try:
        return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:
        return None


def device_handle(nvml, device: str, uuid: str | None = None):
    """The NVML handle of torch's ``device``: by ``uuid`` when given, else by torch's UUID or
    ``CUDA_VISIBLE_DEVICES``' entry, then by PCI bus; raises LookupError when none matches."""
    by_torch = uuid is None
    if by_torch:  # the GPU this process was given; torch's own UUID wins where it can tell
        uuid = torch_uuid_or_none(device) or visible_device_uuid(nvml, device)
        if uuid is None:
            raise LookupError(f"no NVML device matches {device} (CUDA_VISIBLE_DEVICES="
                              f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    handle = find_handle(nvml, uuid)
    if handle is None and by_torch:
        handle = find_handle_by_pci(nvml, torch_device_pci(device))
    if handle is None:
        raise LookupError(f"no NVML device has the UUID {uuid} of {device}")
    return handle


def find_handle_by_pci(nvml, bus_id: str | None):
    """Fallback when UUIDs do not match (e.g. a MIG slice): the NVML device on the same PCI bus."""
    if not bus_id:
        return None
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        found = nvml.nvmlDeviceGetPciInfo(handle).busId
        found = found.decode() if isinstance(found, bytes) else str(found)
        if found.lower().endswith(bus_id.lower()[-12:]):
            return handle
    return None


def cuda_sync(device: str) -> Callable[[], None]:
    import torch

    dev = torch.device(device)
    return lambda: torch.cuda.synchronize(dev)


def gpu_info(nvml, handle) -> dict[str, Any]:
    """Static facts of the device for records and manifests (each None when NVML refuses)."""

    def read(fn, *args, scale=None):
        try:
            value = getattr(nvml, fn)(handle, *args) if handle is not None else getattr(nvml, fn)(*args)
        except Exception:
            return None
        if isinstance(value, bytes):
            value = value.decode()
        return value / scale if scale and value is not None else value

    def read_system(fn):
        try:
            value = getattr(nvml, fn)()
        except Exception:
            return None
        return value.decode() if isinstance(value, bytes) else value

    return {
        "gpu_name": read("nvmlDeviceGetName"),
        "gpu_uuid": read("nvmlDeviceGetUUID"),
        "driver": read_system("nvmlSystemGetDriverVersion"),
        "power_limit_w": read("nvmlDeviceGetEnforcedPowerLimit", scale=1000.0),
        "sm_clock_max_mhz": read("nvmlDeviceGetMaxClockInfo", 1),  # NVML_CLOCK_SM
        "mem_clock_max_mhz": read("nvmlDeviceGetMaxClockInfo", 2),  # NVML_CLOCK_MEM
    }
