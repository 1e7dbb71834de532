#!/usr/bin/env bash
# Preset: re-measure the published headlines with >= 5 alternated repeats a side, each call on one
# card (every record and benchmark JSON names it: gpu_uuid, driver, power limit, max clocks).
# Each line of CALLS is the steps of one device command for scripts/device/campaign.sh (10-minute
# commands; a sweep resumes from its records, so a part cut by the deadline continues next call):
#
#   bash scripts/device/presets/headlines.sh --list      the calls, one per line
#   bash scripts/device/presets/headlines.sh N           set up, then run call N's steps (1-based)
#   KVLAB_DRY_RUN=1 bash scripts/device/presets/headlines.sh N   print call N's commands (sweeps print
#                                                        their plan), loading no model: a CPU check
#
# What each call measures:
#   1  the flagship's quanto int4 on hf vs the full cache, 16k batch 1 (quanto's CUDA build first)
#   2  Quest 2048 and SnapKV 10% at batch 1 (fast, 16k); the cuDNN step variant alternated with the
#      default step, batch 1 and 16 (batch 16 needs both stores beside each other: 84 GB, an H200;
#      on an H100 the variant runs after the default step and its row says alternated: false)
#   3  int4 (kvq-int4), fp8 (kvq-fp8), KIVI K2V2 and Quest 2048 at 16k batch 16 (fast), first part
#   4  the same sweep, resumed to its 5 repeats
#   5  SnapKV 10%'s capacity at 16k, confirmed at its predicted batch
# Unpack each call's $OUT/h200.tgz (scripts/device/unpack.sh) and carry outputs/h200 into the next.
set -uo pipefail
CALLS=(
  "quanto-build sweep:h200-headlines-flagship"
  "sweep:h200-headlines-b1 cudnn-step"
  "sweep:h200-headlines-b16"
  "sweep:h200-headlines-b16"
  "capacity-snapkv-16k"
)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
case "${1:-}" in
  --list) printf '%s\n' "${CALLS[@]}"; exit 0 ;;
  ''|*[!0-9]*) echo "usage: $0 --list | CALL (1-${#CALLS[@]})" >&2; exit 2 ;;
esac
[ "$1" -ge 1 ] && [ "$1" -le "${#CALLS[@]}" ] || { echo "call $1: there are ${#CALLS[@]}" >&2; exit 2; }
read -ra steps <<< "${CALLS[$(( $1 - 1 ))]}"
if [ -z "${KVLAB_DRY_RUN:-}" ]; then
  # shellcheck disable=SC1091
  . "$here/../setup.sh"
fi
exec bash "$here/../campaign.sh" "${steps[@]}"
