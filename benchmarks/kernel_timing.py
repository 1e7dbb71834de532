"""Kernel timing shared by the kernel benchmarks: a clock (CUDA events on a GPU, perf_counter on a
CPU), CUDA graphs, the read-only and copy streams a kernel's bandwidth is quoted against, and
:func:`time_alternated`, which times every callable being compared in one alternation (ABAB...:
each once per round, ``repeats`` rounds) so clock and thermal drift land on each alike."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvlab.repeats import alternate  # noqa: E402


class Clock:
    """Milliseconds of a callable: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def sample_ms(self, fn, iters: int) -> float:
        """One measurement: ms per call over ``iters`` back-to-back calls."""
        self.sync()
        if self.cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters

    def median_ms(self, fn, iters: int, repeats: int) -> float:
        """The median of ``repeats`` measurements of one callable (a reference stream measured alone)."""
        return statistics.median(alternate({"fn": lambda: self.sample_ms(fn, iters)}, repeats)["fn"])


def graph_of(fn, device):
    """``fn`` captured in a CUDA graph (warmed up on a side stream first, as torch asks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def time_alternated(fns: dict, device, clock, iters, repeats, graphs: bool = True) -> dict:
    """Eager (and on CUDA graph-replay) ms per call of each ``fns[prefix] = (fn, per_call[, iters[,
    graph]])`` (``fn`` runs ``per_call`` calls; ``iters``: its own calls per measurement; ``graph``
    False: eager only), all timings alternating round by round: ``{prefix}_ms``,
    ``{prefix}_graph_ms``, or ``{prefix}_graph_error`` where capture failed."""
    out, samplers = {}, {}
    for prefix, (fn, per_call, *rest) in fns.items():
        n = rest[0] if rest and rest[0] else iters
        graph_too = graphs and (len(rest) < 2 or rest[1])
        fn()
        samplers[f"{prefix}_ms"] = lambda fn=fn, n=n, c=per_call: clock.sample_ms(fn, n) / c
        if graph_too and str(device).startswith("cuda"):
            try:
                graph = graph_of(fn, device)
                samplers[f"{prefix}_graph_ms"] = lambda g=graph, n=n, c=per_call: clock.sample_ms(g.replay, n) / c
            except Exception as err:  # noqa: BLE001
                out[f"{prefix}_graph_error"] = f"{type(err).__name__}: {err}"
    clock.sync()
    out.update({key: statistics.median(t) for key, t in alternate(samplers, repeats).items()})
    return out


def copy_bandwidth(device, clock, gib):
    """GB/s of a ``gib`` GiB device-to-device copy, counting the bytes read and written."""
    n = int(gib * 2**30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = clock.median_ms(lambda: dst.copy_(src), iters=5, repeats=5)
    return 2 * n / (ms * 1e-3) / 1e9


def read_bandwidth(device, clock, gib):
    """GB/s of a read-only stream over ``gib`` GiB (a reduction: every byte read once, one number
    written), the floor of a kernel that only reads."""
    n = int(gib * 2**30) // 4 * 4
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    ms = clock.median_ms(lambda: read_words(src), iters=5, repeats=5)
    return n / (ms * 1e-3) / 1e9


def read_words(buffer):
    """One read-only pass over a uint8 buffer whose length is a multiple of 4: the max of its int32 words."""
    return buffer.view(torch.int32).amax()


def read_same_bytes(device, nbytes, copies):
    """``(fn, per_call)``: a read-only stream over ``nbytes`` (the bytes one kernel call reads),
    ``copies`` buffers rotating as the kernel's inputs do, scaled to ``nbytes`` exactly: the time a
    kernel that only reads those bytes cannot beat."""
    n = max(4, int(nbytes) // 4 * 4)
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=device) for _ in range(copies)]

    def read():
        for t in src:
            read_words(t)

    return read, copies * n / nbytes


def copy_same_bytes(device, nbytes, copies):
    """``(fn, per_call)``: a device-to-device copy of ``nbytes`` (the bytes one kernel call reads);
    like the kernel's inputs, ``copies`` buffers rotate so that L2 cannot serve them. The kernel's
    byte floor is half of it: the copy reads and writes the bytes, the kernel reads."""
    n = max(1, int(nbytes))
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=device) for _ in range(copies)]
    dst = [torch.empty_like(t) for t in src]

    def copy():
        for d, t in zip(dst, src, strict=True):
            d.copy_(t)

    return copy, copies


def l2_bytes(device):
    """The L2 cache size (50 MiB when torch does not say; 0 on CPU, where nothing rotates)."""
    if not device.startswith("cuda"):
        return 0
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
