"""How far the fast engine's logits are from transformers' on the same tokens (teacher-forced).

Both engines prefill the same prompt through the policy's cache; ``hf`` then greedy-decodes
``steps`` tokens and keeps every step's logits; the fast step is fed the very same tokens (so one
early disagreement does not change every later context) and its logits are compared step by step.
The fast step runs eagerly: a captured graph replays the same kernels. Where the engines pick
different tokens, the reference's top-1 minus top-2 logit at that step is kept
(``margins_where_disagree``), so a near-tie (rounding) can be told from a real divergence.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.engine.fast import FastEngine
from kvlab.engine.generation import forward, prefill
from kvlab.policies.base import hf_model


@torch.no_grad()
def compare_engines(loaded, policy, input_ids: torch.Tensor, steps: int) -> dict[str, Any]:
    model = hf_model(loaded)
    bsz, ctx = input_ids.shape
    cache = policy.make_cache(model)
    token = prefill(model, input_ids, cache)[:, -1].argmax(-1, keepdim=True)
    fed, ref = [], []
    for i in range(steps):
        fed.append(token)
        logits = forward(model, token, cache, torch.full((bsz, 1), ctx + i, device=token.device)).logits[:, -1]
        ref.append(logits.float())
        token = logits.argmax(-1, keepdim=True)
    del cache

    engine = FastEngine(model, capture=False, max_decoders=1)
    decoder = engine.decoder(policy, bsz, ctx, steps)
    fast_cache = decoder.prefill_cache()
    prefill(model, input_ids, fast_cache)
    decoder.load(fast_cache)
    del fast_cache
    agree, err, scale, margins = [], 0.0, 0.0, []
    for i in range(steps):
        position = torch.full((bsz, 1), ctx + i, device=input_ids.device)
        logits = decoder.step_fn(fed[i], position, decoder.store)[:, :].float()
        decoder.store.advance()
        same = logits.argmax(-1) == ref[i].argmax(-1)
        agree.append(same.float().mean().item())
        top2 = ref[i].topk(2, dim=-1).values
        margins += (top2[:, 0] - top2[:, 1])[~same].tolist()
        err = max(err, (logits - ref[i]).abs().max().item())
        scale = max(scale, ref[i].abs().max().item())
    return {"steps": steps, "top1_agree": sum(agree) / len(agree), "max_abs_logit_err": err,
            "max_abs_logit": scale, "margins_where_disagree": [round(m, 4) for m in margins]}
