"""The same work through a Triton kernel (the interpreter on CPU) and through its torch reference, for
tests that check a kernel path end to end: the fast engine's decode by kernel backend, and a serving
engine's logits by attention path."""

from __future__ import annotations

import torch
from tiny_models import load_tiny_d32

from kvlab.engine.fast import FastEngine
from kvlab.engine.generation import prefill
from kvlab.serve.engine import Request, make_serving_engine


def fast_decode_by_backend(policy) -> dict[str, tuple[torch.Tensor, str]]:
    """``{backend: (6 greedy tokens of 2 prompts of 40, the store's attention)}`` for backends
    'triton' (the kernel) and 'auto' (the reference on CPU), on the tiny d32 model."""
    loaded = load_tiny_d32()
    prompt = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    out = {}
    for backend in ("triton", "auto"):
        engine = FastEngine(loaded)
        engine.kernel_backend = backend
        with policy.attach(loaded, warm=False):
            decoder = engine.decoder(policy, 2, 40, 6)
            prefilled = decoder.prefill_cache()
            first = prefill(loaded.model, prompt, prefilled)[:, -1].argmax(-1)
            decoder.load(prefilled)
            out[backend] = (decoder.decode(first, 6, 40), decoder.store.attention)
    return out


def serving_logits_by_attention(method: str, params: dict, new_tokens: int):
    """Three requests (prompts of several chunks) through a serving engine on the tiny d32 model with
    ``attention`` 'reference' and 'triton': ``({attention: every forward's logits}, the pool's decode
    outputs over both runs)``."""
    tiny32 = load_tiny_d32()
    logits, kernel_rows = {}, []
    for attention in ("reference", "triton"):
        engine = make_serving_engine(tiny32, method, num_blocks=24, block_size=16, max_num_batched_tokens=32,
                                     attention=attention, **params)
        got = []
        engine.runner.forward = recording(engine.runner.forward, got)
        engine.pool.decode = recording(engine.pool.decode, kernel_rows)
        for i in range(3):
            engine.add(Request(f"q{i}", list(range(5 + 9 * i, 30 + 11 * i)), new_tokens, 0.0))
        while engine.has_work():
            engine.step()
        logits[attention] = got
    return logits, kernel_rows


def recording(fn, out: list):
    """``fn`` that also appends a copy of each result to ``out``."""
    def run(*args):
        result = fn(*args)
        out.append(result.clone())
        return result
    return run
