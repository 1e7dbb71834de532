# Source at the start of every command on the lent GPU machine (it has no package registry):
#   . scripts/device/setup.sh
# with carry [".whl", ".whl-tf", ".device"] on a fresh machine, plus ".whl-nb" for papermill or
# `kvlab report` (scripts/device/build-carry.sh builds them here). It installs the carried wheels
# (optimum-quanto, gguf, hqq, einops, termcolor, pydantic and its parts; with .whl-nb papermill, the
# kernel stack and plotly) into /tmp/site and
# transformers 5.24 (FP8 needs >= 5.21; the machine has 5.17) into /tmp/site-tf, both ahead of the
# machine's packages on PYTHONPATH. On a warm machine (an earlier call of this session left
# /tmp/site) it installs nothing, so optimum-quanto's CUDA extension built by that call survives:
# reinstalling the package would delete its build folder and cost the ~90 s JIT build again.
_ready=/tmp/site/.kvlab-ready
if [ ! -f "$_ready" ]; then
  [ -d .whl ] || { echo "setup.sh: fresh machine and no .whl/ carried: run \`bash scripts/device/build-carry.sh\` on your machine, then carry [\".whl\", \".whl-tf\", \".device\"]" >&2; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
  if [ -d .whl-tf ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-tf .whl-tf/*.whl || return 1
  fi
  touch "$_ready"
fi
# the notebook stack (papermill, Jupyter, plotly) when carried, once per machine, with its own mark:
# a warm machine whose first call carried only .whl/ installs it when a later call brings it
if [ -d .whl-nb ] && [ ! -f /tmp/site/.kvlab-ready-nb ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-nb/*.whl \
    && touch /tmp/site/.kvlab-ready-nb || return 1
fi
unset _ready
# Without .device/quanto_cuda_build.tgz nothing happens here and quanto JIT-builds its CUDA
# extension (~90 s) the first time a quanto cache runs; `campaign.sh quanto-build` packs that build
# into $OUT for .device/ (build-carry.sh says how).
# A quanto build from an earlier machine (same image and torch), when carried and none is here yet
# (also on a warm machine whose earlier calls could not carry it): the archive keeps its mtimes and
# the fresh sources are dated back, so ninja's deps log finds nothing newer and nothing to rebuild.
_ext=/tmp/site/optimum/quanto/library/extensions/cuda
if [ -f .device/quanto_cuda_build.tgz ] && [ ! -f "$_ext/build/quanto_cuda.so" ]; then
  find "$_ext" -type f \( -name '*.cu' -o -name '*.cpp' -o -name '*.h' -o -name '*.cuh' \) -exec touch -d '2000-01-01' {} +
  tar xzf .device/quanto_cuda_build.tgz -C "$_ext" && echo "setup.sh: restored quanto's CUDA build"
fi
unset _ext
export PYTHONPATH=/tmp/site-tf:/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export KVLAB_GIT_SHA=${KVLAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
