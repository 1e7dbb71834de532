# Source at the start of every command on the lent GPU machine (it has no package registry):
#   . scripts/device/setup.sh
# with carry [".whl", ".device"]. It installs the carried wheels (built by ../shared/device/wheels.sh
# plus hqq and termcolor) and restores optimum-quanto's CUDA extension built on an earlier call, so
# its ~90 s JIT build never lands in a measurement.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
_ext=/tmp/site/optimum/quanto/library/extensions/cuda
if [ -f .device/quanto_cuda_build.tgz ] && [ ! -f "$_ext/build/quanto_cuda.so" ]; then
  tar xzf .device/quanto_cuda_build.tgz -C "$_ext" && touch "$_ext"/build/*.o && sleep 0.05 && touch "$_ext"/build/quanto_cuda.so
fi
unset _ext
# Optional: a newer transformers (carry [".whl-tf"]) in its own folder, so one command can run the
# same script on the machine's stock transformers and on the carried one:
#   PYTHONPATH=/tmp/site-tf:$PYTHONPATH python3 ...
if [ -d .whl-tf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-tf .whl-tf/*.whl
fi
