#!/usr/bin/env bash
# Build the folders scripts/device/setup.sh installs on the lent GPU machine (it has no package
# registry), from this machine's PyPI access:
#
#   bash scripts/device/build-carry.sh          # from the project root; then carry
#                                               # [".whl", ".whl-tf", ".device"] in the first call
#
#   .whl/     wheels the machine lacks (CPython 3.12, manylinux x86_64): optimum-quanto, gguf, hqq
#             (PyPI has only its sdist: built here with `pip wheel --no-deps`, it is pure Python),
#             einops, termcolor, pydantic and its parts, papermill and the Jupyter kernel stack,
#             plotly. The machine already has torch, numpy, pandas, pyarrow, pyyaml, tqdm,
#             safetensors, accelerate, tokenizers (2026-11: torch 2.11, transformers 5.17).
#   .whl-tf/  transformers 5.24 (kvlab needs >= 5.17 < 5.25; FP8 needs >= 5.21), installed by
#             setup.sh into its own folder ahead of the machine's copy on PYTHONPATH.
#   .device/  quanto_cuda_build.tgz, optimum-quanto's prebuilt CUDA extension. It can only be built
#             on the GPU machine: without it setup.sh installs nothing there and quanto JIT-builds
#             the extension (about 90 s, once per machine) the first time a quanto cache runs. To
#             keep that build, run `bash scripts/device/campaign.sh quanto-build` in a device call
#             (it packs $OUT/quanto_cuda_build.tgz and checks it restores), then copy the returned
#             file into .device/ here; later calls carrying it skip the build.
#
# The three folders are git-ignored (.gitignore); together they must stay under the device tool's
# 64 MiB carry limit with the rest of the working tree (about 45 MB today). Rerunning replaces
# .whl/ and .whl-tf/ and keeps .device/. Versions below are those the H200 campaign ran with.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
whl=${WHEEL_DIR:-.whl}
whl_tf=${WHEEL_TF_DIR:-.whl-tf}
target=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux1_x86_64)
pkgs=(
  optimum-quanto==0.2.7 gguf einops termcolor
  papermill nbclient nbformat jupyter_client jupyter_core ipykernel pyzmq traitlets tornado
  fastjsonschema jsonschema jsonschema-specifications referencing rpds-py entrypoints tenacity
  ansicolors ipython ipython_pygments_lexers debugpy matplotlib-inline nest-asyncio decorator
  jedi parso pexpect ptyprocess prompt_toolkit wcwidth stack_data executing asttokens pure_eval
  comm ipywidgets widgetsnbextension jupyterlab_widgets platformdirs
  plotly narwhals
  pydantic pydantic-core annotated-types typing-inspection
)
rm -rf "$whl" "$whl_tf"
mkdir -p "$whl" "$whl_tf" .device
echo "build-carry: downloading ${#pkgs[@]} wheels into $whl/"
for p in "${pkgs[@]}"; do
  "$py" -m pip download -q --no-deps --only-binary=:all: "${target[@]}" -d "$whl" "$p"
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
du -sh "$whl" "$whl_tf" .device
