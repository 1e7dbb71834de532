"""The numbers of README.md that are derived from the records rather than read off the report:
peak memory per sequence and capacity, the batch-1 step-time floor, average decode power.

    python reports/h200-2026-12-02/derived.py
"""
from pathlib import Path

import numpy as np
from kvlab.records import load_records
df = load_records(Path(__file__).parent)
perf = df[(df.kind == "perf") & (df.ctx == 16384)]
# peak memory vs batch: GB = intercept + slope * batch (least squares over the batch means)
for label, g in perf.groupby("label"):
    peak = g.groupby("batch")["peak_mem_bytes"].mean() / 1e9
    if len(peak) > 1:
        slope, icpt = np.polyfit(peak.index, peak.values, 1)
        print(f"{label}: {icpt:.1f} GB + {slope:.2f} GB/seq -> {(150.1 - icpt) / slope:.0f} seqs in 150.1 GB")
# batch-1 step-time floor (10th percentile of each run's steps) and average decode power
b1 = perf[perf.batch == 1]
print(b1.assign(p10=b1.itl_ms.map(lambda x: np.percentile(x, 10))).groupby("label")["p10"].agg(["min", "max"]).round(1))
print((perf.decode_j / perf.decode_s).groupby([perf.label, perf.batch]).mean().round(0))
