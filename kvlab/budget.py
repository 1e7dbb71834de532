"""KV-cache byte budget: pure arithmetic, no torch.

Why a lab needs this first: most "does compression pay?" answers are visible on paper. A decode step
reads every weight once plus the whole cache, so at batch 1 the weights dominate and evicting the
cache cannot save much; the residual buffer of a quantized cache keeps recent tokens at full
precision, so short contexts compress far less than the nominal bit ratio; and capacity (how many
sequences fit) is where a smaller cache really shows.

Conventions: bytes are exact integers where they can be; GPU memory and bandwidth use the vendors'
decimal units (1 GB = 1e9 B); ``bits`` is the stored bits per element of K and V (16 for bf16/fp16,
8 for fp8/int8, 4, 3, 2, 1 for the quantized caches; 32 for a float32 cache on CPU).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

from kvlab.errors import UserError
from kvlab.models import ModelSpec

# every width a cache stores: the model dtypes and each quantized backend's (`kvlab policies`: hqq
# stores 1, 2, 3, 4 and 8 bits); tests/test_bad_inputs.py checks that the backends' widths are here
SUPPORTED_BITS = (32, 16, 8, 4, 3, 2, 1)
DTYPE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}
DEFAULT_RESERVE_BYTES = 2 * 1024**3  # activations, allocator slack, CUDA context: stated, overridable


class BudgetError(UserError):
    """Bad budget input; the message names the allowed values."""


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float


GPUS: dict[str, GPU] = {
    "rtx-a6000": GPU("RTX A6000", 48 * 10**9, 768e9),
    "rtx-4090": GPU("RTX 4090", 24 * 10**9, 1008e9),
    "a100-80gb": GPU("A100-80GB", 80 * 10**9, 2039e9),
    "h100-sxm": GPU("H100 SXM", 80 * 10**9, 3350e9),
    "h200": GPU("H200", 141 * 10**9, 4800e9),
}


def get_gpu(name: str) -> GPU:
    key = name.lower().replace(" ", "-").replace("_", "-")
    if key not in GPUS:
        raise BudgetError(f"unknown GPU {name!r}; presets: {', '.join(GPUS)} (or pass --bandwidth and --memory)")
    return GPUS[key]


def check_bits(bits: int, key: str = "bits") -> int:
    if bits not in SUPPORTED_BITS:
        raise BudgetError(f"{key}: {bits} is not a stored width: use 16 (bf16/fp16), 8 (fp8/int8), 4, 3, 2 or 1 "
                          f"(32 for a float32 cache)")
    return bits


def check_group_size(spec: ModelSpec, group_size: int | None) -> None:
    if group_size is None:
        return
    if group_size <= 0 or spec.head_dim % group_size:
        raise BudgetError(
            f"group size {group_size} does not divide {spec.name}'s head dim {spec.head_dim}: "
            f"use a divisor such as {spec.head_dim // 2} or {spec.head_dim}"
        )


def keep_problem(keep: float) -> str | None:
    """Why a keep ratio is invalid, or None: one wording for the budget math and the policies."""
    if not 0 < keep <= 1:
        return f"keep={keep} is outside (0, 1]: 0.1 keeps 10% of the prompt cache, 1.0 keeps all"
    return None


def check_keep(keep: float) -> float:
    problem = keep_problem(keep)
    if problem:
        raise BudgetError(problem)
    return keep


def check_positive(name: str, value: int) -> int:
    if value <= 0:
        raise BudgetError(f"{name} must be a positive integer, got {value}")
    return value


def context_problem(spec: ModelSpec, ctx: int, new_tokens: int = 0, key: str = "ctx",
                    new_key: str = "new_tokens") -> str | None:
    """Why ``ctx`` prompt tokens plus ``new_tokens`` do not fit the model's window, or None."""
    if ctx < 1:
        return f"{key}: {ctx} must be at least 1"
    if ctx + new_tokens > spec.max_context:
        return (f"{key}: {ctx} + {new_key} {new_tokens} is above the maximum context {spec.max_context} of "
                f"{spec.name}; lower {key} to at most {spec.max_context - new_tokens}")
    return None


def model_bits(spec: ModelSpec) -> int:
    return DTYPE_BITS.get(spec.dtype, 16)


def kv_elements_per_token(spec: ModelSpec) -> int:
    """K and V elements one token adds across all layers: L x H_kv x d_head x 2."""
    return spec.num_layers * spec.num_kv_heads * spec.head_dim * 2


def effective_bits(bits: int, group_size: int | None, scale_bits: int = 16) -> float:
    """Stored bits per element including a per-group scale and zero-point in the model dtype."""
    check_bits(bits)
    if bits >= scale_bits or not group_size:
        return float(bits)
    return bits + 2 * scale_bits / group_size


def kv_bytes_per_token(spec: ModelSpec, bits: int = 16, group_size: int | None = None) -> float:
    """Bytes of K and V per token; exact for 16-bit, including scale overhead when grouped."""
    check_group_size(spec, group_size if bits < model_bits(spec) else None)
    return kv_elements_per_token(spec) * effective_bits(bits, group_size, model_bits(spec)) / 8


def kept_prompt_tokens(ctx: int, keep: float = 1.0) -> int:
    """Prompt positions an eviction method keeps per head: floor(n x keep), at least one."""
    check_positive("ctx", ctx)
    check_keep(keep)
    return max(1, math.floor(ctx * keep))


def cache_bytes(
    spec: ModelSpec,
    ctx: int,
    batch: int = 1,
    bits: int = 16,
    group_size: int | None = 64,
    residual: int = 128,
    keep: float = 1.0,
    new_tokens: int = 0,
) -> float:
    """Cache bytes for ``batch`` sequences of ``ctx`` prompt tokens plus ``new_tokens`` generated.

    Eviction (``keep``) applies to the prompt only; generated tokens are appended uncompressed. A
    quantized cache (bits below the model's) keeps up to ``residual`` most recent tokens at full
    precision (an upper bound; transformers' QuantizedCache holds none right after prefill
    and up to residual-1 during decode) and stores the rest at ``bits`` plus group overhead.
    """
    check_positive("batch", batch)
    if new_tokens < 0:
        raise BudgetError(f"new_tokens must be >= 0, got {new_tokens}")
    tokens = kept_prompt_tokens(ctx, keep) + new_tokens
    full = kv_bytes_per_token(spec, model_bits(spec))
    if bits >= model_bits(spec):
        check_bits(bits)
        return batch * tokens * kv_bytes_per_token(spec, bits)
    if residual < 0:
        raise BudgetError(f"residual length must be >= 0, got {residual}")
    recent = min(residual, tokens)
    packed = kv_bytes_per_token(spec, bits, group_size)
    return batch * ((tokens - recent) * packed + recent * full)


def compression_ratio(spec: ModelSpec, ctx: int, **kwargs) -> float:
    """Full-precision cache bytes over compressed cache bytes at the same context."""
    full_kwargs = {k: v for k, v in kwargs.items() if k in ("batch", "new_tokens")}
    return cache_bytes(spec, ctx, bits=model_bits(spec), **full_kwargs) / cache_bytes(spec, ctx, **kwargs)


def weight_bytes(spec: ModelSpec, bits: int | None = None) -> int:
    """Weight bytes from the parameter count and the storage dtype (the model's by default)."""
    return spec.num_params * (bits or model_bits(spec)) // 8


def free_bytes_for_cache(spec: ModelSpec, memory_bytes: float, reserve_bytes: float) -> float:
    return memory_bytes - weight_bytes(spec) - reserve_bytes


def fit_problem(spec: ModelSpec, ctx: int, batch: int, memory_bytes: float,
                reserve_bytes: float = DEFAULT_RESERVE_BYTES, gpu_name: str = "the GPU",
                **cache_kwargs) -> str | None:
    """None when the weights, the reserve and this cache fit in ``memory_bytes``; else one sentence
    saying what does not fit, with the numbers (GB, decimal as GPU vendors count)."""
    weights = weight_bytes(spec)
    if weights > memory_bytes:
        return (f"does not fit: {spec.name}'s weights alone ({weights / 1e9:.1f} GB in {spec.dtype}) exceed "
                f"{gpu_name}'s {memory_bytes / 1e9:.0f} GB, at any context")
    free = free_bytes_for_cache(spec, memory_bytes, reserve_bytes)
    if free <= 0:
        return (f"does not fit: the weights ({weights / 1e9:.1f} GB) and the {reserve_bytes / 1024**3:.0f} GiB "
                f"activation reserve leave no room for a cache on {gpu_name}")
    need = cache_bytes(spec, ctx, batch=batch, **cache_kwargs)
    if need > free:
        fit = max_batch(spec, ctx, memory_bytes, reserve_bytes, **cache_kwargs)
        return (f"does not fit: the cache needs {need / 1e9:,.1f} GB at {ctx:,} tokens x batch {batch}, and "
                f"{free / 1e9:.1f} GB are free after the weights on {gpu_name} (max batch {fit} at this context)")
    return None


def max_batch(spec: ModelSpec, ctx: int, memory_bytes: float, reserve_bytes: float = DEFAULT_RESERVE_BYTES,
              **cache_kwargs) -> int:
    """Largest batch whose cache fits after the weights and the activation reserve (0: none fits)."""
    free = free_bytes_for_cache(spec, memory_bytes, reserve_bytes)
    per_seq = cache_bytes(spec, ctx, batch=1, **cache_kwargs)
    return max(0, math.floor(free / per_seq))


def max_context(spec: ModelSpec, memory_bytes: float, batch: int = 1,
                reserve_bytes: float = DEFAULT_RESERVE_BYTES, **cache_kwargs) -> int:
    """Largest prompt length whose cache fits for ``batch`` sequences (may exceed the model's window)."""
    free = free_bytes_for_cache(spec, memory_bytes, reserve_bytes)

    def fits(n: int) -> bool:
        return cache_bytes(spec, n, batch=batch, **cache_kwargs) <= free

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**40:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode step must read from memory: every weight once plus the whole cache."""

    weights: int
    kv: float

    @property
    def total(self) -> float:
        return self.weights + self.kv

    def floor_s(self, bandwidth_bytes_per_s: float) -> float:
        """Roofline time of the step: no kernel can read these bytes faster."""
        if bandwidth_bytes_per_s <= 0:
            raise BudgetError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
        return self.total / bandwidth_bytes_per_s


def bandwidth_fields(nbytes: float, kernel_ms: float, copy_ms: float | None = None,
                     copy_gbps: float | None = None, read_ms: float | None = None,
                     read_gbps: float | None = None) -> dict[str, float]:
    """A kernel's bandwidth against a read-only stream and a device-to-device copy, for benchmark rows.

    ``nbytes``: what the kernel reads in ``kernel_ms``. ``read_ms``: a read-only stream (a reduction)
    over the same ``nbytes`` timed in the same run, the honest floor of a kernel that only reads;
    ``read_gbps``: a large read-only stream's GB/s. ``copy_ms``: a copy of the same ``nbytes`` (read
    and written); ``copy_gbps``: a large copy's GB/s, read + write counted. A copy writes as much as
    it reads, so a read-only kernel's fraction of it flatters the kernel; both are kept side by side.
    ``kernel_GBps``: bytes read per second. ``of_read_same_bytes``: it over the stream's GB/s (1.0:
    the kernel reads as fast as a reduction); ``x_read_floor``: the kernel's time over the stream's.
    ``copy_same_bytes_GBps``: the copy's read + write per second; ``of_copy_same_bytes``: the kernel's
    GB/s over it. ``floor_ms``: the bytes read at copy bandwidth (half the copy); ``x_floor``: the
    kernel's time over it. ``of_read_bw`` / ``of_copy_bw``: ``kernel_GBps`` over the large figures."""
    out = {"kernel_GBps": nbytes / (kernel_ms * 1e-3) / 1e9}
    if read_ms:
        stream = nbytes / (read_ms * 1e-3) / 1e9
        out.update(read_same_bytes_ms=read_ms, read_same_bytes_GBps=stream,
                   of_read_same_bytes=out["kernel_GBps"] / stream, x_read_floor=kernel_ms / read_ms)
    if read_gbps:
        out["of_read_bw"] = out["kernel_GBps"] / read_gbps
    if copy_ms:
        same = 2 * nbytes / (copy_ms * 1e-3) / 1e9
        out.update(copy_same_bytes_ms=copy_ms, copy_same_bytes_GBps=same, of_copy_same_bytes=out["kernel_GBps"] / same,
                   floor_ms=copy_ms / 2, x_floor=kernel_ms / (copy_ms / 2))
    if copy_gbps:
        out["of_copy_bw"] = out["kernel_GBps"] / copy_gbps
    return out


def decode_bytes(spec: ModelSpec, ctx: int, batch: int = 1, **cache_kwargs) -> DecodeBytes:
    return DecodeBytes(weight_bytes(spec), cache_bytes(spec, ctx, batch=batch, **cache_kwargs))


def budget_report(spec: ModelSpec, ctx: int, batch: int = 1, *, gpu: GPU | None = None,
                  bandwidth_bytes_per_s: float | None = None, memory_bytes: float | None = None,
                  reserve_bytes: float = DEFAULT_RESERVE_BYTES, **cache_kwargs) -> dict:
    """Everything ``kvlab budget`` prints, as one JSON-safe dict. ``cache_kwargs`` are those of
    :func:`cache_bytes` (``bits``, ``group_size``, ``residual``, ``keep``, ``new_tokens``), with its
    defaults. A context above the model's window, or a zero or negative bandwidth, memory or reserve,
    is a :class:`BudgetError`, not a number."""
    setting = inspect.signature(cache_bytes).bind(spec, ctx, batch, **cache_kwargs)
    setting.apply_defaults()
    bits, group_size, residual, keep, new_tokens = (
        setting.arguments[k] for k in ("bits", "group_size", "residual", "keep", "new_tokens"))
    check_bits(bits)
    problem = context_problem(spec, ctx, new_tokens)
    if problem:
        raise BudgetError(problem)
    for name, value in (("bandwidth", bandwidth_bytes_per_s), ("memory", memory_bytes)):
        if value is not None and not value > 0:
            raise BudgetError(f"{name} must be positive, got {value:g}")
    if not reserve_bytes >= 0:
        raise BudgetError(f"reserve must be >= 0, got {reserve_bytes:g}")
    if bits >= model_bits(spec):
        group_size, residual = None, 0
    kw = dict(bits=bits, group_size=group_size, residual=residual, keep=keep, new_tokens=new_tokens)
    bandwidth = bandwidth_bytes_per_s if bandwidth_bytes_per_s is not None else (
        gpu.bandwidth_bytes_per_s if gpu else None)
    memory = memory_bytes if memory_bytes is not None else (gpu.memory_bytes if gpu else None)
    step = decode_bytes(spec, ctx, batch, **kw)
    full_step = decode_bytes(spec, ctx, batch, bits=model_bits(spec))
    out = {
        "model": spec.name,
        "dtype": spec.dtype,
        "ctx": ctx,
        "batch": batch,
        "bits": bits,
        "group_size": group_size,
        "residual": residual,
        "keep": keep,
        "new_tokens": new_tokens,
        "bytes_per_token": kv_bytes_per_token(spec, model_bits(spec)) if bits >= model_bits(spec)
        else kv_bytes_per_token(spec, bits, group_size),
        "cache_bytes": cache_bytes(spec, ctx, batch, **kw),
        "cache_bytes_full": cache_bytes(spec, ctx, batch, bits=model_bits(spec), new_tokens=new_tokens),
        "compression_ratio": compression_ratio(spec, ctx, batch=batch, **kw),
        "weights_bytes": weight_bytes(spec),
        "decode_bytes_per_step": step.total,
        "decode_kv_bytes_per_step": step.kv,
        "decode_bytes_saved_fraction": 1 - step.total / full_step.total,
        "gpu": gpu.name if gpu else None,
    }
    for key in ("bytes_per_token", "cache_bytes", "cache_bytes_full", "decode_bytes_per_step",
                "decode_kv_bytes_per_step"):
        if float(out[key]).is_integer():
            out[key] = int(out[key])
    if bandwidth:
        out["bandwidth_bytes_per_s"] = bandwidth
        out["decode_floor_ms"] = step.floor_s(bandwidth) * 1e3
    if memory:
        out["memory_bytes"] = memory
        out["reserve_bytes"] = reserve_bytes
        out["max_batch"] = max_batch(spec, ctx, memory, reserve_bytes, **kw)
        out["max_context"] = max_context(spec, memory, batch, reserve_bytes, **kw)
        out["fits"] = out["max_batch"] >= batch
    return out
