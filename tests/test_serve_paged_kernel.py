"""The Triton paged decode kernel against the torch reference (the Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvlab.serve.forward import paged_decode_reference


@pytest.mark.parametrize("hq, hkv, dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 16), (8, 2, 16, 32)])
def test_paged_decode_kernel_matches_the_reference(hq, hkv, dim, block_size):
    from kvlab.serve.paged_triton import paged_decode

    gen = torch.Generator().manual_seed(0)
    num_blocks, lengths = 12, torch.tensor([1, 17, 40, 5], dtype=torch.int32)
    k = torch.randn(num_blocks * block_size, hkv, dim, generator=gen)
    v = torch.randn(num_blocks * block_size, hkv, dim, generator=gen)
    q = torch.randn(len(lengths), hq, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)  # scattered blocks, as a pool hands them out
    width = -(-int(lengths.max()) // block_size)
    tables = torch.stack([perm[(3 * i) % (num_blocks - width):][:width] for i in range(len(lengths))]).to(torch.int32)
    ref = paged_decode_reference(q, k, v, tables, lengths, block_size, 0.125)
    got = paged_decode(q, k, v, tables, lengths, block_size, 0.125)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method, params", [("full", {}), ("snapkv", {"keep": 0.5, "window_size": 4})])
def test_the_engine_with_the_paged_kernel_gives_the_reference_tokens(tiny, method, params):
    from kvlab.serve.engine import Request, make_serving_engine

    tokens = {}
    for attention in ("reference", "triton"):
        engine = make_serving_engine(tiny, method, num_blocks=16, block_size=16, max_num_batched_tokens=32,
                                     attention=attention, **params)
        for i in range(3):
            engine.add(Request(f"q{i}", list(range(5 + 9 * i, 30 + 11 * i)), 6, 0.0))
        out = {}
        while engine.has_work():
            for ev in engine.step():
                out.setdefault(ev.request_id, []).append(ev.token_id)
        tokens[attention] = out
    assert tokens["triton"] == tokens["reference"] and all(len(v) == 6 for v in tokens["triton"].values())
