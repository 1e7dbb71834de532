"""FAKE sweep records for report and plot tests: generated numbers, not measurements.

The shapes are plausible (a quantized cache uses less memory and more J/token; per-token latency
spikes every ``residual`` steps), so figures have something to draw, and a few numbers are exact
(the quantized method's J/token is 1.35x the full cache's) so tests can check summaries. Every
record says ``gpu_name: FAKE-GPU (test data)`` and ``weights: synthetic``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

FAKE_GPU = "FAKE-GPU (test data)"
# method -> (label, keep, bits, memory factor vs full, J/token factor vs full, ITL factor)
METHODS = {
    "full": ("full", None, None, 1.0, 1.0, 1.0),
    "quanto": ("quanto int4", None, 4, 0.35, 1.35, 1.4),
    "streamingllm": ("streamingllm keep 0.5", 0.5, None, 0.6, 0.97, 0.95),
}
QUALITY_KEEPS = (0.1, 0.25, 0.5, 1.0)


def fake_perf_records(ctxs=(1024, 4096, 16384), repeats=3, new_tokens=48, residual=16, energy=True,
                      seed=0, cpu=False) -> list[dict]:
    """``cpu``: runs of a shared CPU VM instead (no energy; host counters, as kvlab.measure records
    them: CPU time that follows the method's ITL factor, 30% of a CPU stolen, the first two repeats
    contended)."""
    rng = np.random.default_rng(seed)
    rows = []
    for method, (label, keep, bits, mem_f, j_f, itl_f) in METHODS.items():
        for ctx in ctxs:
            for r in range(repeats):
                base_itl = 20.0 + ctx / 1024.0
                itl = base_itl * itl_f * (1 + 0.02 * rng.standard_normal(new_tokens))
                if method == "quanto":  # the residual buffer flushes every `residual` steps
                    itl[residual - 1::residual] *= 3.0
                # exact means per group: J/token noise is +-delta symmetric around the mean
                j = 0.5 * (1 + ctx / 16384) * j_f * (1 + 0.02 * (r - (repeats - 1) / 2))
                cache = 131072 * ctx * mem_f
                rec = dict(
                    run_id=f"fake-{method}-{ctx}-{r}", sweep="fake", kind="perf", created_at="2026-01-01T00:00:00",
                    status="ok", error=None, model="llama-3.1-8b", weights="synthetic", device="cuda",
                    gpu_name=FAKE_GPU, dtype="bfloat16", attn_implementation="sdpa", sdpa_backend="auto",
                    method=method, label=label, policy_params={"keep": keep} if keep else {"nbits": bits} if bits else {},
                    keep=keep, bits=bits, ctx=ctx, batch=1, new_tokens=new_tokens, prompt_id=0, repeat=r, seed=0,
                    ttft_s=0.001 * ctx / 100, prefill_s=0.001 * ctx / 100, decode_s=float(itl.sum() / 1e3),
                    itl_ms=[float(x) for x in itl], itl_mean_ms=float(itl.mean()),
                    itl_median_ms=float(np.median(itl)), itl_p90_ms=float(np.quantile(itl, 0.9)),
                    itl_max_ms=float(itl.max()), gpu_busy_ms=float(itl.sum() * 0.8),
                    tokens_per_s=float(1e3 / itl.mean()), peak_mem_bytes=16.1e9 + cache,
                    peak_mem_nvml_bytes=16.6e9 + cache, cache_bytes=cache, cache_logical_tokens=ctx,
                    cache_physical_tokens=int(ctx * (keep or 1)), energy_source="counter" if energy else "none: no NVML counter (fake)",
                    energy_j=j * new_tokens if energy else None, prefill_j=None, decode_j=j * new_tokens if energy else None,
                    idle_w=None, net_energy_j=None, j_per_token=j if energy else None, net_j_per_token=None,
                    energy_10hz_j=j * new_tokens * (1 + 0.05 * rng.standard_normal()) if energy else None,
                    j_per_token_10hz=None,
                )
                if cpu:
                    rec.update(device="cpu", gpu_name=None, energy_source="none: device 'cpu' has no NVML energy counter",
                               energy_j=None, decode_j=None, j_per_token=None, energy_10hz_j=None,
                               decode_host_process_cpu_ms=float(itl.sum()) * (1 + 0.01 * r),
                               prefill_host_process_cpu_ms=ctx / 10.0, decode_host_steal_ms=float(itl.sum()) * 0.3,
                               contended=r < 2, peak_mem_source="process peak RSS (VmHWM)")
                rows.append(rec)
    rows.append(dict(rows[-1], run_id="fake-failed", status="failed", error="CUDA out of memory (fake)",
                     ctx=131072, itl_ms=None, j_per_token=None))
    return rows


def fake_quality_records(seed=0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for method in ("full", "streamingllm"):
        keeps = (1.0,) if method == "full" else QUALITY_KEEPS
        for keep in keeps:
            for s in range(4):
                rows.append(dict(run_id=f"fakeq-{method}-{keep}-{s}", sweep="fake", kind="quality", status="ok",
                                 model="smollm2-135m", weights="real", method=method,
                                 label=method if method == "full" else f"{method} keep {keep}",
                                 keep=None if method == "full" else keep, ctx=1024, task="needle", length=1024,
                                 depth=0.5, sample=s, score=float(min(1.0, keep + 0.1 * rng.random()))))
    return rows


def fake_records(energy=True, quality=True) -> pd.DataFrame:
    rows = fake_perf_records(energy=energy) + (fake_quality_records() if quality else [])
    return pd.DataFrame(rows)


FAKE_MANIFEST = {
    "note": "FAKE test data, not a measurement",
    "params": {"models": ["llama-3.1-8b"], "methods": list(METHODS)},
    "env_start": {"git_sha": "0" * 40, "git_dirty": False, "python": "3.11.0",
                  "packages": {"torch": "2.11.0", "transformers": "5.17.0", "kvlab": "0.1.0"},
                  "gpu": {"gpu_name": FAKE_GPU, "driver": "000.00.00"}},
}


def write_fake_sweep(folder: str | Path, energy=True, quality=True, cpu=False) -> Path:
    """A sweep folder in the real on-disk format (kvlab.records writer), holding fake numbers."""
    from kvlab.records import RecordWriter, write_manifest

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with RecordWriter(folder / "records.jsonl") as w:
        for rec in fake_perf_records(energy=energy, cpu=cpu) + (fake_quality_records() if quality else []):
            w.append(rec)
    write_manifest(folder, FAKE_MANIFEST)
    return folder
