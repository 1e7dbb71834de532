# Source at the start of every command on the lent GPU machine (it has no package registry):
#   . scripts/device/setup.sh
# with carry [".whl", ".device"]. It installs the carried wheels (built by ../shared/device/wheels.sh
# plus hqq and termcolor) and restores optimum-quanto's CUDA extension built on an earlier call, so
# its ~90 s JIT build never lands in a measurement.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
_ext=/tmp/site/optimum/quanto/library/extensions/cuda
# Seen 2026-12-02: touching the restored objects made ninja rebuild anyway (its deps log records
# the objects' original mtimes), so the build ran again inside a sweep. Now the archive keeps its
# mtimes and the freshly installed sources are dated back instead, so ninja finds nothing to do.
# Not yet verified on the device: check that `policy.warmup` takes seconds, not ~90 s.
if [ -f .device/quanto_cuda_build.tgz ] && [ ! -f "$_ext/build/quanto_cuda.so" ]; then
  find "$_ext" -type f \( -name '*.cu' -o -name '*.cpp' -o -name '*.h' -o -name '*.cuh' \) -exec touch -d '2000-01-01' {} +
  tar xzf .device/quanto_cuda_build.tgz -C "$_ext"
fi
unset _ext
# Optional: a newer transformers (carry [".whl-tf"]) in its own folder, so one command can run the
# same script on the machine's stock transformers and on the carried one:
#   PYTHONPATH=/tmp/site-tf:$PYTHONPATH python3 ...
if [ -d .whl-tf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-tf .whl-tf/*.whl
fi
