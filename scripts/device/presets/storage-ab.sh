# Before/after of the storage layer (kvlab/storage) on the GPU: the fast engine's ms/step and decode
# J/token at 16k, batch 1 and 16, for full, kvq-int4, kivi and quest (params/storage-ab.yaml), each
# tree running its own `kvlab sweep` over the same params file, alternating (before, after, before,
# after), each round into its own folder. Two calls on one warm machine:
#   here:    git archive --prefix=before/ <the commit before the storage layer> kvlab > .device/before-kvlab.tar
#   call 1:  . scripts/device/setup.sh && bash scripts/device/campaign.sh storage-ab
#   call 2:  . scripts/device/setup.sh && bash scripts/device/campaign.sh storage-ab unpack before2 after2
#   (carry [".whl", ".whl-tf", ".device"]; compare records side by side, same card only)
DEFAULT_PARTS="unpack before1 after1"
unpack() {
  mkdir -p /tmp/storage-ab
  [ -f .device/before-kvlab.tar ] || { echo "no .device/before-kvlab.tar: see the preset's header"; return 1; }
  tar -xf .device/before-kvlab.tar -C /tmp/storage-ab
}
before=(env "PYTHONPATH=/tmp/storage-ab/before:${PYTHONPATH:-}" python3 -m kvlab sweep --no-progress params/storage-ab.yaml)
after=(python3 -m kvlab sweep --no-progress params/storage-ab.yaml)
part unpack 20 unpack
part before1 250 "${before[@]}" -o "$out/before-1"
part after1 250 "${after[@]}" -o "$out/after-1"
part before2 250 "${before[@]}" -o "$out/before-2"
part after2 250 "${after[@]}" -o "$out/after-2"
