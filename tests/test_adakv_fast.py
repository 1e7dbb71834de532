"""AdaKV on the fast engine (issue #27 item 3): the ragged store keeps each (row, KV head)'s kept rows
in a segment of its own, so the padding transformers' cache holds on ``hf`` is never allocated, and
decodes what ``hf`` decodes. On CPU only the SDPA path runs; the flash path's segment arithmetic is
checked against flash's varlen semantics restated here (benchmarks/adakv_fast.py runs the kernel)."""

import pytest
import torch
from tiny_models import load_tiny_d32

from kvlab.engine import EngineError
from kvlab.engine.engines import generate_text, make_engine
from kvlab.engine.fast import FastEngine
from kvlab.engine.generation import greedy_decode, prefill
from kvlab.policies import PolicyError, make_policy
from kvlab.policies.adakv import SCORERS
from kvlab.policies.headwise import head_stats
from kvlab.storage import ragged
from kvlab.storage.slots import Layout

N, NEW = 96, 10


@pytest.fixture(scope="module")
def lm():
    return load_tiny_d32()


def adakv(scorer="knorm", **kw):
    """adakv over ``scorer`` with knobs that fit a 96-token prompt; no safeguard, so heads differ most."""
    params = {"snapkv": {"window_size": 8}, "pyramidkv": {"window_size": 8}, "kvzip": {"chunk_size": 32}}
    kw = {"keep": 0.25, "alpha_safeguard": 0.0, **kw}
    return make_policy("adakv", scorer=scorer, scorer_params=params.get(scorer), **kw)


def ids(batch=2, n=N, seed=5):
    return torch.randint(3, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


def hf_run(lm, policy, prompt, n_new):
    """(tokens, the cache after decoding) on transformers' cache, padded + masked per head."""
    cache = policy.make_cache(lm.model)
    first = prefill(lm.model, prompt, cache)[:, -1].argmax(-1)
    return greedy_decode(lm.model, cache, first, n_new, prompt.shape[1]), cache


def fast_run(engine, lm, policy, prompt, n_new, rows=None):
    """(tokens, decoder) on the fast engine's ragged store."""
    decoder = engine.decoder(policy, prompt.shape[0], prompt.shape[1], n_new)
    first = decoder.prefill(prompt, rows=rows)
    return decoder.decode(first, n_new, prompt.shape[1]), decoder


def varlen_semantics(q, keys, values, cu_q, cu_k, max_k, used, scale):
    """flash's ``_flash_attention_forward`` with ``seqused_k``, restated per sequence: sequence ``i`` has
    query rows ``cu_q[i]:cu_q[i+1]`` and attends key rows ``cu_k[i] .. cu_k[i] + used[i]``, its query heads
    sharing the key heads (GQA). Checks what the kernel requires of its arguments."""
    assert q.dim() == keys.dim() == values.dim() == 3 and keys.shape == values.shape
    assert cu_q.dtype == cu_k.dtype == used.dtype == torch.int32
    assert cu_q.numel() == cu_k.numel() == used.numel() + 1
    assert int(cu_k[-1]) == keys.shape[0] and bool((cu_k.diff() >= used).all())
    assert int(used.max()) <= max_k
    groups = q.shape[1] // keys.shape[1]
    out = torch.empty_like(q)
    for i in range(used.numel()):
        qi = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)  # [Hq, 1, D]
        ki = keys[cu_k[i]:cu_k[i] + used[i]].transpose(0, 1).repeat_interleave(groups, 0)
        vi = values[cu_k[i]:cu_k[i] + used[i]].transpose(0, 1).repeat_interleave(groups, 0)
        p = torch.softmax(qi @ ki.transpose(-1, -2) * scale, dim=-1)
        out[cu_q[i]:cu_q[i + 1]] = (p @ vi).transpose(0, 1)
    return out


def test_segments_fill_each_rows_block_exactly():
    lengths = torch.tensor([[3, 1, 0, 4], [2, 2, 2, 2]])
    off = ragged.segment_offsets(lengths, kept=2, new_tokens=3)
    block = 4 * (2 + 3)
    assert off.tolist() == [[0, 6, 10, 13], [20, 25, 30, 35]]
    assert ((off[:, -1] + lengths[:, -1] + 3) == torch.tensor([1, 2]) * block).all()  # last segment ends the block
    assert ragged.segment_offsets(lengths[1:], 2, 3, first_row=5).tolist() == [[100, 105, 110, 115]]
    assert ragged.per_head_budget(lengths) == 2
    with pytest.raises(ValueError, match="4 x 3 = 12 per row"):
        ragged.segment_offsets(lengths, kept=3, new_tokens=1)
    with pytest.raises(ValueError, match="same multiple of 4"):
        ragged.per_head_budget(torch.tensor([[3, 1, 0, 4], [2, 2, 2, 1]]))


def test_step_slots_follow_the_loaded_segments():
    layout = Layout(batch=2, kept=(2, 3), new_tokens=3, kv_heads=4, head_dim=8)
    store = ragged.RaggedStore(layout, torch.float32, "cpu", 1.0, "sdpa")
    store.begin()
    assert store.slots.used(0).tolist() == [2 + 1] * 8  # before a load every head holds the budget: step 0's graph
    assert store.slots.slot(1).tolist() == [b * 4 * 6 + h * 6 + 3 for b in range(2) for h in range(4)]
    lengths = torch.tensor([[3, 1, 0, 4], [2, 2, 2, 2]])
    kv = torch.randn(2, 4, 4, 8)
    store.load([(kv, kv, lengths), (kv[..., :3, :], kv[..., :3, :], torch.full((2, 4), 3))])
    store.step.fill_(2)
    store.begin()
    off = ragged.segment_offsets(lengths, 2, 3).reshape(-1)
    assert store.slots.slot(0).tolist() == (off + lengths.reshape(-1) + 2).tolist()
    assert store.slots.used(0).tolist() == (lengths.reshape(-1) + 3).tolist()
    assert store.slots.cu_k(0).tolist() == [*off.tolist(), 2 * 4 * 5]
    # head (0, 0)'s three kept rows start its segment at 0, head (0, 1)'s one row its segment at 3 + 3
    assert torch.equal(store.keys[0][0:3], kv[0, 0, :3])
    assert torch.equal(store.keys[0][6:7], kv[0, 1, :1])


def test_the_flash_path_attends_what_the_sdpa_path_does(monkeypatch):
    """Segment arithmetic of the flash path (q per segment, cu_seqlens_k, seqused_k) against the masked
    SDPA reference, with uneven heads and the write slots mid-decode."""
    monkeypatch.setattr(ragged, "flash_varlen", varlen_semantics)
    g = torch.Generator().manual_seed(0)
    layout = Layout(batch=3, kept=(5,), new_tokens=4, kv_heads=4, head_dim=16)
    store = ragged.RaggedStore(layout, torch.float32, "cpu", 0.25, "sdpa")
    lengths = torch.tensor([[9, 0, 6, 5], [5, 5, 5, 5], [1, 17, 1, 1]])
    kv = torch.randn(3, 4, 17, 16, generator=g)
    store.load([(kv, kv * 0.5, lengths)])
    q = torch.randn(3, 8, 1, 16, generator=g)
    for step in range(3):
        store.step.fill_(step)
        store.begin()
        k, v = torch.randn(3, 4, 1, 16, generator=g), torch.randn(3, 4, 1, 16, generator=g)
        store.attention = "sdpa"
        want = store.attend(0, q, k, v)
        store.attention = "flash"  # the same write again (same slots), then the varlen path
        got = store.attend(0, q, k, v)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    start = int(store.slots.offsets[0, 2 * 4 + 1])  # row 2, head 1: all 17 kept rows in its segment
    assert torch.equal(store.keys[0][start:start + 17], kv[2, 1])


@pytest.mark.parametrize("scorer", list(SCORERS))
def test_fast_decodes_what_hf_decodes_and_holds_only_the_kept_rows(lm, scorer):
    policy = adakv(scorer)
    prompt = ids()
    with policy.attach(lm, warm=False):
        ref, hf_cache = hf_run(lm, policy, prompt, NEW)
        fast, decoder = fast_run(FastEngine(lm), lm, policy, prompt, NEW)
    assert torch.equal(fast, ref)
    spec = lm.spec
    budget = policy.kept_tokens(N, spec.num_layers)
    assert list(decoder.layout.kept) == budget
    assert decoder.store.kv_format == "model dtype, ragged heads" and decoder.store.attention == "sdpa"
    # K and V x batch 2 x Hkv x (budget + new) x D x float32, per layer
    want = sum(2 * 2 * spec.num_kv_heads * (k + NEW) * spec.head_dim * 4 for k in budget)
    assert decoder.store.bytes_allocated() == want
    full = FastEngine(lm).layout(make_policy("full"), 2, N, NEW).dense_bytes(4)
    assert want < full
    padded = head_stats(hf_cache)
    assert padded["padded_bytes"] >= padded["kept_bytes"]  # hf holds the padding; fast does not


def test_heads_really_differ_and_each_segment_holds_its_heads_rows(lm):
    policy = adakv("knorm")
    prompt = ids()
    with policy.attach(lm, warm=False):
        _, hf_cache = hf_run(lm, policy, prompt, 1)
        _, decoder = fast_run(FastEngine(lm), lm, policy, prompt, NEW)
    for i, layer in enumerate(hf_cache.layers):
        lengths = layer.head_valid.sum(-1)
        assert len(set(lengths.reshape(-1).tolist())) > 1, f"layer {i}: heads kept the same count"
        assert layer.keys.shape[-2] > decoder.layout.kept[i]  # hf pads to the longest head
        off = decoder.store.slots.offsets[i].view(2, -1)
        for b in range(2):
            for h in range(lengths.shape[1]):
                n = int(lengths[b, h])
                seg = decoder.store.keys[i][off[b, h]:off[b, h] + n]
                assert torch.equal(seg, layer.keys[b, h, :n])


def test_fast_teacher_forces_to_hf_logits_and_goes_back_to_a_checkpoint(lm):
    policy = adakv("snapkv")
    context, question, gold = ids(batch=1, n=80, seed=1), ids(batch=1, n=6, seed=2), ids(batch=1, n=5, seed=3)
    with policy.attach(lm, warm=False):
        decoders = {}
        for name in ("hf", "fast"):
            engine = make_engine(name, lm)
            cache = engine.storage_policy(policy).make_cache(lm.model)
            prefill(lm.model, context, cache)
            decoders[name] = engine.decoder_for_cache(policy, cache, 6 + 8)
        with torch.no_grad():
            hf, fast = (decoders[n].feed(question, 80) for n in ("hf", "fast"))
        torch.testing.assert_close(fast, hf, atol=1e-4, rtol=1e-4)
        dec = decoders["fast"]
        mark = dec.checkpoint()
        assert mark == 6
        dec.decode(fast[:, -1].argmax(-1), 8, 86)
        dec.restore(mark)
        with torch.no_grad():
            again = dec.feed(gold, 86)
            want = decoders["hf"].feed(gold, 86)
    torch.testing.assert_close(again, want, atol=1e-4, rtol=1e-4)


def test_generate_text_with_a_question_on_fast_matches_hf(lm):
    policy = adakv("expected_attention")
    prompt, question = ids(batch=1), ids(batch=1, n=5, seed=2)[0]
    hf = generate_text(lm, prompt, policy, 8, question_ids=question)
    fast = generate_text(lm, prompt, policy, 8, question_ids=question, engine=FastEngine(lm))
    assert torch.equal(hf.tokens, fast.tokens)
    assert fast.cache_final["logical_tokens"] == hf.cache_final["logical_tokens"]
    assert fast.cache_final["physical_tokens"] < hf.cache_final["physical_tokens"]  # no padding held


def test_row_groups_load_their_own_segments(lm):
    policy = adakv("knorm")
    prompt = ids(batch=3)
    with policy.attach(lm, warm=False):
        whole, _ = fast_run(FastEngine(lm), lm, policy, prompt, NEW)
        grouped, _ = fast_run(FastEngine(lm), lm, policy, prompt, NEW, rows=2)
    assert torch.equal(whole, grouped)


def test_what_the_ragged_store_cannot_hold_is_refused(lm):
    with pytest.raises(PolicyError, match="use scope='layer'"):
        make_policy("adakv", scorer="kvzip", scope="model").storage()
    with pytest.raises(EngineError, match="use attention auto, flash or sdpa"):
        FastEngine(lm, attention="triton").decoder(adakv(), 1, N, NEW)
