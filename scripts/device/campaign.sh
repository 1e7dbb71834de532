#!/usr/bin/env bash
# One campaign script for the lent GPU: a preset names its parts, this script runs the ones asked for
# in the preset's order, each under its own time limit, all inside one deadline that fits the device
# tool's 10-minute command, and packs the preset's output folder after every part (a call cut short
# keeps what its finished parts wrote).
#
#   . scripts/device/setup.sh && bash scripts/device/campaign.sh [PRESET] [PART ...]
#
# PRESET is a file scripts/device/presets/PRESET.sh (default: study, the protocol's campaign, whose
# parts are also the names the params files cite: `campaign.sh sweep:h200-workloads-dist`). With no
# PART the preset's DEFAULT_PARTS run. `sweep:NAME@K=V@...` runs params/NAME.yaml with --set K=V
# under any preset. Output: outputs/PRESET/ (carry it back in the next call: sweeps resume from their
# records), packed into $OUT/PRESET.tgz.
#
# A preset is a list of parts, read top to bottom:
#   DEFAULT_PARTS="a b"                      what runs when the call names none
#   part NAME LIMIT_S COMMAND...             COMMAND under timeout, its output in $out/NAME.log
#   sweep_part NAME LIMIT_S PARAMS OUT [--set K=V ...]
#                                            kvlab sweep params/PARAMS.yaml -o $out/OUT, given the part's
#                                            time left minus 25 s as its time_budget_s (a clean stop)
#   selected NAME                            true if NAME runs in this call (to guard a part)
# A COMMAND may be a shell function the preset defines (it then bounds its own commands with
# `timeout "$(left)"`). LIMIT_<NAME> (dashes as underscores) overrides a part's limit;
# KVLAB_DEADLINE_S (default 540) is the whole call's.
set -uo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
preset=study
if [ $# -gt 0 ] && [ -f "$here/presets/$1.sh" ]; then preset=$1; shift; fi
out=outputs/$preset
mkdir -p "$out" "${OUT:-/tmp/out}"
start=$SECONDS
deadline=${KVLAB_DEADLINE_S:-540}
left() { echo $(( deadline - (SECONDS - start) )); }
say() { echo "== [$(( SECONDS - start ))s] $*"; }
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/$preset.tgz" "$out"; }
ASKED=" $* "
selected() { case "$ASKED" in *" $1 "*) return 0;; esac; return 1; }
limit_of() {  # NAME DEFAULT: LIMIT_<NAME> or DEFAULT, never past the deadline
  local v="LIMIT_${1//-/_}" t
  t=${!v:-$2}
  [ "$t" -gt "$(( $(left) - 10 ))" ] && t=$(( $(left) - 10 ))
  echo "$t"
}
part() {  # NAME LIMIT_S COMMAND...
  local name=$1 limit rc; shift
  selected "$name" || return 0
  limit=$(limit_of "$name" "$1"); shift
  if [ "$limit" -le 10 ]; then say "$name: skipped, deadline reached"; return 0; fi
  say "$name (limit ${limit}s)"
  if declare -F "$1" > /dev/null; then "$@" >> "$out/$name.log" 2>&1; else timeout "$limit" "$@" >> "$out/$name.log" 2>&1; fi
  rc=$?
  say "$name: exit $rc"
  grep -v -i "warn\|attn_output = torch" "$out/$name.log" | tail -n 25 | cut -c1-400
  pack
}
sweep_part() {  # NAME LIMIT_S PARAMS OUT [--set K=V ...]
  local name=$1 limit=$2 params=$3 dest=$4; shift 4
  selected "$name" || return 0
  part "$name" "$limit" python3 -m kvlab sweep --no-progress "params/$params.yaml" -o "$out/$dest" \
    --set time_budget_s="$(( $(limit_of "$name" "$limit") - 25 ))" "$@"
}
step_sweep() {  # NAME@K=V@...: a whole params file or a slice of it, resumable
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

nvidia-smi --query-gpu=name,uuid,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
DEFAULT_PARTS=""
# shellcheck source=/dev/null
source "$here/presets/$preset.sh"  # defines parts; `part` runs only those asked for
[ -z "$(echo "$ASKED" | tr -d ' ')" ] && { ASKED=" $DEFAULT_PARTS "; source "$here/presets/$preset.sh"; }
for s in $ASKED; do
  case $s in sweep:*) say "$s"; step_sweep "${s#sweep:}"; say "$s: exit $?"; pack ;; esac
done
nvidia-smi --query-gpu=name,temperature.gpu,power.draw,clocks.sm --format=csv,noheader || true
pack; [ -n "${OUT:-}" ] && ls -la "$OUT"
