"""The quality pass (kvlab.quality.run_quality, what `kvlab quality` runs) over method variants the CLI's
--methods cannot name (a method's parameters): SmolLM2-135M, CPU, 1k continuation and needle.

    python reports/cpu-quality-codecs-2026-12-07/variants.py OUT_DIR
"""

import sys
from pathlib import Path

from kvlab import models
from kvlab.engine.engines import make_engine
from kvlab.policies import make_policy
from kvlab.quality import TaskSpec, run_quality, summarize
from kvlab.records import RECORDS_FILE, RecordWriter, load_records, recorded_run_ids

VARIANTS = [("full", {}), ("kvq-int2", {}), ("nvfp4", {"four_over_six": True}),
            ("turboquant", {"variant": "4bit"}), ("turboquant", {"variant": "3bit"}), ("turboquant", {"variant": "k8v4"}),
            ("kvq-rot", {"format": "int2-g64"}), ("kvq-rot", {"format": "int4-g32"}), ("kvq-int4", {"q_group_size": 32})]

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
spec = TaskSpec(tasks=["continuation", "niah_single"], lengths=[1024], samples=1)
loaded = models.load_model("smollm2-135m", device="cpu")
policies = [make_policy(m, **p) for m, p in VARIANTS]
with RecordWriter(out / RECORDS_FILE) as writer:
    run_quality(loaded, policies, spec, writer, base={"sweep": out.name, "weights_quant": "none"},
                skip=recorded_run_ids(out, statuses={"ok"}), engine=make_engine("hf", loaded), progress_bar=False)
summary = summarize(load_records(out, kind="quality"))
summary.to_csv(out / "quality_summary.csv", index=False)
print(summary.to_string(index=False))
