#!/usr/bin/env bash
# Before/after of the storage refactor on the GPU, in one call: the fast engine's ms/step and decode
# J/token at 16k, batch 1 and 16, for full, kvq-int4, kivi and quest, the two trees alternating
# (before, after, before, after), each through this tree's benchmarks/engines.py.
#
#   here:   git archive --prefix=before/ "$(git merge-base HEAD main)" kvlab > .device/before-kvlab.tar
#   device: . scripts/device/setup.sh && ROUND=1 bash scripts/device/storage_ab.sh .device/before-kvlab.tar
#           then the same with ROUND=2 on the same warm machine (one round, before then after, fits
#           a 10-minute call; carry [".whl", ".whl-tf", ".device"])
# Writes $OUT/storage-ab/{before,after}-{1,2}.json; compare the medians side by side, same card only.
set -u
tarball=${1:?the before tree: .device/before-kvlab.tar}
out=${OUT:-outputs}/storage-ab
mkdir -p "$out" /tmp/storage-ab
tar -xf "$tarball" -C /tmp/storage-ab
after=$PWD
for round in ${ROUND:-1}; do
  for side in before after; do
    root=$after
    [ "$side" = before ] && root=/tmp/storage-ab/before
    # the before tree's kvlab first on the path (the setup's packages after it)
    PYTHONPATH="$root:$PYTHONPATH" timeout 280 python3 benchmarks/engines.py --batch 1 16 --ctx 16384 \
      --new-tokens 64 --repeats 1 --methods full kvq4 kivi quest --engines fast --compare-steps 0 \
      --no-kernel-bw --max-decoders 1 --out "$out/$side-$round.json" || echo "storage_ab: $side $round failed ($?)"
  done
done
ls -l "$out"
