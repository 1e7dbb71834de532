"""The Triton paged decode kernel against the torch reference (the Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvlab.serve.forward import paged_decode_reference


@pytest.mark.parametrize("hq, hkv, dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 16), (8, 2, 16, 32)])
def test_paged_decode_kernel_matches_the_reference(hq, hkv, dim, block_size):
    from kvlab.kernels.paged import paged_decode

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


def test_a_decode_batch_takes_the_smallest_bucket_that_holds_it():
    from kvlab.serve.decode_graphs import BUCKETS, bucket_for

    assert [bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 33, 256)] == [1, 2, 4, 8, 8, 16, 64, 256]
    assert bucket_for(257) is None  # past the largest: the step runs eagerly
    assert bucket_for(3, (16, 4)) == 4 and BUCKETS[-1] == 256
    with pytest.raises(ValueError, match="at least one row"):
        bucket_for(0)


def test_padding_a_decode_step_to_its_bucket_changes_no_real_row_and_writes_only_the_spare_block(tiny):
    """What a captured bucket runs, eagerly on CPU: the real rows' logits and K/V as unpadded, padding
    rows writing the spare block only."""
    from kvlab.serve.decode_graphs import DecodeGraphs
    from kvlab.serve.engine import Request, make_serving_engine

    engine = make_serving_engine(tiny, "full", num_blocks=8, block_size=4)
    for i in range(3):
        engine.add(Request(f"q{i}", list(range(3 + i, 9 + 2 * i)), 4, 0.0))
    engine.step()  # the prompts in; the next step is decode tokens only
    seqs = engine.scheduler.running
    for seq in seqs:  # the decode token's block, as schedule() reserves it
        assert engine.scheduler.reserve(seq, 1)
    rows = ([s.tokens[s.fed] for s in seqs], [s.fed for s in seqs],
            [s.blocks[s.stored // 4] * 4 + s.stored % 4 for s in seqs], [s.blocks for s in seqs],
            [s.stored + 1 for s in seqs])
    graphs = DecodeGraphs(engine.runner.step, engine.pool, 4, max_blocks=8, spare_block=8,
                          kernel=paged_decode_reference)
    before = engine.pool.k.clone()
    plain = graphs.run(**graphs.inputs(3, *rows))
    k_plain = engine.pool.k.clone()
    engine.pool.k.copy_(before)
    padded = graphs.run(**graphs.inputs(8, *rows))  # five padding rows
    torch.testing.assert_close(padded[:3], plain)
    written = (engine.pool.k != before).any(-1).any(-1).any(0).nonzero().flatten().tolist()  # slots, any layer
    assert written == sorted(rows[2]) + [32]  # the real rows' new slots, then the spare block's first slot
    torch.testing.assert_close(engine.pool.k[:, :32], k_plain[:, :32])  # real K/V as the unpadded step wrote
