"""Per (dtype, length, method): mean summed gold NLL over depths for hf, fast, hf1 and the pre-7d8a016 fast protocol
(question over the exact prefill cache -> first gold token scored as full; the rest through hf's KVQ layers)."""
import glob
import statistics as st
import sys

import torch
import torch.nn.functional as F

d = sys.argv[1] if len(sys.argv) > 1 else "logits"
tok = {}
for f in glob.glob(f"{d}/*.pt"):
    tag, eng, meth, L, dep = f.rsplit("/", 1)[1][:-3].split("_")
    x = torch.load(f)
    tok[(tag, eng, meth, int(L), float(dep))] = F.cross_entropy(x["logits"], torch.tensor(x["answer"]), reduction="none")
cells = sorted({(k[0], k[3], k[2]) for k in tok})
print("dtype     length method     n   full    hf    fast   hf1  | fast-hf  sd(item)  hf1-hf sd(item) | old-protocol fast  old-hf")
for tag, L, m in cells:
    deps = sorted({k[4] for k in tok if k[0] == tag and k[3] == L and k[2] == m and (tag, "hf", m, L, k[4]) in tok and (tag, "fast", m, L, k[4]) in tok})
    if not deps:
        continue
    def g(e, mm=m, tag=tag, L=L, deps=deps):
        return [tok[(tag, e, mm, L, dp)].sum().item() if (tag, e, mm, L, dp) in tok else float("nan") for dp in deps]
    hf, fast, hf1, full = g("hf"), g("fast"), g("hf1"), g("hf", "full")
    old = [tok[(tag, "hf", "full", L, dp)][0].item() + tok[(tag, "hf", m, L, dp)][1:].sum().item()
           if (tag, "hf", "full", L, dp) in tok else float("nan") for dp in deps]
    dfh = [a - b for a, b in zip(fast, hf, strict=False)]
    d1 = [a - b for a, b in zip(hf1, hf, strict=False)]
    def sd(v):
        return st.stdev(v) if len(v) > 1 and all(x == x for x in v) else float("nan")
    mean = st.fmean
    print(f"{tag:9s} {L:6d} {m:9s} {len(deps):2d} {mean(full):6.3f} {mean(hf):6.3f} {mean(fast):6.3f} {mean(hf1):6.3f} | {mean(dfh):+7.3f} {sd(dfh):8.3f} {mean(d1):+7.3f} {sd(d1):7.3f} | {mean(old):6.3f} {mean(old)-mean(hf):+7.3f}")
