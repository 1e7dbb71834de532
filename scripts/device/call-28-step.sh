#!/usr/bin/env bash
# Issue #28 item 2 on the lent H200 (about 2.5 minutes): the fast step's own work after the changes of
# branch w-p28 (head-major dense store, two-stage greedy token, compiled bookkeeping, attention='cudnn'),
# under outputs/h200-p28, packed into $OUT/h200-p28.tgz. Parts (PARTS picks, LIMIT_<part> overrides):
#   attn     benchmarks/fast_attention.py: flash (head-major) vs the old [B, C, Hkv, D] call (bit for bit,
#            and its copy kernels), flash with 8 splits, masked SDPA, cuDNN; µs, kernels, W per call
#   zeros    the same for flash and cuDNN at batch 16 over zero K/V (does the data move the power?)
#   minimal  benchmarks/minimal_step.py: kvlab's step beside the minimal step over the same random K/V,
#            3 s windows x 2 rounds alternating, work table and difference, kvlab with attention=cudnn
# Usage: . scripts/device/setup.sh && bash scripts/device/call-28-step.sh   (carry .whl and .whl-tf)
set -u
out=outputs/h200-p28
mkdir -p "$out" "${OUT:-/tmp/out}"
PARTS=${PARTS:-"attn zeros minimal"}
part() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return;; esac
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  timeout "$limit" "$@" >> "$out/$name.log" 2>&1
  echo "=== $name rc=$? $(date -u +%T)"
  grep -v -i "warn" "$out/$name.log" | tail -n 40
}
lim() { local v="LIMIT_$1"; echo "${!v:-$2}"; }
nvidia-smi --query-gpu=name,uuid,driver_version,power.limit,temperature.gpu --format=csv,noheader
part attn "$(lim attn 70)" python3 benchmarks/fast_attention.py --ctx 16384 --batch 1 16 --splits 8 --seconds 1.5 \
  --out "$out/fast_attention.json"
part zeros "$(lim zeros 25)" python3 benchmarks/fast_attention.py --ctx 16384 --batch 16 --fills zeros \
  --only flash cudnn --seconds 1.5 --out "$out/fast_attention_zeros.json"
part minimal "$(lim minimal 150)" python3 benchmarks/minimal_step.py --batch 1 16 --ctx 16384 --seconds 3 --repeats 2 \
  --kv-fill random --variants attention=cudnn --out "$out/minimal_step.json"
tar czf "${OUT:-/tmp/out}/h200-p28.tgz" "$out"
