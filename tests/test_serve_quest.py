"""Quest served over block tables: every block kept, each decode step reading only the selected pages
(page bounds per block beside the pool), token for token what the static hf engine's Quest decodes."""

from __future__ import annotations

import pytest
import torch
from tiny_models import load_tiny_d32

from kvlab.engine.generation import greedy_decode, prefill
from kvlab.policies import make_policy
from kvlab.serve.engine import Request, make_serving_engine

QUEST = {"page": 4, "budget": 8, "dense_layers": 0}  # 2 pages of 4 read per step: sparse at 40 tokens


@pytest.fixture(scope="module")
def tiny32():
    return load_tiny_d32()


def static_hf(loaded, method, prompt, n, **params):
    policy = make_policy(method, **params)
    ids = torch.tensor([prompt])
    with policy.attach(loaded, warm=False):
        cache = policy.make_cache(loaded.model)
        first = prefill(loaded.model, ids, cache)[:, -1].argmax(-1)
        return greedy_decode(loaded.model, cache, first, n, len(prompt))[0].tolist()


def served(engine, prompts, n):
    for i, p in enumerate(prompts):
        engine.add(Request(f"q{i}", p, n, 0.0))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev.token_id)
    return [out[f"q{i}"] for i in range(len(prompts))]


def prompts(k, n=40):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (n + 5 * i,), generator=g).tolist() for i in range(k)]


def test_quest_alone_decodes_the_static_hf_engines_tokens_and_frees_its_blocks(tiny32):
    prompt = prompts(1)[0]
    engine = make_serving_engine(tiny32, "quest", num_blocks=32, block_size=4, **QUEST)
    got = served(engine, [prompt], 16)[0]
    assert got == static_hf(tiny32, "quest", prompt, 16, **QUEST)
    assert got != static_hf(tiny32, "full", prompt, 16)  # the read really is sparse
    assert engine.stats()["blocks_used"] == 0 and engine.allocator.free == 32
    assert engine.pool.kmin.shape[:2] == (tiny32.spec.num_layers, 32)  # bounds per block beside the pool


def test_quest_in_a_batch_with_chunked_prefill_and_preemption_keeps_each_requests_tokens(tiny32):
    """Chunks of 24 tokens, a pool too small for all four: requests are preempted and their generated
    tokens re-fed, read row by row as their decode steps read them."""
    ps = prompts(4)
    engine = make_serving_engine(tiny32, "quest", num_blocks=40, block_size=4, max_num_batched_tokens=24, **QUEST)
    got = served(engine, ps, 14)
    assert engine.stats()["preemptions_total"] > 0
    assert got == [static_hf(tiny32, "quest", p, 14, **QUEST) for p in ps]
    assert engine.stats()["blocks_used"] == 0
