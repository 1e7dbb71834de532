"""One measured generation under a cache policy at batch B: timings, memory, cache size, energy.

What a run measures, and how:

- **TTFT**: window start to the first token on the host (after a synchronize).
- **Exactly N new tokens** (EOS ignored): the first is picked from the prefill logits, the other
  N-1 come from the engine's decode steps (:mod:`kvlab.engine.engines`).
- **Per-token timestamps**: CUDA events recorded after every decode step on GPU (read after the
  final synchronize, so they add no syncs), ``perf_counter`` on CPU. ITL statistics come from them;
  ``gpu_busy_ms`` is the GPU-side span of decode (it equals wall time when the host, not the GPU,
  sets the pace: batch-1 eager decode is launch bound).
- **Memory**: torch's peak allocated bytes (reset per run; includes weights) and NVML's device-wide
  peak from the sampler thread; cache bytes and tokens right after prefill (eviction happens there).
- **Attention**: ``model.config._attn_implementation`` as it ran, the SDPA backend requested, and
  optionally (``probe=True``, used on warm-ups) the SDPA kernels torch actually picked for prefill
  and decode, read from a profiler trace, with the decode step's summed GPU kernel time.
- **Energy**: one sampler window around prefill + decode, split at the decode start.
- **Host**: during decode, this process's CPU time, the VM's steal time and the main thread's
  involuntary context switches (:mod:`kvlab.hostload`): batch-1 decode is host-bound, so a slow
  run needs them to say whether it lost its CPU or spent it.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from kvlab.anatomy import op_times
from kvlab.energy import NullSampler, Sampler, WindowResult
from kvlab.engine import prefill_rows as groups_of
from kvlab.hostload import contention, host_delta, peak_rss_bytes, read_counters, reset_peak_rss

SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
# profiler op name fragment -> short kernel name (most specific first)
SDPA_OPS = (
    ("_scaled_dot_product_flash_attention_for_cpu", "flash_cpu"),
    ("_scaled_dot_product_cudnn_attention", "cudnn"),
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_scaled_dot_product_efficient_attention", "efficient"),
    ("_scaled_dot_product_fused_attention_overrideable", "overrideable"),
    ("_scaled_dot_product_attention_math", "math"),
)
PROBE_DECODE_STEPS = 4

# A plain-word vocabulary for exact-length noise prompts on models with a tokenizer.
_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or "
    "had not but first one their its new after who they have has been also more two time into city "
    "river house market garden winter summer music paper stone light water north south table window "
    "letter station forest island bridge engine number silver yellow orange purple morning evening"
).split()


class MeasureError(RuntimeError):
    """The generation did not do what was asked (e.g. not exactly N new tokens)."""


def sdpa_context(backend: str | None):
    """``torch.nn.attention.sdpa_kernel`` pinned to one backend, or a no-op for ``auto``."""
    if backend in (None, "auto"):
        return nullcontext()
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"sdpa_backend={backend!r}: use auto or one of {', '.join(SDPA_BACKENDS)}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])])


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def prompt_seed(seed: int, prompt_id: int, row: int = 0) -> int:
    """The RNG seed of one prompt row: stable across processes (no Python ``hash``)."""
    return (int(seed) * 1_000_003 + int(prompt_id) * 10_007 + int(row)) % (2**63)


def haystack_ids(tokenizer, ctx: int, seed: int) -> list[int]:
    """Exactly ``ctx`` token ids of seeded word noise (BOS first when the tokenizer has one)."""
    rng = random.Random(seed)
    bos = getattr(tokenizer, "bos_token_id", None)
    want = ctx - (1 if bos is not None else 0)
    ids: list[int] = []
    n_words = max(16, want)
    while len(ids) < want:
        words = [rng.choice(_WORDS) for _ in range(n_words)]
        ids += tokenizer(" ".join(words) + ". ", add_special_tokens=False)["input_ids"]
    ids = ids[:want]
    return ([bos] if bos is not None else []) + ids


def make_prompt(loaded, ctx: int, batch: int, prompt_id: int = 0, seed: int = 0):
    """A ``[batch, ctx]`` LongTensor on the model's device; rows differ, ``prompt_id`` picks the set.

    Synthetic models (no tokenizer) get seeded random ids; real ones word noise through the
    tokenizer. Either way the length is exact.
    """
    import torch

    rows = []
    for row in range(batch):
        s = prompt_seed(seed, prompt_id, row)
        if loaded.tokenizer is None:
            g = torch.Generator().manual_seed(s)
            rows.append(torch.randint(0, loaded.spec.vocab_size, (ctx,), generator=g))
        else:
            rows.append(torch.tensor(haystack_ids(loaded.tokenizer, ctx, s)))
    return torch.stack(rows).to(loaded.device)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


class StepClock:
    """Timestamps at marks: CUDA events on GPU (no sync until read), ``perf_counter`` on CPU."""

    def __init__(self, cuda: bool):
        import torch

        self.cuda = cuda
        self._torch = torch
        self._now = time.perf_counter
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(self._now())

    def elapsed_ms(self, i: int, j: int) -> float:
        """Milliseconds from mark ``i`` to mark ``j``. CUDA: waits for mark ``j`` first, which costs
        nothing after a window's closing synchronize and is needed without one (a NullSampler)."""
        a, b = self.marks[i], self.marks[j]
        if not self.cuda:
            return (b - a) * 1000.0
        b.synchronize()
        return float(a.elapsed_time(b))

    def intervals_ms(self, start: int = 0) -> list[float]:
        return [self.elapsed_ms(k, k + 1) for k in range(start, len(self.marks) - 1)]


def itl_stats(itl_ms: list[float]) -> dict[str, float | None]:
    """Mean, median, p90 (linear interpolation) and max of inter-token latencies."""
    if not itl_ms:
        return {"itl_mean_ms": None, "itl_median_ms": None, "itl_p90_ms": None, "itl_max_ms": None}
    ordered = sorted(itl_ms)
    pos = 0.9 * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    p90 = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    return {"itl_mean_ms": statistics.fmean(itl_ms), "itl_median_ms": statistics.median(itl_ms),
            "itl_p90_ms": p90, "itl_max_ms": ordered[-1]}


# --------------------------------------------------------------------------------------------
# Kernel probe (warm-up only: the profiler perturbs timings)
# --------------------------------------------------------------------------------------------


class KernelProbe:
    """Profiles a stretch of work to see which SDPA kernel ran and how long GPU kernels took."""

    def __init__(self, cuda: bool):
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.cuda = cuda
        # one profiling cycle per probe: acc_events=True changes nothing here, and stops torch 2.11 (H200)
        # warning "Profiler clears events at the end of each cycle" on every profile (pytorch #180387)
        self._prof = profile(activities=acts, acc_events=True)
        self.kernels: list[str] = []
        self.device_ms: float | None = None
        self.running = False

    def start(self) -> None:
        self._prof.start()
        self.running = True

    def abandon(self) -> None:
        """Stop a profiler left running by a failed run, without reading it: a profiler never
        stopped would time every later run of the process (and crashed it at exit under a memory
        limit)."""
        if self.running:
            self.running = False
            self._prof.stop()

    def stop(self) -> None:
        if not self.running:
            return
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self._prof.stop()
        self.running = False
        averages = self._prof.key_averages()
        found = []
        for ev in averages:
            for fragment, short in SDPA_OPS:
                if fragment in ev.key:
                    found.append(short)
                    break
        self.kernels = sorted(set(found))
        if self.cuda:
            self.device_ms = kernel_ms(self._prof.events())


def kernel_ms(events) -> float:
    """Summed duration of the GPU kernels launched by the CPU ops of a profiler trace (ms).

    Counted per op from ``evt.kernels``, as :func:`kvlab.anatomy.op_times` does. Summing
    ``self_device_time_total`` over ``key_averages()`` instead counts every kernel twice, once as its
    own row and once under the op that launched it: H200 records made that way said
    16.4 ms for a 16k decode step whose kernels the anatomy timed at 8.2 ms.
    """
    return sum(op.us for op in op_times(events, on_device=True)) / 1000.0


def _kernel_label(prefill: list[str], decode: list[str]) -> str:
    p = "+".join(prefill) or "none"
    d = "+".join(decode) or ("none" if decode is not None else "")
    return p if p == d or not d else f"prefill={p},decode={d}"


# --------------------------------------------------------------------------------------------
# The measured run
# --------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    """Metrics of one generation (record fields), the energy window and the generated ids."""

    record: dict[str, Any]
    window: WindowResult
    tokens: Any = None


def _token_count(tokens) -> int:
    return int(tokens.shape[-1]) if hasattr(tokens, "shape") else len(tokens)


def measure_generation(
    loaded,
    policy,
    *,
    ctx: int,
    batch: int = 1,
    new_tokens: int = 128,
    prompt_id: int = 0,
    seed: int = 0,
    sampler: Sampler | None = None,
    sdpa_backend: str | None = "auto",
    idle_w: float | None = None,
    input_ids=None,
    probe: bool = False,
    on_step: Callable[[int], None] | None = None,
    engine,
    prefill_rows: int | None = None,
) -> Measurement:
    """Generate exactly ``new_tokens`` per sequence from an exact-length prompt and measure it.

    ``policy`` must already be checked and prepared (a sweep's :class:`kvlab.sweep.group.ModelSession` does that once per model);
    ``policy.prepare`` is idempotent and called again here for direct callers. ``engine``
    (:func:`kvlab.engine.engines.make_engine`) builds this shape's decoder before the energy window
    opens (the fast engine: its static buffers and CUDA graph; copying the kept K/V into them counts
    as prefill). ``prefill_rows`` (fast engine only): prefill that many sequences at a time into the
    static buffers (:meth:`FastDecoder.prefill`), so a large batch's peak holds one group's prefill
    cache; ignored (and recorded as None) when it is at least ``batch``. The prefill window covers
    every group.
    """
    import torch

    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens}: generate at least 1 token")
    model = loaded.model
    device = str(loaded.device)
    cuda = device.startswith("cuda")
    sampler = sampler or NullSampler("none: no sampler given")
    ids = input_ids if input_ids is not None else make_prompt(loaded, ctx, batch, prompt_id, seed)
    if tuple(ids.shape) != (batch, ctx):
        raise MeasureError(f"prompt has shape {tuple(ids.shape)}, expected ({batch}, {ctx})")
    rows = groups_of(prefill_rows, batch, engine.name)

    policy.prepare(model)
    # The engine may replace its decoder here, freeing the one before: the peak is reset after, or
    # it would start at the old store's size (a fast int4 run after a full one at batch 32, 16k:
    # 85.4 GB where its own was 52.2). The new store counts: it is held.
    decoder = engine.decoder(policy, batch, ctx, new_tokens)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rss_window = not cuda and reset_peak_rss()  # CPU: the process's peak RSS over this run
    clock = StepClock(cuda)
    probe_prefill = KernelProbe(cuda) if probe else None
    probe_decode = KernelProbe(cuda) if probe and new_tokens > 1 else None
    n_probe = min(PROBE_DECODE_STEPS, new_tokens - 1)

    def step_done(i: int) -> None:
        clock.mark()
        if probe_decode is not None and i + 1 == n_probe:
            probe_decode.stop()
        if on_step is not None:
            on_step(i)

    chunk = getattr(policy, "prefill_chunk", None)
    try:
        with sdpa_context(sdpa_backend), torch.no_grad(), sampler.window("prefill") as win:
            t0 = win.phase_edges[0]
            prefill_start = read_counters()
            clock.mark()  # 0: prefill start
            if probe_prefill:
                probe_prefill.start()
            first = decoder.prefill(ids, chunk, rows)  # fast: into the static buffers, ``rows`` at a time
            clock.mark()  # 1: first token
            if probe_prefill:
                probe_prefill.stop()
            if cuda:
                torch.cuda.synchronize(device)
            t_first = time.perf_counter()
            stats = decoder.stats()
            t_decode = win.mark("decode")
            clock.mark()  # 2: decode start
            host_start = read_counters()
            if probe_decode:
                probe_decode.start()
            tokens = decoder.decode(first, new_tokens, start_position=ctx, on_step=step_done)
            if probe_decode:
                probe_decode.stop()
    finally:  # a run that raised (e.g. an OOM in a probed warm-up) must not leave a profiler running
        for probe in (probe_prefill, probe_decode):
            if probe is not None:
                probe.abandon()
    host = host_delta(host_start, read_counters())  # decode, to the window's closing synchronize
    prefill_host = host_delta(prefill_start, host_start)  # prefill and the first token
    final = decoder.stats(new_tokens)  # after the decode
    res = win.result
    if _token_count(tokens) != new_tokens:
        raise MeasureError(f"generated {_token_count(tokens)} tokens per sequence, expected exactly {new_tokens}")

    itl = clock.intervals_ms(start=2)
    n_out = batch * new_tokens
    decode_s = res.t1 - t_decode
    energy = res.energy_j
    net = energy - idle_w * res.seconds if energy is not None and idle_w is not None else None
    e10 = res.energy_10hz_j
    record: dict[str, Any] = {
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "sdpa_backend": sdpa_backend or "auto",
        "ttft_s": t_first - t0,
        "prefill_s": clock.elapsed_ms(0, 1) / 1000.0,
        "decode_s": decode_s,
        "itl_ms": itl,
        **itl_stats(itl),
        "gpu_busy_ms": clock.elapsed_ms(2, len(clock.marks) - 1) if cuda and new_tokens > 1 else None,
        "tokens_per_s": batch * (new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else None,
        "peak_mem_bytes": (int(torch.cuda.max_memory_allocated(device)) if cuda
                           else peak_rss_bytes() if rss_window else None),
        "peak_mem_source": ("torch.cuda.max_memory_allocated" if cuda
                            else "process peak RSS (VmHWM)" if rss_window else None),
        "peak_mem_reserved_bytes": int(torch.cuda.max_memory_reserved(device)) if cuda else None,
        "peak_mem_nvml_bytes": res.peak_mem_nvml_bytes,
        "cache_bytes": stats.get("bytes"),
        "cache_logical_tokens": stats.get("logical_tokens"),
        "cache_physical_tokens": stats.get("physical_tokens"),
        "cache_final_physical_tokens": final.get("physical_tokens"),  # decode-time compression bounds it
        "cache_final_bytes": final.get("bytes"),
        "energy_source": res.source,
        "energy_j": energy,
        "prefill_j": res.phase_j.get("prefill"),
        "decode_j": res.phase_j.get("decode"),
        "idle_w": idle_w,
        "net_energy_j": net,
        "j_per_token": energy / n_out if energy is not None else None,
        "net_j_per_token": net / n_out if net is not None else None,
        "energy_10hz_j": e10,
        "j_per_token_10hz": e10 / n_out if e10 is not None else None,
        # beyond the documented columns
        "window_s": res.seconds,
        # the window on the wall clock and on the GPU's cumulative counter (kvlab.analysis.attribution)
        "window_start_unix": res.start_unix,
        "energy_counter_start_j": res.counter_start_j,
        "decode_j_per_token": (res.phase_j.get("decode") / (batch * (new_tokens - 1))
                               if res.phase_j.get("decode") is not None and new_tokens > 1 else None),
        "energy_instant_j": res.energy_instant_j,
        "energy_average_j": res.energy_average_j,
        "energy_samples": res.n_samples,
        "temp_start_c": res.temp_start_c,
        "temp_end_c": res.temp_end_c,
        **{f"decode_{k}": v for k, v in host.items()},
        "prefill_host_process_cpu_ms": prefill_host["host_process_cpu_ms"],  # CPU cost, split as energy
        **decoder.columns(rows),
    }
    threads = torch.get_num_threads()
    contended, why = contention(host, decode_s, threads, device)
    record.update(threads=threads, contended=contended, contention=why or None)
    if probe:
        record["sdpa_kernel"] = _kernel_label(probe_prefill.kernels, probe_decode.kernels if probe_decode else [])
        record["decode_kernel_ms"] = (probe_decode.device_ms / n_probe
                                      if probe_decode is not None and probe_decode.device_ms is not None else None)
    return Measurement(record=record, window=res, tokens=tokens)
