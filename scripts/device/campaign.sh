#!/usr/bin/env bash
# The H200 campaign of issue #7, as steps that fit the device tool's 10-minute commands.
#
#   . scripts/device/setup.sh && bash scripts/device/campaign.sh STEP [STEP ...]
#
# Every step writes under outputs/h200/ (unpack it here with scripts/device/unpack.sh, then carry it
# in the next call: sweeps resume from their records), and the script ends by packing that folder
# into $OUT/h200.tgz. Steps run until KVLAB_DEADLINE_S seconds after the script started (default
# 540), so the pack always happens inside the call's limit: a step that would overrun is stopped
# by `timeout`, and a sweep is given the time left as its time_budget_s, so it stops cleanly
# between runs.
#
# Steps:
#   quanto-build      time optimum-quanto's CUDA extension load (the JIT build on a fresh machine);
#                     pack a new build into $OUT/quanto_cuda_build.tgz and check that it restores
#   policies          every registered policy generating at 16k (benchmarks/policies_gpu.py)
#   sampler           the energy sampler's overhead on decode, 15 ms vs 100 ms polling
#   sweep:NAME        kvlab sweep params/NAME.yaml -o outputs/h200/NAME (resumes)
#   sweep:NAME@K=V..  the same with --set K=V for each @-separated pair, e.g. a part of the plan:
#                     sweep:h200-batch@methods=[full,snapkv] (run ids do not depend on the other
#                     methods, so the whole plan later resumes from these records, and the
#                     folder's manifest keeps the whole plan)
#   quality-part1     keep the first half of SmolLM2's GGUF (carry .model1) in /tmp/smollm2
#   quality           join the second half (carry .model2) and run the quality pass on the GPU
#   quality-rest      variable tracking at 4k (the part the first pass did not reach)
#   quality-fp8       full vs fp8 on the needle task (checks the saturating fp8 cast on CUDA)
#   anatomy           per-op anatomy of a decode step per method at 16k (torch.profiler)
#   capacity-fast     capacity at 16k and 32k on the fast engine, prefilled in row groups (#14)
#   expandable-b32    the full cache at batch 32, 16k, one-shot prefill on hf: with expandable
#                     segments, then without (#14)
#   kernels-tune      the fused kernels' launch-config grid for int4-g64 and fp8 (quant_attention.py
#                     --tune --profile); the engines steps after it use its winners (#13)
#   engines-b32       batch 32 at 16k on the fast engine: full, fp8, int4 (#13)
#   engines-b16-profile  the fast step at batch 16 for full, fp8 and int4, 2 repeats, and its kernels (#13)
#   engines-b1-fold   batch 1 on the fast engine with the fold kernels, and fast-vs-hf agreement (#12, #13)
#   quality-reads     KIVI-style and Quest-style reads on SmolLM2's needle and fidelity, on cuda (#29;
#                     params/quality-reads.yaml; carry .model1/.model2 like quality)
#   anatomy-reads     the fast step's anatomy at 16k for full, kivi (K2V2) and quest (budget 2048) (#29)
#   cudnn-step        kvlab's step with attention=cudnn built beside the default step and alternated
#                     with it, 5 rounds of 5 s windows, batch 1 and 16 at 16k (minimal_step.py)
#   capacity-snapkv-16k  SnapKV 10%'s capacity at 16k on the fast engine, confirmed at its predicted
#                     batch (no cap; the script skips a confirm run its time budget cannot hold, and says so)
#
# KVLAB_DRY_RUN=1 prints each step's commands (sweeps: --dry-run, their plan) instead of running them.
set -uo pipefail
out=outputs/h200
mkdir -p "$out" "${OUT:-/tmp/out}"
start=$SECONDS
deadline=${KVLAB_DEADLINE_S:-540}
left() { echo $(( deadline - (SECONDS - start) )); }
if [ -n "${KVLAB_DRY_RUN:-}" ]; then  # print the commands; sweeps validate their params and print the plan
  timeout() { shift; case "$1 $2 $3" in "python3 -m kvlab") shift; command python3 "$@" --dry-run ;; *) echo "would run: $*" ;; esac; }
  python3() { echo "would run: python3 $*"; }
fi
say() { echo "== [$(( SECONDS - start ))s] $*"; }
smollm2=/tmp/smollm2-135m  # the joined GGUF; the folder's name is the model name in records

step_quanto_build() {
  local ext=/tmp/site/optimum/quanto/library/extensions/cuda
  local had_build=0
  [ -f "$ext/build/quanto_cuda.so" ] && had_build=1
  python3 - <<'EOF'
import time, torch
from optimum.quanto.library.extensions import get_extension
t = time.perf_counter()
get_extension("quanto_cuda").lib
print(f"quanto_cuda extension ready in {time.perf_counter() - t:.1f} s (torch {torch.__version__})")
EOF
  if [ "$had_build" = 0 ] && [ -n "${OUT:-}" ]; then
    tar czf "$OUT/quanto_cuda_build.tgz" -C "$ext" build && ls -la "$OUT/quanto_cuda_build.tgz"
    # The restore path of setup.sh, in a scratch install: a fresh process must load it in seconds.
    local scratch=/tmp/site-verify
    rm -rf "$scratch" && python3 -m pip install -q --no-index --no-deps --no-compile --target "$scratch" .whl/optimum_quanto-*.whl
    local sext=$scratch/optimum/quanto/library/extensions/cuda
    find "$sext" -type f \( -name '*.cu' -o -name '*.cpp' -o -name '*.h' -o -name '*.cuh' \) -exec touch -d '2000-01-01' {} +
    tar xzf "$OUT/quanto_cuda_build.tgz" -C "$sext"
    # The build folder records absolute source paths: the check must see the same paths, so it
    # swaps the scratch copy in for the live one (the live build is kept aside and put back).
    mv "$ext/build" /tmp/quanto-build-live && mv "$sext/build" "$ext/build"
    find "$ext" -path "$ext/build" -prune -o -type f \( -name '*.cu' -o -name '*.cpp' -o -name '*.h' -o -name '*.cuh' \) \
      -exec touch -d '2000-01-01' {} +
    timeout 60 python3 -c "
import time
from optimum.quanto.library.extensions import get_extension
t = time.perf_counter(); get_extension('quanto_cuda').lib
print(f'restored build loads in {time.perf_counter() - t:.1f} s (a rebuild would take ~90 s)')" || echo "restore check: failed or timed out"
    rm -rf "$ext/build" && mv /tmp/quanto-build-live "$ext/build"
  fi
}

step_policies() {
  mkdir -p "$out/policies"
  timeout "$(left)" python3 benchmarks/policies_gpu.py --ctx 16384 --new-tokens 16 --sdpa-backend flash \
    --json-out "$out/policies/policies_16k_flash.jsonl"
}

step_sampler() {
  mkdir -p "$out/sampler"
  OUT=$out/sampler timeout "$(left)" python3 benchmarks/energy_sampler.py --parts overhead \
    --intervals-ms 15,100 --pairs 8
}

step_sweep() {
  local spec=$1 name budget sets=() kv
  name=${spec%%@*}
  if [ "$name" != "$spec" ]; then
    IFS=@ read -ra kv <<< "${spec#*@}"
    for k in "${kv[@]}"; do sets+=(--set "$k"); done
  fi
  budget=$(( $(left) - 15 ))
  [ "$budget" -gt 60 ] || { say "sweep:$spec skipped: ${budget}s left"; return 0; }
  timeout "$(( budget + 10 ))" python3 -m kvlab sweep "params/$name.yaml" -o "$out/$name" \
    --set time_budget_s="$budget" "${sets[@]}" --no-progress
}

step_quality_part1() {
  mkdir -p "$smollm2" && cp .model1/part-aa "$smollm2/" && ls -la "$smollm2"
}

join_smollm2() {
  if [ ! -f "$smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    [ -f "$smollm2/part-aa" ] || { say "quality: no first half in $smollm2 (machine recycled): run quality-part1 first"; return 1; }
    cat "$smollm2/part-aa" .model2/part-ab > "$smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" && rm "$smollm2/part-aa"
  fi
  sha256sum "$smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
}

# `kvlab quality` does not resume and SmolLM2 on the H200 took ~1.2 s per generation (2026-12-02:
# 16 items x 24 policies filled a whole 450 s call): each quality step is one bounded slice with
# its own output folder. run_quality_slice NAME SECONDS ARGS...
run_quality_slice() {
  local name=$1 cap=$2 t; shift 2
  join_smollm2 || return 1
  t=$(left); [ "$t" -gt "$cap" ] && t=$cap
  timeout "$t" python3 -m kvlab quality --model "$smollm2" --device cuda -o "$out/$name" "$@"
}

# The pass of 2026-12-02 (stopped by its deadline after 15 of its 18 items).
step_quality() {
  run_quality_slice quality 450 --tasks niah_single niah_multikey variable_tracking --lengths 2048 4096 \
    --depths 0.1 0.5 0.9 --samples 1 \
    --methods full streamingllm snapkv pyramidkv tova knorm random quanto hqq fp8 --keep 0.5 0.25 0.1 --bits 4 2
}

# What that pass left: variable tracking at 4k.
step_quality_rest() {
  run_quality_slice quality-vt4096 200 --tasks variable_tracking --lengths 4096 --depths 0.1 0.5 0.9 --samples 1 \
    --methods full streamingllm snapkv pyramidkv tova knorm random quanto hqq fp8 --keep 0.5 0.25 0.1 --bits 4 2
}

# fp8 answered nothing on the GPU (NaN logits) on 2026-12-02; kvlab's fp8 layer now saturates its cast.
step_quality_fp8() {
  run_quality_slice quality-fp8 120 --tasks niah_single --lengths 2048 4096 --depths 0.1 0.5 0.9 --samples 1 \
    --methods full fp8
}

step_anatomy() {
  mkdir -p "$out/anatomy"
  timeout "$(left)" python3 -m kvlab anatomy --model llama-3.1-8b --weights synthetic --device cuda --ctx 16384 \
    --methods full snapkv quanto fp8 --params '{"snapkv": {"keep": 0.1}, "quanto": {"nbits": 4}}' \
    --steps 8 --warmup 3 --sdpa-backend flash --json > "$out/anatomy/anatomy_16k.json"
}

# Issue #14 on the fast engine with row-grouped prefill (benchmarks/capacity.py's docstring says why
# these configs and caps): 16k then 32k; each writes its rows as measured.
step_capacity_fast() {
  mkdir -p "$out/capacity"
  local t=$(( $(left) / 2 )); [ "$t" -gt 260 ] && t=260
  timeout "$t" python3 benchmarks/capacity.py --engine fast --prefill-rows 4 --ctx 16384 --methods full snapkv10 \
    --chunks none 2048 --confirm full@once snapkv10@2048 --confirm-max-batch 64 --time-budget-s $(( t - 20 )) \
    --out "$out/capacity/capacity-fast-16k.json"
  t=$(( $(left) - 10 )); [ "$t" -gt 240 ] && t=240
  [ "$t" -gt 60 ] || { say "capacity 32k skipped: ${t}s left"; return 0; }
  timeout "$t" python3 benchmarks/capacity.py --engine fast --prefill-rows 2 --ctx 32768 --methods full snapkv10 \
    --chunks 2048 --confirm all --confirm-max-batch 32 --time-budget-s $(( t - 25 )) \
    --out "$out/capacity/capacity-fast-32k.json"
}

# Issue #14: "try expandable_segments for the full cache at batch 32" (2026-12-02: out of memory on hf).
# The allocator reads PYTORCH_CUDA_ALLOC_CONF once, at CUDA init: one process per setting.
step_expandable_b32() {
  mkdir -p "$out/capacity"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$(( $(left) / 2 ))" python3 benchmarks/capacity.py \
    --ctx 16384 --methods full --chunks none --fixed-batch 32 --out "$out/capacity/expandable-b32-hf.json"
  timeout "$(( $(left) - 5 ))" python3 benchmarks/capacity.py \
    --ctx 16384 --methods full --chunks none --fixed-batch 32 --out "$out/capacity/default-b32-hf.json"
}

# Issue #13: the launch geometry of the fused kernels (block, warps, stages, split density), never
# tuned before; the engines steps below read its winners when the file exists.
tuned=$out/kernels/tune.json
step_kernels_tune() {
  mkdir -p "$out/kernels"
  timeout "$(left)" python3 benchmarks/quant_attention.py --tune --profile --tune-formats int4-g64 fp8 \
    --skip correctness performance write --out "$tuned"
}
launch_configs() { [ -f "$tuned" ] && grep -q '"winners"' "$tuned" && echo --launch-configs "$tuned"; }

# Issue #13: batch 32 at 16k on the fast engine (full, fp8, int4 stores; 4 sequences prefilled at a
# time, so the batch fits), and batch 1 with the fold kernels plus the compiled step's teacher-forced
# agreement with hf (issue #12's GPU check).
step_engines_b32() {
  mkdir -p "$out/engines"
  timeout "$(left)" python3 benchmarks/engines.py --batch 32 --ctx 16384 --new-tokens 64 --repeats 2 --max-decoders 1 \
    --methods full fp8 quanto4 --engines fast --compare-steps 0 --prefill-rows 4 $(launch_configs) \
    --out "$out/engines/engines-b32-fast.json"
}
step_engines_b16_profile() {  # where the int4 and fp8 steps' time goes at batch 16 (#13's goal figures)
  mkdir -p "$out/engines"
  timeout "$(left)" python3 benchmarks/engines.py --batch 16 --ctx 16384 --new-tokens 64 --repeats 2 --max-decoders 1 \
    --methods full fp8 quanto4 --engines fast --compare-steps 0 --profile 4 --profile-methods full fp8 quanto4 \
    $(launch_configs) \
    --out "$out/engines/engines-b16-profile.json"
}
step_engines_b1_fold() {
  mkdir -p "$out/engines"
  timeout "$(left)" python3 benchmarks/engines.py --batch 1 --ctx 16384 --new-tokens 128 --repeats 3 --max-decoders 1 \
    --methods full fp8 quanto4 --engines fast --compare-steps 32 --out "$out/engines/engines-b1-fold.json"
}

step_quality_reads() {  # issue #29's quality bar: the sweep's quality pass on the joined GGUF
  join_smollm2 || return 1
  step_sweep "quality-reads@models=[$smollm2]"
}
step_anatomy_reads() {  # graph replays name kernels only: topk's are "page selection", the bound GEMMs are not
  mkdir -p "$out/anatomy"
  timeout "$(left)" python3 -m kvlab anatomy --model llama-3.1-8b --weights synthetic --device cuda --ctx 16384 \
    --engine fast --methods full kivi quest --params '{"quest": {"budget": 2048}}' --steps 8 --warmup 3 \
    --sdpa-backend flash --json > "$out/anatomy/anatomy_reads_16k.json"
}

step_cudnn_step() {
  mkdir -p "$out/step"
  timeout "$(left)" python3 benchmarks/minimal_step.py --batch 1 16 --ctx 16384 --seconds 5 --repeats 5 \
    --kv-fill random --variants attention=cudnn --out "$out/step/minimal_step_cudnn.json"
}
step_capacity_snapkv_16k() {
  mkdir -p "$out/capacity"
  local t=$(( $(left) - 10 ))
  timeout "$t" python3 benchmarks/capacity.py --engine fast --prefill-rows 4 --ctx 16384 --methods full snapkv10 \
    --chunks 2048 --confirm snapkv10@2048 --time-budget-s $(( t - 20 )) --out "$out/capacity/capacity-snapkv-16k.json"
}

for s in "$@"; do
  if [ "$(left)" -le 20 ]; then say "$s: skipped, deadline reached"; continue; fi
  say "$s (deadline in $(left)s)"
  case $s in
    sweep:*) step_sweep "${s#sweep:}" ;;
    *) "step_${s//-/_}" ;;
  esac
  say "$s: exit $?"
done
[ -n "${KVLAB_DRY_RUN:-}" ] && exit 0
nvidia-smi --query-gpu=name,temperature.gpu,power.draw,clocks.sm --format=csv,noheader || true
[ -n "${OUT:-}" ] && tar czf "$OUT/h200.tgz" outputs/h200 && ls -la "$OUT"
