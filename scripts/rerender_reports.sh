#!/usr/bin/env bash
# Re-render every report folder under reports/ that holds records (records.jsonl, plain or .xz, in
# it or a subfolder), or the folders given, into a scratch folder; one line per folder with kvlab
# report's exit code; exits 1 if any failed.
#   bash scripts/rerender_reports.sh [FOLDER...]
set -u
out=$(mktemp -d)
fail=0
folders=("$@")
if [ ${#folders[@]} -eq 0 ]; then
    for dir in reports/*/; do
        find "$dir" -name 'records.jsonl*' -print -quit | grep -q . && folders+=("$dir")
    done
fi
for dir in "${folders[@]}"; do
    dir=${dir%/}
    name=$(basename "$dir")
    kvlab report "$dir" -o "$out/$name.html" --no-index >"$out/$name.log" 2>&1
    rc=$?
    echo "rc=$rc $dir"
    [ $rc -eq 0 ] || { fail=1; tail -3 "$out/$name.log"; }
done
rm -rf "$out"
exit $fail
