"""Print the fastest correct int4-g64 decode kernel variant at batch 16 in a quant_attention.py JSON
(``split`` when none ran): what the engine benchmark then runs with ``--kernel-variant``."""

import json
import sys

rows = json.load(open(sys.argv[1])).get("performance", [])
ok = [r for r in rows if r.get("status") == "ok" and r["label"] == "int4-g64" and r["batch"] == 16
      and r["rel_err"] <= 2e-2]
print(min(ok, key=lambda r: r["kernel_ms"])["variant"] if ok else "split")
