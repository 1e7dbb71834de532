# Re-measure the published headlines with >= 5 alternated repeats a side, each call on one card
# (every record and benchmark JSON names it: gpu_uuid, driver, power limit, max clocks). One part per
# device call; a sweep resumes from its records, so a part cut by the deadline continues next call:
#   call 1  campaign.sh study quanto-build     quanto's CUDA extension (built once, packed for later calls)
#   call 2  campaign.sh headlines flagship     the flagship's quanto int4 on hf vs the full cache, 16k batch 1
#   call 3  campaign.sh headlines b1 cudnn-step
#           Quest 2048 and SnapKV 10% at batch 1 (fast, 16k); the cuDNN step variant alternated with
#           the default step, batch 1 and 16 (batch 16 needs both stores side by side: 84 GB, an
#           H200; on an H100 the variant runs after the default step and its row says alternated: false)
#   call 4, 5  campaign.sh headlines b16        int4 (kvq-int4), fp8 (kvq-fp8), KIVI K2V2 and Quest 2048
#           at 16k batch 16 (fast), resumed to its 5 repeats
#   call 6  campaign.sh headlines capacity-snapkv-16k   SnapKV 10%'s capacity at 16k, confirmed at its
#           predicted batch (the script skips a confirm run its time budget cannot hold, and says so)
DEFAULT_PARTS="b1 cudnn-step"

step_capacity_snapkv_16k() {
  local t=$(( $(left) - 10 ))
  timeout "$t" python3 benchmarks/capacity.py --engine fast --prefill-rows 4 --ctx 16384 --methods full snapkv10 \
    --chunks 2048 --confirm snapkv10@2048 --time-budget-s $(( t - 20 )) --out "$out/capacity-snapkv-16k.json"
}

sweep_part flagship 540 h200-headlines-flagship flagship
sweep_part b1 300 h200-headlines-b1 b1
part cudnn-step 240 python3 benchmarks/minimal_step.py --batch 1 16 --ctx 16384 --seconds 5 --repeats 5 \
  --kv-fill random --variants attention=cudnn --out "$out/minimal_step_cudnn.json"
sweep_part b16 540 h200-headlines-b16 b16
part capacity-snapkv-16k 540 step_capacity_snapkv_16k
