#!/usr/bin/env bash
# Issue #18 on nvidia-h200-x2, one device call (about 8 minutes on a fresh machine):
#
#   bash scripts/device/ray_multigpu.sh [--set KEY=VALUE ...]   # kind nvidia-h200-x2; carry [".whl", ".whl-tf", ".whl-ray"]
#
# params/h200x2-ray.yaml through `--executor ray` twice: on a Ray cluster of both GPUs, then on a
# cluster of GPU 0 alone (CUDA_VISIBLE_DEVICES=0). Each cluster is started with `ray start --head`
# before its sweep, as a cluster is used (README, Ray section), so the two sweeps' wall times
# compare the sweeps; the start is timed apart. Each task asks for the same CPUs in both (the
# one-GPU cluster gets half the cores), so torch gets as many threads alone as beside the other
# task. scripts/device/counters.py reads every GPU's NVML energy counter once with 5 s of idle
# (before anything runs) and before and after each sweep. Then python -m kvlab.analysis.multigpu
# prints the wall ratio (target <= 0.55), the GPU of every record, the per-GPU energy attribution
# (counter = windows + idle x gaps, within 2%) and each configuration on the two GPUs, into
# outputs/ray-multigpu/multigpu.txt, and the folder (both sweeps, walls.jsonl, counters/) is packed
# into $OUT/ray-multigpu.tgz with Ray's logs.
#
# Both sweeps get time budgets from KVLAB_DEADLINE_S (default 580 s from the start): the two-GPU
# sweep about a third of what is left (expected about 130 s), the one-GPU sweep the rest (expected
# about 250 s); a sweep cut short says so (exit 4) and the report says the walls compare unequal work.
# A rerun on a warm machine starts afresh (the folder is moved aside to outputs/ray-multigpu.N).
set -uo pipefail
start=$SECONDS
deadline=${KVLAB_DEADLINE_S:-580}
. scripts/device/setup.sh || exit 1
. scripts/device/setup-ray.sh || exit 1
say() { echo "== [$(( SECONDS - start ))s] $*"; }
ray_cli() { python3 -m ray.scripts.scripts "$@"; }
params=params/h200x2-ray.yaml
out=outputs/ray-multigpu
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
fresh_dir "$out" && mkdir -p "$out/counters"
# one import of everything the sweeps load (the carried packages are installed without .pyc, so
# neither sweep pays the first compile), and two GPUs or nothing
python3 - <<'PY' || exit 1
import sys, time
t = time.perf_counter()
import kvlab, ray, torch, transformers, pynvml, kvlab.sweep.driver, kvlab.runner.ray_cluster, kvlab.analysis.multigpu  # noqa: F401,E401
n = torch.cuda.device_count()
names = [torch.cuda.get_device_name(i) for i in range(n)]
print(f"kvlab from {kvlab.__file__}, ray {ray.__version__}, torch {torch.__version__}, transformers "
      f"{transformers.__version__}, {n} GPU(s) {names}; imports {time.perf_counter() - t:.1f} s")
if n < 2:
    sys.exit("ray_multigpu.sh: issue #18 needs two GPUs (kind nvidia-h200-x2)")
PY
ray_cli stop --force >/dev/null 2>&1
python3 scripts/device/counters.py --idle-s 5 -o "$out/counters/idle.json" || exit 1
cpus=$(nproc)

cluster() {  # NAME GPUS CPUS: a fresh head node (once more if it fails to start); seconds in $cluster_s
  local name=$1 t0 t1 attempt
  ray_cli stop --force >/dev/null 2>&1
  t0=$(date +%s.%N)
  for attempt in 1 2; do
    # Ray's raylet gives up when its dashboard agent has not written its port within 15 s, which a
    # loaded machine can miss (ray_compare.sh): stop and start once more
    if ray_cli start --head --num-gpus="$2" --num-cpus="$3" --include-dashboard=false \
         --disable-usage-stats >"$out/ray-start-$name.log" 2>&1; then
      break
    fi
    say "ray start ($name) failed (attempt $attempt): $(tail -n 3 "$out/ray-start-$name.log" | tr '\n' ' ')"
    ray_cli stop --force >/dev/null 2>&1
    [ "$attempt" = 2 ] && return 1
  done
  t1=$(date +%s.%N)
  cluster_s=$(python3 -c "print(round($t1 - $t0, 2))")
  say "Ray cluster $name: $2 GPU(s), $3 CPUs, started in $cluster_s s"
}

sweep() {  # NAME GPUS BUDGET [--set ...]: counters, one timed sweep, counters; its wall in walls.jsonl
  local name=$1 gpus=$2 budget=$3 t0 t1 rc
  shift 3
  python3 scripts/device/counters.py -o "$out/counters/$name-start.json"
  say "kvlab sweep $name ($gpus GPU(s), time_budget_s=$budget); GPUs: $(nvidia-smi --query-gpu=index,temperature.gpu,power.draw --format=csv,noheader 2>/dev/null | tr '\n' ';')"
  t0=$(date +%s.%N)
  python3 -m kvlab sweep "$params" -o "$out/$name" --executor ray --ray-address auto --no-progress \
    --set time_budget_s="$budget" "$@" 2>&1 | grep --line-buffered -v -E "Token authentication is enabled|profiler.py|_warn_once"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s.%N)
  python3 scripts/device/counters.py -o "$out/counters/$name-end.json"
  printf '{"sweep": "%s", "gpus": %s, "start": %s, "end": %s, "rc": %s, "cluster_start_s": %s}\n' \
    "$name" "$gpus" "$t0" "$t1" "$rc" "$cluster_s" >> "$out/walls.jsonl"
  say "$name: exit $rc, $(python3 -c "print(round($t1 - $t0, 1))") s"
}

left() { echo $(( deadline - (SECONDS - start) - 45 )); }  # 45 s for the stops, the report and the pack
cluster gpu2 2 "$cpus" || exit 1
sweep gpu2 2 $(( $(left) * 36 / 100 )) "$@"
export CUDA_VISIBLE_DEVICES=0  # the cluster, its workers and the driver see GPU 0 alone
cluster gpu1 1 $(( cpus / 2 )) || exit 1
sweep gpu1 1 "$(left)" "$@"
unset CUDA_VISIBLE_DEVICES
ray_cli stop --force >/dev/null 2>&1 || true  # nothing of Ray outlives the call
# shellcheck disable=SC2046  # one word per session folder
tar czhf "$OUT/ray-logs.tgz" -C /tmp/ray $(cd /tmp/ray && ls -d session_2*/logs 2>/dev/null) 2>/dev/null
python3 -m kvlab.analysis.multigpu "$out" | tee "$out/multigpu.txt"
tar czf "$OUT/ray-multigpu.tgz" "$out" && say "packed $out into $OUT/ray-multigpu.tgz"
