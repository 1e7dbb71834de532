#!/usr/bin/env bash
# Time README block 1 as a newcomer runs it: a fresh clone in a temp folder, a fresh venv, the
# README's install line, `kvlab sweep params/smoke.yaml` and `kvlab report`; then, outside block 1,
# `kvlab budget` and `kvlab generate` of 16 tokens (issue #15's CLI targets). Prints wall and CPU
# seconds (user+sys of the phase's processes) per phase, and the load average before and after:
# wall time on a shared machine says as much about the neighbours as about kvlab.
#
#   bash scripts/newcomer_timing.sh                 # clones this checkout's commit (HEAD; commit first)
#   bash scripts/newcomer_timing.sh --fresh-cache   # and converts SmolLM2's GGUF anew (KVLAB_CACHE in the temp folder)
#   bash scripts/newcomer_timing.sh --setup-only    # only the install phases
#   bash scripts/newcomer_timing.sh --keep          # keep the temp folder (else removed at the end)
#   REPO=/path/to/repo REF=main bash scripts/newcomer_timing.sh
#
# The table is also written to $WORK/timing.tsv (printed path) when --keep is given.
set -uo pipefail

repo=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}
ref=${REF:-$(git -C "$repo" rev-parse HEAD)}
fresh_cache=0
setup_only=0
keep=0
for arg in "$@"; do
  case $arg in
    --fresh-cache) fresh_cache=1 ;;
    --setup-only) setup_only=1 ;;
    --keep) keep=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "newcomer_timing.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

work=$(mktemp -d "${TMPDIR:-/tmp}/kvlab-newcomer.XXXXXX")
[ "$keep" = 1 ] || trap 'rm -rf "$work"' EXIT
table="$work/timing.tsv"
printf 'phase\twall_s\tcpu_s\tuser_s\tsys_s\tstatus\n' > "$table"
block1_wall=0
block1_cpu=0
phases=0
sweep_log=
kvlab_logs=

# phase NAME IN_BLOCK1 CMD...: run CMD (its output to $work/phase-N.log), add a row to the table.
phase() {
  local name=$1 in_block=$2
  shift 2
  phases=$((phases + 1))
  local log="$work/phase-$phases.log" t0 t1 c0 c1 rc
  case $name in "kvlab sweep"*) sweep_log=$log ;; esac
  case $name in "kvlab "*) kvlab_logs="$kvlab_logs $log" ;; esac
  echo "== $name (log: $log)" >&2
  t0=$(date +%s.%N)
  times > "$work/.times"
  c0=$(children_cpu)
  "$@" > "$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  times > "$work/.times"
  c1=$(children_cpu)
  local wall cpu user sys
  wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  read -r user sys <<< "$(awk -v a="$c0" -v b="$c1" 'BEGIN { split(a, x, " "); split(b, y, " "); printf "%.1f %.1f", y[1] - x[1], y[2] - x[2] }')"
  cpu=$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.1f", u + s }')
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$wall" "$cpu" "$user" "$sys" "$rc" >> "$table"
  if [ "$in_block" = 1 ]; then
    block1_wall=$(awk -v a="$block1_wall" -v b="$wall" 'BEGIN { print a + b }')
    block1_cpu=$(awk -v a="$block1_cpu" -v b="$cpu" 'BEGIN { print a + b }')
  fi
  if [ "$rc" != 0 ]; then
    echo "   exit $rc; last lines of $log:" >&2
    tail -n 5 "$log" | tr '\r' '\n' | tail -n 5 >&2
  fi
  return "$rc"
}

# The user and system CPU seconds of this shell's finished children: bash `times` (second line),
# written to a file by the shell itself (in a $(...) subshell it would count the subshell's children).
children_cpu() {
  awk 'NR == 2 { print tosec($1), tosec($2) }
    function tosec(t,  m) { m = t; sub(/m.*/, "", m); sub(/^[0-9]+m/, "", t); sub(/s$/, "", t); return m * 60 + t }' \
    "$work/.times"
}

load() { cut -d' ' -f1-3 /proc/loadavg; }

echo "kvlab newcomer timing: $(nproc) cores, load average $(load), clone of $repo at $ref into $work" >&2
load_before=$(load)
git clone --quiet "$repo" "$work/kvlab" && git -C "$work/kvlab" checkout --quiet "$ref" || exit 1
cd "$work/kvlab" || exit 1
if [ "$fresh_cache" = 1 ]; then
  export KVLAB_CACHE="$work/cache"
fi

# README block 1 as the README says it, split at its &&s: sourcing runs in this shell, every other
# command is a phase (a failed install ends the script).
mapfile -t block1 < <(python3 - <<'EOF'
import re
text = open("README.md", encoding="utf-8").read()
section = text[text.index("## On a fresh machine"):]
block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
for command in " ".join(block.split("\n")).split(" && "):
    print(command.strip())
EOF
)
[ "${#block1[@]}" -gt 0 ] || { echo "newcomer_timing.sh: no block 1 in README.md" >&2; exit 1; }
for command in "${block1[@]}"; do
  case $command in
    ". "*|"source "*) eval "$command" ;;
    "kvlab "*) [ "$setup_only" = 1 ] || phase "${command%% -o*}" 1 bash -c "$command" ;;
    *) phase "$command" 1 bash -c "$command" || exit 1 ;;
  esac
done
if [ "$setup_only" = 0 ]; then
  # Outside block 1: the CLI targets of issue #15.
  phase "kvlab budget" 0 kvlab budget --model llama-3.1-8b --ctx 16384
  phase "kvlab generate 16 tokens" 0 kvlab generate --model smollm2-135m --prompt "Hello" --max-new-tokens 16
fi
load_after=$(load)

echo
echo "load average before: $load_before; after: $load_after ($(nproc) cores)"
column -t -s $'\t' "$table"
echo "README block 1 (phases marked in the script): wall ${block1_wall} s, CPU ${block1_cpu} s"
if [ -n "$sweep_log" ]; then
  echo
  echo "inside the sweep (its own log lines):"
  tr '\r' '\n' < "$sweep_log" | grep -E '^kvlab(: convert| sweep: (loaded|quality))' || true
  python - <<'EOF' || true
import json
from pathlib import Path
from collections import defaultdict
out = Path("outputs/smoke")
per = defaultdict(lambda: [0, 0.0])
for name in ("warmup.jsonl", "records.jsonl"):
    path = out / name
    if not path.is_file():
        continue
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "quality":
            continue
        key = ("warm-up " if name.startswith("warmup") else "run ") + f"{r['method']} ctx={r['ctx']}"
        per[key][0] += 1
        per[key][1] += (r.get("prefill_s") or 0) + (r.get("decode_s") or 0)
for key, (n, s) in sorted(per.items()):
    print(f"  {key:32s} {n} x, prefill+decode {s:6.1f} s")
EOF
fi
if [ "$setup_only" = 0 ] && [ -f outputs/smoke/records.jsonl ]; then
  # issue #30's done-when: the report of a busy VM still reaches verdicts, and nothing warns
  echo
  echo "the report's verdicts (where compression pays; on a CPU they read CPU ms/token):"
  python - <<'EOF' || true
from kvlab import report
study = report.load_study("outputs/smoke")
pays = report.compression_pays(study.records)
for r in pays.to_dict("records"):
    print(f"  {r['label']:16s} ctx {r['ctx']:>5}, batch {r['batch']}: {r['verdict']} "
          f"({r['cost']}, {r['n']} vs {r['n_base']} runs)")
print("  " + "\n  ".join(report.energy_answer(pays)))
EOF
  # kvlab's own phases only: pip's phases print this machine's index warnings, which are not ours
  warnings=$(cat $kvlab_logs | tr '\r' '\n' | grep -i 'warn')
  echo "warning lines in the kvlab phases' output: $(printf '%s' "$warnings" | grep -c .)"
  [ -z "$warnings" ] || printf '%s\n' "$warnings" | sort | uniq -c | sort -rn | head -n 10
fi
if [ "$keep" = 1 ]; then
  echo "kept $work (table: $table)"
fi
