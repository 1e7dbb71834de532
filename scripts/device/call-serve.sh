#!/usr/bin/env bash
# The serving sweeps on a lent GPU, as parts picked by PARTS (LIMIT_<part> overrides each limit), all
# under outputs/serve, packed into $OUT/serve.tgz after every part.
#   smoke     params/serve-cpu.yaml's trace on the GPU (SmolLM2, one rate): the engine runs there
#   sharegpt  params/h100-serve-sharegpt.yaml (Llama-3.1-8B shape, ShareGPT lengths, 5 rates x 3)
#   small     the same with a 4 GB pool (memory binds)
#   mooncake  params/h100-serve-mooncake.yaml (long context, 5 rates x 3)
# Usage: . scripts/device/setup.sh && PARTS="smoke sharegpt" bash scripts/device/call-serve.sh
set -u
out=outputs/serve
mkdir -p "$out" "${OUT:-/tmp/out}"
PARTS=${PARTS:-"smoke sharegpt"}
pack() { tar czf "${OUT:-/tmp/out}/serve.tgz" "$out"; }
part() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return;; esac
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  timeout "$limit" "$@" >> "$out/$name.log" 2>&1
  echo "=== $name rc=$? $(date -u +%T)"
  tail -n 30 "$out/$name.log" | cut -c1-300
  pack
}
lim() { local v="LIMIT_$1"; echo "${!v:-$2}"; }
nvidia-smi --query-gpu=name,uuid,driver_version,power.limit --format=csv,noheader | tee "$out/gpu.txt"
git rev-parse HEAD > "$out/commit.txt"
part smoke "$(lim smoke 120)" python3 benchmarks/serve_rates.py params/serve-cpu.yaml -o "$out/smoke" \
  --set device=cuda --set threads=null --set "traffic.rate=[40]"
part sharegpt "$(lim sharegpt 580)" python3 benchmarks/serve_rates.py params/h100-serve-sharegpt.yaml -o "$out/sharegpt"
part small "$(lim small 580)" python3 benchmarks/serve_rates.py params/h100-serve-sharegpt.yaml -o "$out/small" \
  --set traffic.server.pool_gb=4
part mooncake "$(lim mooncake 580)" python3 benchmarks/serve_rates.py params/h100-serve-mooncake.yaml -o "$out/mooncake"
