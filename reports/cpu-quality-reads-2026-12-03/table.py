"""Print the README's tables from records.jsonl (quality records only; one item per cell)."""

import json
from pathlib import Path

rows = [json.loads(line) for line in open(Path(__file__).parent / "records.jsonl")]
quality = [r for r in rows if r.get("kind") == "quality"]
labels = list(dict.fromkeys(r["label"] for r in quality))


def mean(rs, col):
    return sum(r[col] for r in rs) / len(rs)


def cell(task, length, label):
    return [r for r in quality if r["task"] == task and r["length"] == length and r["label"] == label]


print("| length | storage | bytes/token/layer | needle 0.1 / 0.5 / 0.9 | needle score | needle KL | needle top-1 "
      "| cont. KL | cont. top-1 | cont. U |")
print("|---|---|---|---|---|---|---|---|---|---|")
for length in (2048, 4096):
    for label in labels:
        needle = sorted(cell("niah_single", length, label), key=lambda r: r["depth"])
        cont = cell("continuation", length, label)[0]
        per_tok = needle[0]["cache_bytes"] / needle[0]["cache_physical_tokens"] / 30
        hits = " / ".join(f"{r['score']:.0f}" for r in needle)
        print(f"| {length} | {label} | {per_tok:.0f} | {hits} | {mean(needle, 'score'):.2f} | "
              f"{mean(needle, 'kl'):.3f} | {mean(needle, 'top1_agree'):.2f} | {cont['kl']:.3f} | {cont['top1_agree']:.2f} | {cont['score']:.2f} |")
print()
print("Misses (prediction vs reference):")
for r in quality:
    if r["task"] == "niah_single" and r["score"] < 1:
        print(f"- {r['length']} depth {r['depth']} {r['label']}: {r['prediction'].strip()[:40]!r} for {r['references'][0]}")
