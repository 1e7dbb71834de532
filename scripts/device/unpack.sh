#!/usr/bin/env bash
# Unpack what a device call brought back (its files_at folder) into this checkout's outputs/, so
# that the next call's `carry ["outputs/h200"]` resumes from it. Carrying a folder replaces the
# machine's copy: a call that carries a stale outputs/h200 makes its sweeps start again from
# nothing (2026-12-03, fourth session: a whole at-budget sweep ran twice). Run this between calls:
#
#   bash scripts/device/unpack.sh /work/.device/N
set -euo pipefail
src=${1:?usage: unpack.sh FILES_AT, the folder named in the device call reply}
for t in "$src"/h200.tgz "$src"/ray-compare.tgz; do
  [ -f "$t" ] || continue
  tar xzf "$t"   # paths inside start with outputs/
  echo "unpacked $t"
done
for f in outputs/h200/*/records.jsonl outputs/ray-compare/*/records.jsonl; do
  [ -f "$f" ] && echo "  $(wc -l < "$f") records  $f"
done
exit 0
