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
"""

from __future__ import annotations

import bisect
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

SOURCE_COUNTER = "nvml-counter"
THREAD_NAME = "kvlab-energy-sampler"

FI_POWER_AVERAGE = 185  # NVML_FI_DEV_POWER_AVERAGE (mW, 1 s average)
FI_POWER_INSTANT = 186  # NVML_FI_DEV_POWER_INSTANT (mW)
POWER_SCOPE_GPU = 0  # NVML_POWER_SCOPE_GPU

# ---------------------------------------------------------------------------------------------
# Pure math over sampled timelines (seconds, watts, joules)
# ---------------------------------------------------------------------------------------------


def _value_at(ts: Sequence[float], ps: Sequence[float], t: float) -> float:
    """Linear interpolation inside the samples, held flat beyond the first and last."""
    i = bisect.bisect_right(ts, t)
    if i == 0:
        return ps[0]
    if i >= len(ts):
        return ps[-1]
    t_a, t_b = ts[i - 1], ts[i]
    if t_b == t_a:
        return ps[i]
    return ps[i - 1] + (ps[i] - ps[i - 1]) * (t - t_a) / (t_b - t_a)


def integrate_linear(ts: Sequence[float], ps: Sequence[float], t0: float, t1: float) -> float | None:
    """Integral of the piecewise-linear curve through (ts, ps) over [t0, t1] (exact trapezoid).

    Used for instant power: between polls power is taken to change linearly, and the window edges
    are interpolated rather than snapped to the nearest poll.
    """
    if not ts or t1 < t0:
        return None
    points = [t0] + [t for t in ts if t0 < t < t1] + [t1]
    values = [_value_at(ts, ps, t) for t in points]
    return sum((points[k + 1] - points[k]) * (values[k] + values[k + 1]) / 2 for k in range(len(points) - 1))


def integrate_hold(ts: Sequence[float], ps: Sequence[float], t0: float, t1: float) -> float | None:
    """Integral with each sample held until the next one (what a 10 Hz poller sums as P * 0.1 s).

    Before the first sample the first value is used, so a window shorter than the poll period
    still gets the reading taken just before it.
    """
    if not ts or t1 < t0:
        return None
    points = [t0] + [t for t in ts if t0 < t < t1] + [t1]
    total = 0.0
    for a, b in zip(points[:-1], points[1:], strict=True):
        total += ps[max(bisect.bisect_right(ts, a) - 1, 0)] * (b - a)
    return total


def split_energy(
    total_j: float, ts: Sequence[float], ps: Sequence[float], edges: Sequence[float]
) -> list[float] | None:
    """Apportion a counter total between consecutive phases by each phase's share of integral(P).

    ``edges`` are the phase boundaries ``[t0, t_1, ..., t_end]``; the result has one entry per
    phase and sums to ``total_j``. None when power was not sampled or integrates to zero.
    """
    if len(edges) < 2 or not ts:
        return None
    parts = [integrate_linear(ts, ps, a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    whole = sum(p for p in parts if p is not None)
    if any(p is None for p in parts) or whole <= 0:
        return None
    return [total_j * p / whole for p in parts]


def median_power(ts: Sequence[float], joules: Sequence[float]) -> float | None:
    """Median of dE/dt over consecutive (time, cumulative energy) readings: a robust idle power."""
    rates = [(joules[k + 1] - joules[k]) / (ts[k + 1] - ts[k]) for k in range(len(ts) - 1) if ts[k + 1] > ts[k]]
    return statistics.median(rates) if rates else None


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass
class Timeline:
    """Raw samples of one window, on the host ``perf_counter`` clock (seconds, watts, joules)."""

    instant: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    average: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    counter: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    power_usage: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    instant_updates: int = 0

    def relative_to(self, t0: float) -> dict[str, Any]:
        """JSON-safe copy with times relative to ``t0`` (for a timeline sidecar file)."""

        def rel(pair):
            return {"t": [round(t - t0, 6) for t in pair[0]], "v": [round(v, 3) for v in pair[1]]}

        return {
            "instant_w": rel(self.instant),
            "average_w": rel(self.average),
            "counter_j": rel(self.counter),
            "power_usage_w": rel(self.power_usage),
            "instant_updates": self.instant_updates,
        }


@dataclass
class WindowResult:
    """One measured window: host times always, energies when NVML gave them (else None)."""

    source: str
    t0: float
    t1: float
    phase_names: list[str]
    phase_edges: list[float]
    energy_j: float | None = None
    energy_instant_j: float | None = None
    energy_average_j: float | None = None
    energy_10hz_j: float | None = None
    phase_j: dict[str, float | None] = field(default_factory=dict)
    peak_mem_nvml_bytes: int | None = None
    temp_start_c: float | None = None
    temp_end_c: float | None = None
    n_samples: int = 0
    timeline: Timeline | None = None
    # where the window sits on the wall clock and on the GPU's cumulative counter, so a sweep's
    # windows can be laid against per-GPU counter readings (kvlab.runner.attribution)
    start_unix: float | None = None
    counter_start_j: float | None = None

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0

    def phase_s(self) -> dict[str, float]:
        edges = self.phase_edges + [self.t1]
        return {n: edges[k + 1] - edges[k] for k, n in enumerate(self.phase_names)}


class WindowError(ValueError):
    """A window was misused (marked after it closed, or a phase name repeated)."""


class Window:
    """Handle for an open window: ``mark(name)`` starts the next phase; ``result`` after close."""

    def __init__(self, first_phase: str, clock: Callable[[], float], sync: Callable[[], None]):
        self._clock = clock
        self._sync = sync
        self.phase_names = [first_phase]
        self.phase_edges: list[float] = []
        self.result: WindowResult | None = None

    def mark(self, name: str) -> float:
        """Synchronize, then start phase ``name`` now; returns the host time of the boundary."""
        if self.result is not None:
            raise WindowError(f"window already closed; mark {name!r} inside the `with` block")
        if name in self.phase_names:
            raise WindowError(f"phase {name!r} already marked; phases: {self.phase_names}")
        self._sync()
        t = self._clock()
        self.phase_names.append(name)
        self.phase_edges.append(t)
        return t


# ---------------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------------


class NullSampler:
    """Sampler for machines without NVML energy: host timings only, energies None, reason kept."""

    def __init__(self, reason: str, sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.source = reason if reason.startswith("none") else f"none: {reason}"
        self._sync = sync or (lambda: None)
        self._clock = clock
        self.gpu: dict[str, Any] = {}

    @contextmanager
    def window(self, phase: str = "total"):
        self._sync()
        handle = Window(phase, self._clock, self._sync)
        handle.phase_edges.append(self._clock())
        start_unix = time.time()
        try:
            yield handle
        finally:
            self._sync()
            t1 = self._clock()
            handle.result = WindowResult(
                self.source, handle.phase_edges[0], t1, list(handle.phase_names), list(handle.phase_edges),
                phase_j={n: None for n in handle.phase_names}, start_unix=start_unix,
            )

    def measure_idle(self, seconds: float, sub_s: float = 1.0) -> float | None:
        return None

    def close(self) -> None:
        pass


# nvmlValueType_t -> the member of the nvmlValue_t union that holds the number
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _field_value(fv) -> float:
    """The number inside an ``nvmlFieldValue_t`` whatever its value type."""
    member = _VALUE_MEMBERS.get(int(fv.valueType), "ullVal")
    return float(getattr(fv.value, member))


class _Poller:
    """The background thread of one window: polls fast channels every ``interval_s`` and
    ``nvmlDeviceGetPowerUsage`` every ``study_interval_s``; stops (and joins) on ``stop()``."""

    def __init__(self, sampler: NvmlSampler):
        self.s = sampler
        self.timeline = Timeline()
        self.mem_max = 0
        self.n_polls = 0
        self._last_ts: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._next_study = 0.0

    def start(self) -> None:
        self.safe_poll(study=True)  # a sample before t0, so the window's first edge interpolates
        self._next_study = self.s._clock() + self.s.study_interval_s
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.safe_poll(study=True)  # and one after t1

    def safe_poll(self, study: bool) -> None:
        try:
            self.poll(study=study)
        except Exception:  # a failing NVML read must never kill the measured run
            pass

    def _run(self) -> None:
        interval = self.s.interval_s
        next_t = self.s._clock() + interval
        while not self._stop.wait(max(0.0, next_t - self.s._clock())):
            now = self.s._clock()
            study = now >= self._next_study
            if study:
                self._next_study = max(self._next_study + self.s.study_interval_s, now)
            self.safe_poll(study=study)
            next_t = max(next_t + interval, self.s._clock())

    def poll(self, study: bool) -> None:
        s, nv, tl = self.s, self.s.nvml, self.timeline
        if s.fields:
            values = nv.nvmlDeviceGetFieldValues(s.handle, s.fields)
            now = s._clock()
            for fid, fv in zip(s.field_ids, values, strict=False):
                if int(fv.nvmlReturn) != 0:
                    continue
                watts = _field_value(fv) / 1000.0
                series = tl.instant if fid == FI_POWER_INSTANT else tl.average
                series[0].append(now)
                series[1].append(watts)
                if fid == FI_POWER_INSTANT and int(fv.timestamp) != self._last_ts:
                    self._last_ts = int(fv.timestamp)
                    tl.instant_updates += 1
        joules = nv.nvmlDeviceGetTotalEnergyConsumption(s.handle) / 1000.0
        now = s._clock()
        if not tl.counter[1] or tl.counter[1][-1] != joules:
            tl.counter[0].append(now)
            tl.counter[1].append(joules)
        if study:
            watts = nv.nvmlDeviceGetPowerUsage(s.handle) / 1000.0
            tl.power_usage[0].append(s._clock())
            tl.power_usage[1].append(watts)
        if s.memory:
            self.mem_max = max(self.mem_max, int(nv.nvmlDeviceGetMemoryInfo(s.handle).used))
        self.n_polls += 1


class NvmlSampler:
    """Energy windows on one NVML device (see the module docstring for the channels)."""

    source = SOURCE_COUNTER

    def __init__(self, nvml, handle, *, sync: Callable[[], None], interval_s: float = 0.015,
                 study_interval_s: float = 0.1, clock: Callable[[], float] = time.perf_counter,
                 gpu: dict[str, Any] | None = None):
        if not 0.001 <= interval_s <= 1.0:
            raise ValueError(f"interval_s={interval_s}: poll every 0.01-0.02 s (allowed 0.001-1)")
        self.nvml = nvml
        self.handle = handle
        self._sync = sync
        self._clock = clock
        self.interval_s = interval_s
        self.study_interval_s = study_interval_s
        self.gpu = gpu or {}
        self.fields, self.field_ids = self._probe_fields()
        self.memory = self._probe(lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used)
        self.temperature = self._probe(lambda: nvml.nvmlDeviceGetTemperature(handle, 0))

    def _probe(self, read) -> bool:
        try:
            read()
            return True
        except Exception:
            return False

    def _probe_fields(self) -> tuple[list, list[int]]:
        """The power fields this device answers at GPU scope (instant first; either may be absent)."""
        wanted = [FI_POWER_INSTANT, FI_POWER_AVERAGE]
        try:
            values = self.nvml.nvmlDeviceGetFieldValues(self.handle, [(f, POWER_SCOPE_GPU) for f in wanted])
        except Exception:
            return [], []
        ok = [f for f, v in zip(wanted, values, strict=False) if int(v.nvmlReturn) == 0]
        return [(f, POWER_SCOPE_GPU) for f in ok], ok

    def _counter_j(self) -> float:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0

    def _temperature(self) -> float | None:
        if not self.temperature:
            return None
        try:
            return float(self.nvml.nvmlDeviceGetTemperature(self.handle, 0))
        except Exception:
            return None

    @contextmanager
    def window(self, phase: str = "total"):
        """Measure the block: sync, counter read and t0 on entry; sync, counter read, t1 on exit.

        The polling thread runs only while the window is open and is joined on exit, also when
        the block raises.
        """
        poller = _Poller(self)
        temp0 = self._temperature()
        poller.start()
        handle = Window(phase, self._clock, self._sync)
        try:
            self._sync()
            t0 = self._clock()
            start_unix = time.time()
            c0 = self._counter_j()
            handle.phase_edges.append(t0)
            try:
                yield handle
            finally:
                self._sync()
                c1 = self._counter_j()
                t1 = self._clock()
        finally:
            poller.stop()
        handle.result = self._result(handle, t0, t1, c0, c1, poller, temp0, start_unix)

    def _result(self, handle: Window, t0: float, t1: float, c0: float, c1: float, poller: _Poller,
                temp0: float | None, start_unix: float) -> WindowResult:
        joules = c1 - c0
        tl = poller.timeline
        inst_t, inst_p = tl.instant
        avg_t, avg_p = tl.average
        pu_t, pu_p = tl.power_usage
        edges = handle.phase_edges + [t1]
        parts = split_energy(joules, inst_t, inst_p, edges)
        names = list(handle.phase_names)
        return WindowResult(
            source=self.source, t0=t0, t1=t1, phase_names=names, phase_edges=list(handle.phase_edges),
            energy_j=joules,
            energy_instant_j=integrate_linear(inst_t, inst_p, t0, t1),
            energy_average_j=integrate_linear(avg_t, avg_p, t0, t1),
            energy_10hz_j=integrate_hold(pu_t, pu_p, t0, t1),
            phase_j=dict(zip(names, parts, strict=True)) if parts else {n: None for n in names},
            peak_mem_nvml_bytes=poller.mem_max if self.memory else None,
            temp_start_c=temp0, temp_end_c=self._temperature(),
            n_samples=poller.n_polls, timeline=tl, start_unix=start_unix, counter_start_j=c0,
        )

    def measure_idle(self, seconds: float, sub_s: float = 1.0) -> float | None:
        """Idle power (W) with whatever is resident now and no kernels: median dE/dt over
        ``sub_s`` sub-windows of the counter (a single window when ``seconds < 2 * sub_s``)."""
        if seconds <= 0:
            return None
        self._sync()
        n = max(1, int(seconds // sub_s)) if seconds >= 2 * sub_s else 1
        step = seconds / n
        ts, js = [self._clock()], [self._counter_j()]
        for _ in range(n):
            time.sleep(max(0.0, ts[0] + step * len(ts) - self._clock()))
            ts.append(self._clock())
            js.append(self._counter_j())
        return median_power(ts, js)

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass


Sampler = NvmlSampler | NullSampler

# ---------------------------------------------------------------------------------------------
# Finding the device
# ---------------------------------------------------------------------------------------------


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


def _torch_uuid_or_none(device: str) -> str | None:
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


def _import_nvml():
    import pynvml  # from the nvidia-ml-py distribution

    return pynvml


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

    return {
        "gpu_name": read("nvmlDeviceGetName"),
        "gpu_uuid": read("nvmlDeviceGetUUID"),
        "power_limit_w": read("nvmlDeviceGetEnforcedPowerLimit", scale=1000.0),
    }


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
        by_torch = uuid is None
        if by_torch:  # the GPU this process was given; torch's own UUID wins where it can tell
            uuid = _torch_uuid_or_none(dev) or visible_device_uuid(nvml, dev)
            if uuid is None:
                raise LookupError(f"no NVML device matches {dev} (CUDA_VISIBLE_DEVICES="
                                  f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        handle = find_handle(nvml, uuid)
        if handle is None and by_torch:
            handle = find_handle_by_pci(nvml, torch_device_pci(dev))
        if handle is None:
            raise LookupError(f"no NVML device has the UUID {uuid} of {dev}")
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
