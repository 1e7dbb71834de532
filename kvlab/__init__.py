"""kvlab: measure what KV-cache compression does to memory, time, energy and quality."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# torch's OpenMP threads spin while they wait for work (libgomp's default). On a CPU shared with
# other processes a spinning thread holds a core its sibling needs, and a 2-thread SmolLM2 run at
# 256 tokens took 20 s instead of 3 s (8.5 CPU s instead of 1.5; load 5-7 on 2 cores).
# Passive waiting is read once, when torch loads libgomp: set it before that, unless the user chose.
# Records carry it (manifest env: omp_wait_policy).
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
