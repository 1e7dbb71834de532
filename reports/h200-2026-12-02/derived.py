"""The numbers of README.md that are derived from the records rather than read off the report:
peak memory per sequence and capacity, the batch-1 step-time floor, average decode power, the host
counters of fast and slow batch-1 runs, and the warm-up probe's decode kernel time.

    python reports/h200-2026-12-02/derived.py
"""
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.records import load_records

CARD_GB = 150.1  # torch: "total capacity of 139.80 GiB" (h200-batch/errors.log)
pd.set_option("display.width", 200)
pd.set_option("display.max_columns", 20)
df = load_records(Path(__file__).parent)
perf = df[df.kind == "perf"].astype({"ctx": "int64", "batch": "int64"})
ok = perf[perf.status == "ok"]
k16 = ok[ok.ctx == 16384]

print("== peak memory vs batch at 16k: GB = intercept + slope * batch")
for label, g in k16.groupby("label"):
    peak = g.groupby("batch")["peak_mem_bytes"].mean() / 1e9
    if len(peak) < 2:
        continue
    slope, icpt = np.polyfit(peak.index, peak.values, 1)
    line = f"{label}: {icpt:.1f} GB + {slope:.2f} GB/seq (batches {list(peak.index)}) -> {(CARD_GB - icpt) / slope:.0f} seqs in {CARD_GB} GB"
    fit = peak[peak.index < 32]
    if 32 in peak.index and len(fit) > 1:  # the batch-32 peak against a fit that did not see it
        s, i = np.polyfit(fit.index, fit.values, 1)
        line += f"; batches {list(fit.index)} predict {i + 32 * s:.1f} GB at 32, measured {peak[32]:.1f}"
    print(line)
failed = perf[(perf.status != "ok") & (perf.ctx == 16384)]
for (method, batch, error), g in failed.groupby(["method", "batch", "error"]):
    print(f"failed ({len(g)} runs): {method} batch {batch}: {error}")

print("\n== decode throughput at 16k (tokens/s over the whole batch, mean of runs)")
print(k16.pivot_table(index="label", columns="batch", values="tokens_per_s", aggfunc="mean").round(0))

print("\n== batch 1: the fast-regime floor (10th percentile of a run's steps, ms), min and max over runs")
b1 = ok[ok.batch == 1]
floor = b1.assign(p10=b1.itl_ms.map(lambda x: np.percentile(x, 10)))
print(floor.groupby(["label", "ctx"])["p10"].agg(["min", "max"]).round(1))

print("\n== average GPU power over decode (W)")
print((ok.decode_j / ok.decode_s).groupby([ok.label, ok.ctx, ok.batch]).mean().round(0).unstack("batch"))

print("\n== host counters over decode, batch-1 runs that carry them (fast: median step < 1.25 x the"
      " fastest median of its method and context; slow: the rest)")
host = b1.dropna(subset=["decode_host_steal_ms"]).copy()
best = host.groupby(["label", "ctx"])["itl_median_ms"].transform("min")
host["regime"] = np.where(host.itl_median_ms < 1.25 * best, "fast", "slow")
host["steal_share"] = host.decode_host_steal_ms / (host.decode_s * 1000)
print(host.groupby("regime").agg(runs=("run_id", "size"), median_step_ms=("itl_median_ms", "median"),
                                 steal_share_max=("steal_share", "max"),
                                 process_cpu_share=("decode_host_process_cpu_share", "mean"),
                                 involuntary_switches=("decode_host_nonvoluntary_switches", "mean")).round(3))

print("\n== decode kernel time from the warm-up probe (ms per step, first 4 decode steps of the cold"
      " warm-up), code from 2026-12-02 session 3 on (records with host counters), vs median step")
probe = ok.dropna(subset=["decode_host_steal_ms", "decode_kernel_ms"])
print(probe.groupby(["label", "ctx", "batch"]).agg(kernel_ms=("decode_kernel_ms", "first"),
                                                   median_step_ms=("itl_median_ms", "median")).round(1))
