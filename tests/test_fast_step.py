"""The fast decode step's own work beside the model's (issue #28 item 2), on CPU.

The flash path cannot run here: its arithmetic (one sequence per (row, KV head) of the head-major
dense store) is checked against flash's varlen semantics restated below, and the reshapes flash's
C++ makes of the queries and output are replayed to show they are views (no copy kernels)."""

import pytest
import torch

from kvlab.storage import slots as kvstore
from kvlab.storage.dense import DenseStore
from kvlab.storage.slots import Layout, StepSlots


def varlen_semantics(q, keys, values, cu_q, cu_k, max_k, used, scale, splits=None):
    """flash's ``_flash_attention_forward`` with ``seqused_k``, restated per sequence (GQA: a sequence's
    query heads share its key heads); checks what the kernel requires of its arguments."""
    assert q.dim() == keys.dim() == values.dim() == 3 and keys.shape == values.shape
    assert cu_q.dtype == cu_k.dtype == used.dtype == torch.int32
    assert cu_q.numel() == cu_k.numel() == used.numel() + 1 == q.shape[0] + 1
    assert int(cu_k[-1]) == keys.shape[0] and bool((cu_k.diff() >= used).all()) and int(used.max()) <= max_k
    assert q.stride(-1) == keys.stride(-1) == 1
    groups = q.shape[1] // keys.shape[1]
    out = torch.empty_like(q)
    for i in range(used.numel()):
        qi = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)  # [Hq, 1, D]
        ki = keys[cu_k[i]:cu_k[i] + used[i]].transpose(0, 1).repeat_interleave(groups, 0)
        vi = values[cu_k[i]:cu_k[i] + used[i]].transpose(0, 1).repeat_interleave(groups, 0)
        p = torch.softmax(qi @ ki.transpose(-1, -2) * scale, dim=-1)
        out[cu_q[i]:cu_q[i + 1]] = (p @ vi).transpose(0, 1)
    return out


def swapped_reshapes(q: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What flash's ``mha_varlen_fwd`` does with one query per sequence and GQA
    (``seqlenq_ngroups_swapped``): ``q [S, Hq, D]`` to ``[S G, Hkv, D]`` before the kernel, and the
    output back after it (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp)."""
    s, hq, d = q.shape
    g = hq // kv_heads
    before = q.reshape(s, kv_heads, g, d).transpose(1, 2).reshape(s * g, kv_heads, d)
    out = torch.empty_like(before)
    after = out.reshape(s, g, kv_heads, d).transpose(1, 2).reshape(s, kv_heads * g, d)
    return (before, q), (after, out)


def is_view(pair) -> bool:
    view, base = pair
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


@pytest.mark.parametrize("batch", [1, 3])
def test_one_kv_head_per_sequence_makes_flash_s_gqa_transposes_views(batch):
    """The head-major store hands flash ``B Hkv`` sequences of one KV head: its transposes of q and of
    the output are views at any batch. The old ``[B, C, Hkv, D]`` call (``B`` sequences of ``Hkv``
    heads) made copies of both at batch > 1 (96 copy kernels per step at batch 16 on the H200)."""
    hq, hkv, d = 8, 2, 4
    q = torch.randn(batch, hq, d)
    assert all(is_view(p) for p in swapped_reshapes(q.reshape(batch * hkv, hq // hkv, d), 1))
    old = swapped_reshapes(q, hkv)
    assert all(is_view(p) for p in old) == (batch == 1)


def test_the_dense_flash_path_attends_what_the_sdpa_path_does(monkeypatch):
    """Segments of the head-major store (offsets, per-segment lengths, q grouped per KV head) against the
    masked SDPA reference, at batch 3 with GQA, mid-decode, and K/V handed over without a copy."""
    seen = []

    def flash(q, keys, values, *args, **kw):
        seen.append((keys.untyped_storage().data_ptr(), values.untyped_storage().data_ptr()))
        return varlen_semantics(q, keys, values, *args, **kw)

    monkeypatch.setattr(kvstore, "flash_varlen", flash)
    g = torch.Generator().manual_seed(0)
    layout = Layout(batch=3, kept=(6, 9), new_tokens=4, kv_heads=2, head_dim=16)
    store = DenseStore(layout, torch.float32, "cpu", 0.25, "sdpa")
    store.load([(torch.randn(3, 2, n, 16, generator=g), torch.randn(3, 2, n, 16, generator=g)) for n in (6, 9)])
    for step in range(3):
        store.step.fill_(step)
        store.begin()
        for layer in range(2):
            q = torch.randn(3, 8, 1, 16, generator=g)
            k, v = torch.randn(3, 2, 1, 16, generator=g), torch.randn(3, 2, 1, 16, generator=g)
            store.attention = "sdpa"
            want = store.attend(layer, q, k, v)
            store.attention = "flash"  # the same write again (same slot), then the varlen path
            got = store.attend(layer, q, k, v)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            keys, values = store.keys[layer], store.values[layer]
            assert seen[-1] == (keys.untyped_storage().data_ptr(), values.untyped_storage().data_ptr())
            assert torch.equal(keys[:, :, layout.kept[layer] + step], k[:, :, 0])


def test_step_slots_give_rows_and_segments_their_lengths_from_one_buffer():
    slots = StepSlots((5, 3), batch=2, device="cpu", segments=3)
    slots.advance()
    slots.begin()
    assert slots.used(0).tolist() == [7, 7] and slots.used(0).is_contiguous()
    assert slots.segment_used(1).tolist() == [5] * 6 and slots.segment_used(1).is_contiguous()
    assert slots.used(1).dtype == slots.segment_used(1).dtype == torch.int32


@pytest.mark.parametrize("vocab", [500, 49152, 128256, 61])
def test_the_two_stage_argmax_is_torch_s_argmax_ties_included(vocab):
    """:func:`greedy_tokens` against ``argmax``: random bf16 rows (ties between chunks are common at
    bf16), rows whose maximum repeats in several chunks, and a row that is constant."""
    from kvlab.engine.llama import argmax_chunks, greedy_tokens

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g).to(torch.bfloat16)
    logits[1] = logits[1].round()  # few distinct values: the maximum in many chunks
    logits[2] = 0.5
    logits[3, [vocab - 1, vocab // 2, 7 % vocab]] = 100.0  # three chunks hold it: the first index wins
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1, keepdim=True))
    assert torch.equal(greedy_tokens(logits.float()), logits.float().argmax(-1, keepdim=True))
    chunks = argmax_chunks(vocab)
    assert vocab % chunks == 0 and (chunks == 1 or vocab // chunks >= 64)


def test_record_token_writes_the_next_input_the_output_column_and_the_position():
    from kvlab.engine.llama import record_token

    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(1))
    token, position = torch.zeros(2, 1, dtype=torch.long), torch.tensor([[40], [40]])
    outputs = torch.zeros(2, 5, dtype=torch.long)
    record_token(logits, token, position, outputs[:, 1:], torch.tensor([2]))
    want = logits.argmax(-1)
    assert token[:, 0].tolist() == want.tolist() and outputs[:, 3].tolist() == want.tolist()
    assert outputs[:, [0, 1, 2, 4]].eq(0).all() and position[:, 0].tolist() == [41, 41]


def test_the_greedy_token_s_compiled_kernel_is_not_a_cache_write():
    from kvlab.engine.anatomy import classify_kernel

    assert classify_kernel("triton_per_fused_add_argmax_copy_gather_index_copy_mul_1") == "other ops"
    assert classify_kernel("void at::native::index_elementwise_kernel<128, 4, index_copy_kernel_impl>") \
        == "cache update/concat"
    # attention='cudnn': cuDNN's kernel and its split reduction (names from the H200, 2026-12-03f)
    assert classify_kernel("void cudnn::fusion::lean_reduction_kernel<false, false, false>(void*)") == "attention"
    assert classify_kernel("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_35") == "attention"


def test_flash_splits_reach_the_dense_store_or_are_refused_in_one_line(tiny):
    from kvlab.engine import EngineError
    from kvlab.engine.fast import FastEngine
    from kvlab.policies import make_policy

    with pytest.raises(EngineError, match="from 1 to 128"):
        FastEngine(tiny, flash_splits=0)
    if not kvstore.flash_takes_splits():
        with pytest.raises(EngineError, match="takes no num_splits"):
            FastEngine(tiny, flash_splits=4)
        return
    decoder = FastEngine(tiny, flash_splits=4).decoder(make_policy("full"), 1, 16, 4)
    assert decoder.store.splits == 4
    assert FastEngine(tiny).decoder(make_policy("full"), 1, 16, 4).store.splits is None


def test_the_cudnn_path_s_length_bias_attends_what_the_sdpa_path_does(monkeypatch):
    """attention='cudnn' (CUDA only) with SDPA unpinned on CPU: the length bias computed for every layer
    in begin() (capacities differ per layer, mid-decode) gives the masked SDPA reference's output."""
    from contextlib import nullcontext

    monkeypatch.setattr(kvstore, "cudnn_pin", nullcontext)
    g = torch.Generator().manual_seed(2)
    layout = Layout(batch=2, kept=(5, 11), new_tokens=3, kv_heads=2, head_dim=8)
    store = DenseStore(layout, torch.float32, "cpu", 0.3, "sdpa")
    store.load([(torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)) for n in (5, 11)])
    store.attention = "cudnn"
    for step in range(3):
        store.step.fill_(step)
        store.begin()
        for layer in range(2):
            bias = store.bias(layer)
            assert bias.shape == (1, 1, 1, layout.capacity[layer]) and bias.data_ptr() % 16 == 0
            assert int((bias == 0).sum()) == layout.kept[layer] + step + 1
            q = torch.randn(2, 4, 1, 8, generator=g)
            k, v = torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 8, generator=g)
            got = store.attend(layer, q, k, v)
            store.attention = "sdpa"
            want = store.attend(layer, q, k, v)
            store.attention = "cudnn"
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cudnn_attention_is_refused_where_it_cannot_run(tiny):
    from kvlab.engine import EngineError
    from kvlab.engine.fast import FastEngine
    from kvlab.policies import make_policy

    with pytest.raises(ValueError, match="'cudnn' needs a CUDA device"):
        FastEngine(tiny, attention="cudnn").decoder(make_policy("full"), 1, 16, 4)
    with pytest.raises(EngineError, match="use attention auto, flash or sdpa"):
        policy = make_policy("adakv", scorer="knorm", keep=0.5)
        FastEngine(tiny, attention="cudnn").decoder(policy, 1, 16, 4)
