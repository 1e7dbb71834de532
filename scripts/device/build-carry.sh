#!/usr/bin/env bash
# Build the folders scripts/device/setup.sh installs on the lent GPU machine (it has no package
# registry), from this machine's PyPI access:
#
#   bash scripts/device/build-carry.sh          # from the project root; then carry
#                                               # [".whl", ".whl-tf", ".device"] in the first call
#                                               # (+ ".whl-nb" for papermill or `kvlab report`)
#   bash scripts/device/build-carry.sh ray      # only .whl-ray/ (issue #17's Ray comparison)
#
#   .whl/     wheels the machine lacks (CPython 3.12, manylinux x86_64) that sweeps, benchmarks and
#             Ray need (about 4 MB): optimum-quanto, gguf, hqq (PyPI has only its sdist: built here
#             with `pip wheel --no-deps`, it is pure Python), einops, termcolor, pydantic and its
#             parts, jsonschema and its parts. The machine already has torch, numpy, pandas, pyarrow,
#             pyyaml, tqdm, safetensors, accelerate, tokenizers (2026-11: torch 2.11, transformers 5.17).
#   .whl-nb/  papermill, the Jupyter kernel stack, ipywidgets and plotly (about 27 MB): carry it only
#             for notebook and report calls, so that a sweep's call has room for .device/ and its
#             records (.whl + .whl-tf + .device + the tree come to about 42 MB).
#   .whl-tf/  transformers 5.24 (kvlab needs >= 5.17 < 5.25; FP8 needs >= 5.21), installed by
#             setup.sh into its own folder ahead of the machine's copy on PYTHONPATH.
#   .device/  quanto_cuda_build.tgz, optimum-quanto's prebuilt CUDA extension. It can only be built
#             on the GPU machine: without it setup.sh installs nothing there and quanto JIT-builds
#             the extension (about 90 s, once per machine) the first time a quanto cache runs. To
#             keep that build, run `bash scripts/device/campaign.sh quanto-build` in a device call
#             (it packs $OUT/quanto_cuda_build.tgz and checks it restores), then copy the returned
#             file into .device/ here; later calls carrying it skip the build.
#   .whl-ray/ ray-site.tar.xz (15.3 MB): ray 2.60.0's cp312 wheel (79 MB, over one call's
#             64 MiB) unpacked, minus what `ray.init()`, tasks and actors on one machine never load
#             (scripts/device/ray-prune.txt: Java jars, rllib, tune, train, serve, data, llm, air,
#             the dashboard's web frontend, cloud autoscaler providers), its ELF files stripped of
#             symbol tables, as one tar.xz (x86 BCJ filter and a 128 MiB dictionary, so raylet,
#             gcs_server and _raylet.so share one window). scripts/device/setup-ray.sh unpacks it
#             into /tmp/raysite. Ray's other needs are on the machine (click, filelock, msgpack,
#             packaging, protobuf, pyyaml, requests, psutil, aiohttp) or in .whl/ (jsonschema,
#             referencing, rpds-py). Only `build-carry.sh ray` builds it (RAY_PY=3.11 RAY_DIR=DIR
#             builds a copy for this machine's Python, to try the pruning here; tests/test_ray_carry.py
#             checks the list against the installed ray).
#
# The folders are git-ignored (.gitignore); those carried in one call must stay under the device
# tool's 64 MiB (67.1 MB) with the rest of the working tree: .whl, .whl-tf and the tree came to
# about 49.6 MB on 2026-12-03, and 65 MB with .whl-ray. Rerunning replaces .whl/ and .whl-tf/ (or
# with `ray`, .whl-ray/) and keeps .device/. Versions below are those the H200 campaign ran with.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
whl=${WHEEL_DIR:-.whl}
whl_tf=${WHEEL_TF_DIR:-.whl-tf}
whl_nb=${WHEEL_NB_DIR:-.whl-nb}
target=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux1_x86_64)
pkgs=(  # .whl/: what sweeps, benchmarks and Ray need
  optimum-quanto==0.2.7 gguf einops termcolor
  jsonschema jsonschema-specifications referencing rpds-py
  pydantic pydantic-core annotated-types typing-inspection
)
nb_pkgs=(  # .whl-nb/: papermill, the Jupyter kernel stack, widgets and plotly (notebooks, reports)
  papermill nbclient nbformat jupyter_client jupyter_core ipykernel pyzmq traitlets tornado
  fastjsonschema entrypoints tenacity
  ansicolors ipython ipython_pygments_lexers debugpy matplotlib-inline nest-asyncio decorator
  jedi parso pexpect ptyprocess prompt_toolkit wcwidth stack_data executing asttokens pure_eval
  comm ipywidgets widgetsnbextension jupyterlab_widgets platformdirs
  plotly narwhals
)

build_ray() {
  local version=${RAY_VERSION:-2.60.0} pyver=${RAY_PY:-3.12} dir=${RAY_DIR:-.whl-ray}
  local tmp
  tmp=$(mktemp -d)
  echo "build-carry: downloading ray $version (cp${pyver/./}) into $tmp"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${target[@]:4}" -d "$tmp/wheel" "ray==$version"
  mkdir -p "$tmp/site"
  "$py" -m zipfile -e "$tmp"/wheel/ray-*.whl "$tmp/site"
  local r=$tmp/site/ray
  chmod 755 "$r"/core/src/ray/raylet/raylet "$r"/core/src/ray/gcs/gcs_server  # zipfile drops modes
  local path
  while read -r path; do  # what a local cluster with tasks and actors never imports
    case $path in ''|'#'*) continue ;; esac
    rm -rf "$tmp"/site/$path  # unquoted: the list may hold globs
  done < scripts/device/ray-prune.txt
  find "$tmp/site" -name '__pycache__' -prune -exec rm -rf {} +
  if command -v strip >/dev/null; then  # symbol tables only: dynamic symbols stay, as loaders need
    find "$tmp/site" -type f \( -name '*.so' -o -name 'raylet' -o -name 'gcs_server' \) \
      -exec strip --strip-unneeded {} +
  else
    echo "build-carry: no strip here (binutils): the archive is about 10 MiB larger" >&2
  fi
  mkdir -p "$dir"
  rm -f "$dir/ray-site.tar.xz"
  tar --sort=name --mtime=2000-01-01 --owner=0 --group=0 --numeric-owner -C "$tmp/site" -cf - . \
    | xz --x86 --lzma2=preset=9e,dict=128MiB -T1 > "$dir/ray-site.tar.xz"
  echo "build-carry: $dir/ray-site.tar.xz ($(du -m "$dir/ray-site.tar.xz" | cut -f1) MiB, unpacks to $(du -sm "$tmp/site" | cut -f1) MiB)"
  rm -rf "$tmp"
}
if [ "${1:-}" = ray ]; then
  build_ray
  exit 0
fi

rm -rf "$whl" "$whl_nb" "$whl_tf"
mkdir -p "$whl" "$whl_nb" "$whl_tf" .device
echo "build-carry: downloading ${#pkgs[@]} wheels into $whl/ and ${#nb_pkgs[@]} into $whl_nb/"
for p in "${pkgs[@]}"; do
  "$py" -m pip download -q --no-deps --only-binary=:all: "${target[@]}" -d "$whl" "$p"
done
for p in "${nb_pkgs[@]}"; do
  "$py" -m pip download -q --no-deps --only-binary=:all: "${target[@]}" -d "$whl_nb" "$p"
done
echo "build-carry: building hqq's wheel from its sdist (PyPI has no wheel)"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$whl" "hqq==0.2.8.post1" \
  || "$py" -m pip wheel -q --no-deps -w "$whl" "hqq==0.2.8.post1"
echo "build-carry: downloading transformers into $whl_tf/"
"$py" -m pip download -q --no-deps --only-binary=:all: "${target[@]}" -d "$whl_tf" "transformers==5.24.0"
if [ -f .device/quanto_cuda_build.tgz ]; then
  echo "build-carry: .device/quanto_cuda_build.tgz kept"
else
  echo "build-carry: no .device/quanto_cuda_build.tgz: quanto builds its CUDA extension on the GPU machine" \
       "(about 90 s once); keep it with \`bash scripts/device/campaign.sh quanto-build\` (see above)"
fi
du -sh "$whl" "$whl_nb" "$whl_tf" .device
