#!/usr/bin/env bash
# Issue #17 on the H200: params/ray-compare.yaml through `--executor local`, then `--executor ray`
# (a local Ray cluster on the one GPU), into outputs/ray-compare/{local,ray}; prints the wall times
# and per-configuration means with 95% CIs, and packs the folders into $OUT/ray-compare.tgz.
#
# Carry [".whl"] holding the usual wheels plus ray-site.tar.xz: ray 2.60.0's cp312 wheel unpacked,
# minus jars/rllib/data/tune/train/serve/llm, as tar.xz (30 MB: the wheel, 79 MB, is over one
# call's 64 MiB). The machine has ray's other needs (grpcio, msgpack, protobuf, aiohttp, ...).
set -uo pipefail
. scripts/device/setup.sh || exit 1
if [ ! -d /tmp/raysite/ray ]; then
  mkdir -p /tmp/raysite && tar xJf .whl/ray-site.tar.xz -C /tmp/raysite || exit 1
fi
export PYTHONPATH=/tmp/raysite:$PYTHONPATH RAY_USAGE_STATS_ENABLED=0
python3 -c 'import ray, torch; print("ray", ray.__version__, "torch", torch.__version__, torch.cuda.get_device_name())' || exit 1
out=outputs/ray-compare
mkdir -p "$out" "${OUT:-/tmp/out}"
for ex in local ray; do
  t0=$(date +%s.%N)
  python3 -m kvlab sweep params/ray-compare.yaml -o "$out/$ex" --executor "$ex" --no-progress "$@"
  rc=$?
  echo "rc=$rc executor=$ex wall_s=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")" | tee -a "$out/wall.txt"
done
python3 - "$out" <<'PY'
import json, math, statistics, sys
from pathlib import Path
from kvlab.records import load_records, read_manifest
out = Path(sys.argv[1])
print((out / "wall.txt").read_text())
cols = ["ttft_s", "decode_s", "tokens_per_s", "j_per_token", "energy_j"]
frames = {ex: load_records(out / ex) for ex in ("local", "ray")}
def ci(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if len(xs) < 2:
        return f"{xs[0]:.4g}" if xs else "-"
    m, s = statistics.mean(xs), statistics.stdev(xs)
    t = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78}.get(len(xs), 2.0)
    return f"{m:.4g} ±{t * s / math.sqrt(len(xs)):.2g}"
for col in cols:
    print(f"\n{col}: mean ±95% CI half-width (n=3 repeats) local | ray")
    for (method, ctx), g in frames["local"].groupby(["method", "ctx"]):
        r = frames["ray"][(frames["ray"].method == method) & (frames["ray"].ctx == ctx)]
        print(f"  {method:13s} {ctx:6d}  {ci(list(g[col])):>22s} | {ci(list(r[col])):>22s}")
for ex in ("local", "ray"):
    inv = read_manifest(out / ex)["invocations"][-1]
    print(ex, inv["started_at"], inv["finished_at"], "ok", inv["ok"], "failed", inv["failed"])
    for w in inv.get("workers", []):
        print("  worker", json.dumps(w))
PY
tar czf "${OUT:-/tmp/out}/ray-compare.tgz" "$out"
