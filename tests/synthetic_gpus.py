"""A FAKE multi-GPU sweep for attribution tests: generated numbers, not measurements.

Each GPU runs its groups one after another on a known power trace: every gap (model load, idle
baseline, between runs) at ``idle_w``, every window at ``window_w``. Its counter starts at its own
base, so counter readings tell the GPUs apart as real ones do, and the counters files, records and
warm-ups agree with the trace exactly: the counter total is windows + idle x gaps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

T0 = 1_796_278_594.0  # 2026-12-03, a plausible epoch
UUIDS = ("GPU-aaaa-0000", "GPU-bbbb-1111")
METHODS = {"full": "full", "snapkv": "snapkv 10%"}


@dataclass
class FakeGpu:
    """One GPU's trace as it is generated: its clock, its counter and the records on it."""

    uuid: str
    index: int
    base_j: float
    now: float = T0
    counter_j: float = 0.0
    records: list[dict] = field(default_factory=list)
    warmups: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.counter_j = self.base_j

    def gap(self, seconds: float, watts: float) -> None:
        self.now += seconds
        self.counter_j += seconds * watts

    def window(self, seconds: float, watts: float, rec: dict) -> dict:
        rec = dict(rec, gpu_uuid=self.uuid, window_s=seconds, energy_j=seconds * watts,
                   window_start_unix=self.now, energy_counter_start_j=self.counter_j)
        self.now += seconds
        self.counter_j += seconds * watts
        return rec

    def reading(self) -> dict:
        return {"index": self.index, "uuid": self.uuid, "name": "FAKE H200", "energy_j": self.counter_j}


def run_record(method: str, ctx: int, repeat: int, kind: str, idle_w: float, window_s: float) -> dict:
    """The identity and headline numbers of one run (ms/step scales with the window)."""
    tokens = 128
    return {"run_id": f"fake-{method}-{ctx}-{kind}-{repeat}", "kind": kind, "status": "ok", "method": method,
            "label": METHODS[method], "model": "llama-3.1-8b", "ctx": ctx, "batch": 1, "repeat": repeat,
            "created_at": "2026-12-03T06:00:00+00:00", "idle_w": idle_w, "new_tokens": tokens,
            "itl_mean_ms": 1000 * window_s / tokens, "ttft_s": ctx / 40_000,
            "energy_source": "nvml-counter", "gpu_name": "FAKE H200 (test data)"}


def fake_sweep(groups: dict[str, list[int]], *, repeats: int = 3, idle_w: float = 100.0, window_w: float = 300.0,
               load_s: float = 14.0, gap_s: float = 0.3, tail_s: float = 5.0, gpu_scale: dict[str, float] | None = None,
               jitter: float = 0.02) -> tuple[list[FakeGpu], dict, dict]:
    """GPUs (by UUID) running their listed ctx groups; returns them and the start and end counters.

    ``gpu_scale`` makes a GPU's windows longer (a slower GPU); ``jitter`` varies windows across repeats.
    """
    gpus = [FakeGpu(u, i, base_j=1.0e6 * (i + 1)) for i, u in enumerate(groups)]
    start = {"read_at_unix": T0, "host": "fake", "gpus": [g.reading() for g in gpus]}
    for gpu in gpus:
        scale = (gpu_scale or {}).get(gpu.uuid, 1.0)
        for ctx in groups[gpu.uuid]:
            gpu.gap(load_s, idle_w)  # worker start, imports, load, idle baseline
            base_s = 3.5 + ctx / 16_384
            for method in METHODS:  # one warm-up per variant, twice a run
                rec = run_record(method, ctx, 0, "warmup", idle_w, 2 * base_s * scale)
                gpu.warmups.append(gpu.window(2 * base_s * scale, window_w, rec))
                gpu.gap(gap_s, idle_w)
            for r in range(repeats):
                for k, method in enumerate(METHODS):
                    seconds = base_s * scale * (1 + jitter * (r - (repeats - 1) / 2) + 0.01 * k)
                    rec = gpu.window(seconds, window_w, run_record(method, ctx, r, "perf", idle_w, seconds))
                    rec["j_per_token"] = rec["energy_j"] / rec["new_tokens"]
                    gpu.records.append(rec)
                    gpu.gap(gap_s, idle_w)
    end_at = max(g.now for g in gpus) + tail_s
    for gpu in gpus:
        gpu.gap(end_at - gpu.now, idle_w)  # waiting for the others, then shutdown
    end = {"read_at_unix": end_at, "host": "fake", "gpus": [g.reading() for g in gpus]}
    return gpus, start, end


def write_sweep_folder(folder: Path, gpus: list[FakeGpu], executor: str = "ray") -> None:
    """records.jsonl, warmup.jsonl and a manifest naming each GPU's worker."""
    folder.mkdir(parents=True, exist_ok=True)
    recs = sorted((r for g in gpus for r in g.records), key=lambda r: r["window_start_unix"])
    warm = sorted((r for g in gpus for r in g.warmups), key=lambda r: r["window_start_unix"])
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (folder / "warmup.jsonl").write_text("".join(json.dumps(r) + "\n" for r in warm))
    workers = [{"host": "fake", "pid": 100 + g.index, "gpu_uuid": g.uuid, "cuda_visible_devices": str(g.index),
                "energy_source": "nvml-counter"} for g in gpus]
    manifest = {"sweep": "fake", "status": "complete", "invocations": [
        {"executor": executor, "started_at": "2026-12-03T06:00:00+00:00", "finished_at": "2026-12-03T06:05:00+00:00",
         "workers": workers}]}
    (folder / "manifest.json").write_text(json.dumps(manifest))
