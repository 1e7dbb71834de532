"""KL between Qwen2.5-Coder-1.5B with its converted float32 weights and the same weights rounded to bf16
(what bf16 storage of the converted copy would give a float32 CPU run), on kvlab's continuation item
(1024 context tokens + 128 continuation tokens, seed 0), teacher-forced in one forward.

    python scripts/bf16_storage_kl.py

Why: storing the converted copy in bf16 would halve its disk (7.1 GB float32); this says what it
would cost a float32 CPU run in fidelity. (A bf16 GPU run reads the same rounded weights either way.)
"""
import time

import torch

from kvlab.models import load_model
from kvlab.quality.continuation import continuation_items
from kvlab.tasks import Encoder

m = load_model("qwen2.5-coder-1.5b")
item = continuation_items(Encoder(m.tokenizer), [1024], 1, 128, [], 0)[0]
ids = torch.tensor([list(item.context_ids) + list(item.continuation_ids)])
n = len(item.continuation_ids)
with torch.no_grad():
    t = time.monotonic()
    ref = m.model(ids).logits[0, -n:].log_softmax(-1)
    print(f"forward {ids.shape[1]} tokens: {time.monotonic() - t:.1f} s")
    rel = []
    for p in m.model.parameters():
        r = p.to(torch.bfloat16).float()
        rel.append(((r - p).norm() / p.norm().clamp_min(1e-30)).item())
        p.copy_(r)
    got = m.model(ids).logits[0, -n:].log_softmax(-1)
kl = (ref.exp() * (ref - got)).sum(-1)
print(f"weights rel. error (median/max over tensors): {sorted(rel)[len(rel)//2]:.2e} / {max(rel):.2e}")
print(f"KL(f32 || bf16-rounded) per continuation token: mean {kl.mean():.2e}, max {kl.max():.2e}; "
      f"top-1 agreement {(ref.argmax(-1) == got.argmax(-1)).float().mean():.3f}")
