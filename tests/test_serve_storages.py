"""Quest and KIVI served over block tables, token for token what the static hf engine decodes: Quest keeps
every block and reads the selected pages (bounds per block beside the pool); KIVI stores key groups of
one block each, with each request's bf16 tail beside the pool."""

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
    assert engine.pool.kmin.shape[:2] == (tiny32.spec.num_layers, 33)  # bounds per block (and the spare) beside the pool


def test_quest_in_a_batch_with_chunked_prefill_and_preemption_keeps_each_requests_tokens(tiny32):
    """Chunks of 24 tokens, a pool too small for all four: requests are preempted and their generated
    tokens re-fed, read row by row as their decode steps read them."""
    ps = prompts(4)
    engine = make_serving_engine(tiny32, "quest", num_blocks=40, block_size=4, max_num_batched_tokens=24, **QUEST)
    got = served(engine, ps, 14)
    assert engine.stats()["preemptions_total"] > 0
    assert got == [static_hf(tiny32, "quest", p, 14, **QUEST) for p in ps]
    assert engine.stats()["blocks_used"] == 0


KIVI = {"residual_length": 16, "q_group_size": 16, "value_group": 16}  # groups flush inside the prompt and while decoding


def test_kivi_alone_decodes_the_static_hf_engines_tokens_and_frees_its_blocks(tiny32):
    prompt = prompts(1, n=50)[0]
    engine = make_serving_engine(tiny32, "kivi", num_blocks=16, block_size=16, **KIVI)
    got = served(engine, [prompt], 24)[0]
    assert got == static_hf(tiny32, "kivi", prompt, 24, **KIVI)
    assert got != static_hf(tiny32, "full", prompt, 24)  # the 2-bit groups change the tokens
    assert engine.stats()["blocks_used"] == 0


def test_kivi_preempted_requests_re_fed_in_one_chunk_keep_their_tokens(tiny32):
    """Prompts whole in one chunk (the static prefill's exact read); generated tokens re-fed after a
    preemption are read row by row as their decode steps read them."""
    ps = prompts(3, n=50)
    engine = make_serving_engine(tiny32, "kivi", num_blocks=9, block_size=16, max_num_batched_tokens=1024, **KIVI)
    got = served(engine, ps, 30)
    assert engine.stats()["preemptions_total"] > 0
    assert got == [static_hf(tiny32, "kivi", p, 30, **KIVI) for p in ps]
    assert engine.stats()["blocks_used"] == 0
