"""Print the README's table from records.jsonl: per length and storage, mean over samples."""

import json
from collections import defaultdict
from pathlib import Path


def mean(rs, col):
    return sum(r[col] for r in rs) / len(rs)


rows = [json.loads(line) for line in open(Path(__file__).parent / "records.jsonl")]
cells = defaultdict(list)
order = []
for r in rows:
    key = (r["length"], r["label"])
    if key not in cells:
        order.append(key)
    cells[key].append(r)
print("| length | storage | bytes/token/layer (K+V) | n | needle score | KL(full ‖ q) | top-1 agree | gold NLL |")
print("|---|---|---|---|---|---|---|---|")
for key in sorted(order, key=lambda k: (k[0], order.index(k))):
    rs = cells[key]
    per_tok = rs[0]["cache_bytes"] / rs[0]["cache_physical_tokens"] / 30 if rs[0]["cache_physical_tokens"] else 0
    print(f"| {key[0]} | {key[1]} | {per_tok:.0f} | {len(rs)} | {mean(rs, 'score'):.2f} | {mean(rs, 'kl'):.4f} | "
          f"{mean(rs, 'top1_agree'):.2f} | {mean(rs, 'gold_nll'):.3f} |")
