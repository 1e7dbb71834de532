"""The README's table from records.jsonl: per method, the needle score and gold NLL at each length,
continuation KL(full || method), top-1 agreement and context utility U at each length, and the KV
rows the needle items kept per layer and head (padded, for head-adaptive budgets) against the full cache.

    python reports/cpu-quality-methods-2026-12-03/table.py
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
rows = [json.loads(line) for line in (HERE / "records.jsonl").read_text().splitlines() if line.strip()]
quality = [r for r in rows if r.get("kind") == "quality" and r.get("status") == "ok"]
labels = list(dict.fromkeys(r["label"] for r in sorted(quality, key=lambda r: (r["method"] != "full", -(r["keep"] or 1),
                                                                                r["label"]))))
lengths = sorted({r["length"] for r in quality})


def one(label, task, length):
    found = [r for r in quality if r["label"] == label and r["task"] == task and r["length"] == length]
    return found[0] if found else None


def cell(rec, key, spec):
    return "" if rec is None or rec.get(key) is None else format(rec[key], spec)


head = ["method"]
for n in lengths:
    k = f"{n // 1024}k"
    head += [f"needle {k}", f"gold NLL {k}", f"KV rows {k}", f"KL {k}", f"top-1 {k}", f"U {k}"]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for label in labels:
    out = [label]
    for n in lengths:
        needle, cont = one(label, "niah_single", n), one(label, "continuation", n)
        full = one("full", "niah_single", n)
        rows_kept = "" if needle is None or full is None else (
            f"{needle['cache_physical_tokens']:.0f} / {full['cache_physical_tokens']:.0f}")
        out += [cell(needle, "score", ".0f"), cell(needle, "gold_nll", ".2f"), rows_kept, cell(cont, "kl", ".3f"),
                cell(cont, "top1_agree", ".2f"), cell(cont, "score", ".2f")]
    print("| " + " | ".join(out) + " |")
