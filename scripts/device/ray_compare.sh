#!/usr/bin/env bash
# Issue #17 on the H200: params/ray-compare.yaml through `--executor local`, then `--executor ray`
# (a local Ray cluster started by kvlab on the one GPU), into outputs/ray-compare/{local,ray};
# prints both wall times, ray's overhead (without and with starting Ray's cluster) and, per configuration, ms/step, J/token and TTFT with
# their CIs side by side (python -m kvlab.analysis.executors), and packs the folder into
# $OUT/ray-compare.tgz. One device call, about 5 minutes:
#
#   bash scripts/device/ray_compare.sh [--set KEY=VALUE ...]     # carry [".whl", ".whl-tf", ".whl-ray"]
#
# .whl-ray is built here by `bash scripts/device/build-carry.sh ray` (ray 2.60's cp312 wheel
# pruned, 15.3 MB; the wheel itself, 79 MB, is over one call's 64 MiB). The three folders and the
# working tree come to about 65 MB of the 67.1 MB (64 MiB) a call carries; full, streamingllm and
# snapkv also run on the machine's transformers 5.17, so without .whl-tf (13.5 MB) it still works.
# Both sweeps get one time_budget_s, about half the time left before KVLAB_DEADLINE_S (default
# 410 s from the start), so a slow machine stops both cleanly at the same point and the comparison
# covers what both measured (expected: both complete, about 2 minutes each).
# A rerun on a warm machine starts afresh (the folders are moved aside to outputs/ray-compare.N).
set -uo pipefail
start=$SECONDS
deadline=${KVLAB_DEADLINE_S:-410}
. scripts/device/setup.sh || exit 1
. scripts/device/setup-ray.sh || exit 1
say() { echo "== [$(( SECONDS - start ))s] $*"; }
out=outputs/ray-compare
mkdir -p "${OUT:-/tmp/out}"
fresh_dir "$out"
# one import of everything both executors load, so that neither pays Python's first compile of
# the carried packages (installed with --no-compile) and a missing piece fails here, in seconds
python3 - <<'PY' || exit 1
import time
t = time.perf_counter()
import kvlab, ray, torch, transformers, kvlab.sweep.driver, kvlab.runner.ray_cluster  # noqa: F401,E401
from ray._private.accelerators import NvidiaGPUAcceleratorManager as gpus
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"kvlab from {kvlab.__file__}, ray {ray.__version__} from {ray.__file__}, torch {torch.__version__}, transformers {transformers.__version__},"
      f" {gpu}; Ray sees {gpus.get_current_node_num_accelerators()} GPU(s);"
      f" imports {time.perf_counter() - t:.1f} s")
PY
# one budget for both sweeps, so that a cut-short pair is cut at the same point; 60 s are kept for
# what no budget counts (two Python starts, Ray's shutdown, the comparison, the pack)
budget=$(( (deadline - (SECONDS - start) - 60) / 2 ))
sweep() {  # EXECUTOR [--set ...]: one timed sweep, its wall time appended to walls.jsonl
  local ex=$1 t0 t1 rc
  shift
  say "kvlab sweep --executor $ex (time_budget_s=$budget); GPU: $(nvidia-smi --query-gpu=temperature.gpu,power.draw,clocks.sm --format=csv,noheader 2>/dev/null)"
  t0=$(date +%s.%N)
  python3 -m kvlab sweep params/ray-compare.yaml -o "$out/$ex" --executor "$ex" --no-progress \
    --set time_budget_s="$budget" "$@" 2>&1 | grep --line-buffered -v -E "Token authentication is enabled|profiler.py|_warn_once"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s.%N)
  printf '{"executor": "%s", "start": %s, "end": %s, "rc": %s}\n' "$ex" "$t0" "$t1" "$rc" >> "$out/walls.jsonl"
  say "$ex: exit $rc, $(python3 -c "print(round($t1 - $t0, 1))") s"
  return "$rc"
}
sweep local "$@"
# Ray's cluster is started first, timed on its own (a "ray-cluster" line in walls.jsonl), and the
# sweep joins it (--ray-address auto), as a user's sweep joins a running cluster; the comparison
# gives ray's overhead both without and with that start.
cluster() {
  local t0 t1 rc
  t0=$(date +%s.%N)
  python3 -m ray.scripts.scripts start --head --include-dashboard=false --disable-usage-stats > "$out/ray-start.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  printf '{"executor": "ray-cluster", "start": %s, "end": %s, "rc": %s}\n' "$t0" "$t1" "$rc" >> "$out/walls.jsonl"
  say "ray start --head: exit $rc, $(python3 -c "print(round($t1 - $t0, 1))") s"
  return "$rc"
}
if cluster; then
  sweep ray --set ray_address=auto "$@"
else
  tail -5 "$out/ray-start.log"; sweep ray "$@"  # no running cluster: the sweep starts its own
fi
rc=$?
# Ray's raylet gives up when its dashboard agent (a Python process) has not written its port within
# 15 s, which a loaded machine can miss; the sweep then ends before any run with exit 1. Once more
# (the comparison takes the last attempt's wall time; this one's logs come back in ray-logs.tgz).
if [ "$rc" != 0 ] && [ "$rc" != 3 ] && [ "$rc" != 4 ] && [ ! -s "$out/ray/records.jsonl" ]; then
  tar czhf "${OUT:-/tmp/out}/ray-logs-failed-start.tgz" -C /tmp/ray session_latest/logs 2>/dev/null
  python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
  left=$(( deadline - (SECONDS - start) - 50 ))
  if [ "$left" -gt 60 ]; then
    [ "$left" -lt "$budget" ] && budget=$left
    say "ray: the sweep ended before any run (exit $rc): once more"
    sweep ray "$@"
  fi
fi
tar czhf "${OUT:-/tmp/out}/ray-logs.tgz" -C /tmp/ray session_latest/logs 2>/dev/null
python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true  # nothing of Ray outlives the call
python3 -m kvlab.analysis.executors "$out" | tee "$out/compare.txt"
tar czf "${OUT:-/tmp/out}/ray-compare.tgz" "$out" && say "packed $out into ${OUT:-/tmp/out}/ray-compare.tgz"
