# Before/after of the storage layer (kvlab/storage) on the GPU: the fast engine's ms/step and decode
# J/token at 16k, batch 1 and 16, for full, kvq-int4, kivi and quest, the two trees alternating
# (before, after, before, after), each run by this tree's benchmarks/engines.py. Two calls on one
# warm machine (each about 8 minutes):
#   here:    git archive --prefix=before/ <the commit before the storage layer> kvlab > .device/before-kvlab.tar
#   call 1:  . scripts/device/setup.sh && bash scripts/device/campaign.sh storage-ab
#   call 2:  . scripts/device/setup.sh && bash scripts/device/campaign.sh storage-ab unpack before2 after2
#   (carry [".whl", ".whl-tf", ".device"]; compare the medians side by side, same card only)
DEFAULT_PARTS="unpack before1 after1"
unpack() {
  mkdir -p /tmp/storage-ab
  [ -f .device/before-kvlab.tar ] || { echo "no .device/before-kvlab.tar: see the preset's header"; return 1; }
  tar -xf .device/before-kvlab.tar -C /tmp/storage-ab
}
ab_args=(benchmarks/engines.py --batch 1 16 --ctx 16384 --new-tokens 64 --repeats 1 --methods full kvq4 kivi quest
         --engines fast --compare-steps 0 --no-kernel-bw --max-decoders 1)
before=(env "PYTHONPATH=/tmp/storage-ab/before:${PYTHONPATH:-}" python3)
part unpack 20 unpack
part before1 250 "${before[@]}" "${ab_args[@]}" --out "$out/before-1.json"
part after1 250 python3 "${ab_args[@]}" --out "$out/after-1.json"
part before2 250 "${before[@]}" "${ab_args[@]}" --out "$out/before-2.json"
part after2 250 python3 "${ab_args[@]}" --out "$out/after-2.json"
