"""Quest 512 and KIVI K2V2's continuation fidelity at 4k with the code before commit 378af0b (the
chunk read as one block): run from a checkout of main at d14cafe.

    cd <checkout of d14cafe> && PYTHONPATH=. python .../before_fix_continuation.py 4096
"""

import json
import sys

import kvlab
from kvlab.models import load_model
from kvlab.policies import make_policy
from kvlab.policies.base import attached
from kvlab.quality import TaskSpec
from kvlab.quality.continuation import run_continuation

print(kvlab.__file__, file=sys.stderr)
loaded = load_model("smollm2-135m", device="cpu")
pols = [make_policy("quest", budget=512), make_policy("kivi")]
spec = TaskSpec(tasks=["continuation"], lengths=[int(sys.argv[1])], samples=1, continuation_tokens=128)
with attached(pols, loaded.model):
    for r in run_continuation(loaded, pols, spec):
        print(json.dumps({k: r.get(k) for k in ("label", "length", "kl", "top1_agree", "score")}), flush=True)
