"""Made reports/cpu-quality-kvq-2026-12-03/records.jsonl (the `kvlab quality` machinery, driven from
Python because the CLI cannot pass q_group_size per method):

    PYTHONPATH=. python reports/cpu-quality-kvq-2026-12-03/run.py SAMPLES LENGTHS [PART]

LENGTHS is comma-separated; PART (optional) writes to PART/records.jsonl under this folder, so two
lengths can run side by side and be concatenated afterwards.
"""

import sys
from pathlib import Path

from kvlab.models import load_model
from kvlab.policies import make_policy
from kvlab.quality import TaskSpec, run_quality, summarize
from kvlab.records import RECORDS_FILE, RecordWriter, write_manifest

here = Path(__file__).parent
samples = int(sys.argv[1]) if len(sys.argv) > 1 else 2
lengths = [int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 else [2048, 4096]
out = here / sys.argv[3] if len(sys.argv) > 3 else here
out.mkdir(exist_ok=True)
spec = TaskSpec(tasks=["niah_single"], lengths=lengths, depths=[0.5], samples=samples, seed=0)
policies = [
    make_policy("kvq-fp8"),
    make_policy("kvq-int4", q_group_size=32),
    make_policy("kvq-int4", q_group_size=64),
    make_policy("quanto", nbits=4),  # q_group_size 64, residual 128 (bf16 window of recent tokens)
    make_policy("hqq", nbits=4),
    make_policy("fp8"),  # transformers' per-tensor fp8
]
loaded = load_model("smollm2-135m", device="cpu")
write_manifest(out, {"kind": "quality", "model": loaded.provenance(), "task_spec": spec.model_dump(),
                     "methods": [p.params() for p in policies]})
with RecordWriter(out / RECORDS_FILE) as writer:
    records = run_quality(loaded, policies, spec, writer, base={"sweep": here.name},
                          progress=lambda msg: print(msg, file=sys.stderr, flush=True))
summary = summarize(records)
cols = [c for c in ("task", "length", "label", "n", "no_signal", "score", "score_diff", "gold_nll", "kl",
                    "top1_agree") if c in summary.columns]
print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
summary.to_csv(out / "quality_summary.csv", index=False)
