"""Issue 29's reads wired in: the kivi and quest policies on both engines (CPU: the fast engine runs
eagerly with the torch references), their stats, validation, anatomy and byte arithmetic."""

import pytest
import torch
from tiny_models import load_tiny_d32

from kvlab.engine.compare import compare_engines
from kvlab.engine.fast import FastEngine
from kvlab.engine.generation import greedy_decode, prefill
from kvlab.policies import POLICIES, PolicyError, cache_stats, make_policy
from kvlab.storage.kivi import KiviSlotStore
from kvlab.storage.quest import QuestStore

# small groups and residuals so that groups flush inside the prompt and during decode; small pages
# and budgets so that the read really is sparse at 100 tokens
SETTINGS = [
    ("kivi", {"residual_length": 16, "q_group_size": 16, "value_group": 16}),
    ("kivi", {"key_bits": 4, "residual_length": 32}),
    ("kivi", {"nbits": 4, "residual_length": 0, "q_group_size": 16}),
    ("quest", {"page": 4, "budget": 32, "dense_layers": 0}),
    ("quest", {"page": 16, "budget": 32, "group_reduce": "sum", "dense_layers": 1}),
    ("kivi-rot", {"residual_length": 16, "q_group_size": 16, "value_group": 16}),  # KIVI behind the rotation
]


@pytest.fixture(scope="module")
def tiny32():
    return load_tiny_d32()


def ids(batch=2, n=100, seed=1):
    return torch.randint(3, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


def run_both(loaded, policy, prompt, n_new):
    model = loaded.model
    with policy.attach(loaded, warm=False):
        cache = policy.make_cache(model)
        first = prefill(model, prompt, cache)[:, -1].argmax(-1)
        ref = greedy_decode(model, cache, first, n_new, prompt.shape[1])
        decoder = FastEngine(loaded).decoder(policy, prompt.shape[0], prompt.shape[1], n_new)
        prefilled = decoder.prefill_cache()
        first = prefill(model, prompt, prefilled)[:, -1].argmax(-1)
        decoder.load(prefilled)
        fast = decoder.decode(first, n_new, prompt.shape[1])
    return ref, fast, decoder, cache


@pytest.mark.parametrize("method,params", SETTINGS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(SETTINGS)])
def test_fast_equals_hf_token_for_token(tiny32, method, params):
    policy = make_policy(method, **params)
    ref, fast, decoder, cache = run_both(tiny32, policy, ids(), 40)
    assert torch.equal(ref, fast), f"first difference at step {(ref != fast).nonzero()[0].tolist()}"
    assert isinstance(decoder.store, KiviSlotStore if method.startswith("kivi") else QuestStore)
    stats = cache_stats(cache)
    assert stats["logical_tokens"] == 100 + 39 and stats["bytes"] > 0
    assert decoder.stats(40)["bytes"] == stats["bytes"]  # both engines count the same bytes
    assert decoder.columns()["kv_format"] == decoder.store.kv_format


@pytest.mark.parametrize("method,params", [SETTINGS[0], SETTINGS[3]], ids=["kivi", "quest"])
def test_fast_and_hf_logits_agree(tiny32, method, params):
    policy = make_policy(method, **params)
    with policy.attach(tiny32, warm=False):
        out = compare_engines(tiny32, policy, ids(batch=1), 16)
    assert out["top1_agree"] == 1.0
    assert out["max_abs_logit_err"] < 1e-3


def test_quest_reads_sparsely_on_both_engines(tiny32, monkeypatch):
    """A budget below the context changes the tokens (on this random model), and hf's decode steps
    go through the layer's sparse read, not the stock kernel."""
    from kvlab.storage import quest as quest_layer

    calls = []
    real = quest_layer.QuestLayer.attend
    monkeypatch.setattr(quest_layer.QuestLayer, "attend", lambda self, q, s: calls.append(1) or real(self, q, s))
    policy = make_policy("quest", page=4, budget=8, dense_layers=0)
    ref, fast, _, _ = run_both(tiny32, policy, ids(), 12)
    assert torch.equal(ref, fast)
    assert len(calls) == 11 * tiny32.spec.num_layers  # every decode step of every layer
    full, *_ = run_both(tiny32, make_policy("full"), ids(), 12)
    assert not torch.equal(full, ref)


def test_a_budget_covering_the_context_is_the_full_cache(tiny32):
    ref, fast, *_ = run_both(tiny32, make_policy("quest", page=16, budget=256, dense_layers=0), ids(), 12)
    full, *_ = run_both(tiny32, make_policy("full"), ids(), 12)
    assert torch.equal(ref, full) and torch.equal(fast, full)


def test_kivi_bytes_match_the_budget_arithmetic(tiny32):
    from kvlab.budget import kv_bytes_per_token
    from kvlab.storage.kivi import kivi_cache_bytes

    spec = tiny32.spec
    policy = make_policy("kivi", residual_length=16, q_group_size=16, value_group=16)
    ref, fast, decoder, cache = run_both(tiny32, policy, ids(), 40)
    s = policy.storage().spec
    want = kivi_cache_bytes(spec, 100, 2, bits=2, group=16, residual=16, value_group=16, new_tokens=39)
    assert cache_stats(cache)["bytes"] < want  # hf holds only the ring's filled part
    store = decoder.store
    allocated = kivi_cache_bytes(spec, 100, 2, bits=2, group=16, residual=16, value_group=16, new_tokens=40)
    # the store adds one spare ("trash") group and rounds its capacity up to groups
    assert allocated <= store.bytes_allocated() <= allocated + 2 * spec.num_layers * spec.num_kv_heads * 2 * s.group * (
        kv_bytes_per_token(spec, 16) / spec.num_layers / spec.num_kv_heads)
    assert kivi_cache_bytes(spec, 4096, bits=2) < kivi_cache_bytes(spec, 4096, bits=2, key_bits=4)


def test_kivi_and_quest_parameters_are_validated():
    for method, params, match in [
        ("kivi", {"nbits": 3}, "nbits=3"), ("kivi", {"key_bits": 8}, "key_bits=8"),
        ("kivi", {"q_group_size": 48}, "q_group_size=48"), ("kivi", {"value_group": 8}, "value_group=8"),
        ("kivi", {"residual_length": -1}, "residual_length"), ("quest", {"page": 12}, "power of two"),
        ("quest", {"budget": 16}, "two pages of 16"), ("quest", {"group_reduce": "head"}, "group_reduce"),
        ("quest", {"dense_layers": -1}, "dense_layers"),
    ]:
        with pytest.raises(PolicyError, match=match):
            make_policy(method, **params)
    from kvlab.models import get_spec

    with pytest.raises(PolicyError, match="value_group=32 does not divide"):
        make_policy("kivi").check(get_spec("tiny-llama"))  # head_dim 16
    with pytest.raises(PolicyError, match="dense_layers=40 exceeds"):
        make_policy("quest", dense_layers=40).check(get_spec("llama-3.1-8b"))
    make_policy("kivi").check(get_spec("llama-3.1-8b"))
    assert make_policy("kivi").label == "kivi k2v2" and make_policy("kivi", key_bits=4).label == "kivi k4v2"
    assert make_policy("kivi", key_bits=4).bits == 3 and make_policy("quest", budget=512).label == "quest 512"
    assert {"kivi", "quest"} <= set(POLICIES)


def test_the_anatomy_shows_the_page_selection(tiny32):
    from kvlab.engine.anatomy import classify_kernel

    a = FastEngine(tiny32).anatomy(make_policy("quest", page=4, budget=16, dense_layers=0), ctx=64, steps=3, warmup=1)
    assert a.by_category["page selection"] > 0 and a.by_category["attention"] > 0
    assert classify_kernel("_quest_split_kernel") == "attention"
    assert classify_kernel("kivi_decode_kernel") == "attention"  # both KIVI variants (one kernel)
    assert classify_kernel("merge_partials_kernel") == "attention"
    assert classify_kernel("_kivi_append_kernel") == "cache update/concat"
    assert classify_kernel("void at::native::sbtopk::gatherTopK<float>") == "page selection"


def test_every_decode_kernel_counts_as_attention_by_its_own_name():
    """A graph replay's kernels are known by name only. The #26 renames (decode_fold_kernel, ..., now one
    decode_kernel) and
    the warp kernels were filed under "other ops" in the H100 anatomy of 2026-12-06 (KIVI's attention
    read 0.08 ms of a 8.6 ms step); the names here come from the kernel objects themselves."""
    pytest.importorskip("triton")
    from triton.runtime.jit import KernelInterface  # JITFunction, or InterpretedFunction on a CPU

    from kvlab.engine.anatomy import classify_kernel
    from kvlab.kernels import (
        append_kernel,
        decode_entry,
        decode_fold,
        decode_reduce,
        decode_split,
        decode_warp,
        kivi_triton,
        kivi_warp,
        merge_triton,
        quest_triton,
    )

    modules = (append_kernel, decode_entry, decode_fold, decode_reduce, decode_split, decode_warp, kivi_triton,
               kivi_warp, merge_triton, quest_triton)
    kernels = {v.__name__ for m in modules for v in vars(m).values()
               if isinstance(v, KernelInterface) and v.__name__.endswith("_kernel")}
    assert {"decode_kernel", "decode_reduce_kernel", "kivi_decode_kernel"} <= kernels, kernels
    assert len(kernels) == 7, kernels
    for name in kernels:
        writes = "append" in name or "write" in name
        assert classify_kernel(name) == ("cache update/concat" if writes else "attention"), name


def test_generate_runs_kivi_and_quest_on_both_engines(capsys):
    import json

    from kvlab.cli import main

    base = ["generate", "--model", "tiny-llama", "--weights", "synthetic", "--prompt-tokens", "40",
            "--max-new-tokens", "6", "--json"]
    answers = []
    for extra in (["--method", "kivi", "--value-group", "16", "--group-size", "16", "--residual", "8"],
                  ["--method", "quest", "--page", "4", "--token-budget", "16", "--dense-layers", "1"]):
        for engine in ("hf", "fast"):
            assert main(base + extra + ["--engine", engine]) == 0
            answers.append(capsys.readouterr().out)

    tokens = [json.loads(a)["token_ids"] for a in answers]
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3]


@pytest.mark.parametrize("method,params", [
    ("kivi", {"nbits": 4, "residual_length": 16, "q_group_size": 16, "value_group": 16}),
    ("quest", {"page": 16, "budget": 32, "dense_layers": 1}),
    ("kivi-rot", {"nbits": 4, "residual_length": 16, "q_group_size": 16, "value_group": 16}),
], ids=["kivi", "quest", "kivi-rot"])
def test_the_stores_give_the_reference_tokens_through_the_triton_kernels(tiny32, method, params, monkeypatch):
    """The CUDA path's plumbing (workspaces, lengths, layouts) on CPU: the kernels interpreted
    (tests/conftest.py sets TRITON_INTERPRET=1) give the reference's tokens."""
    import os

    from kvlab.engine import fast

    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    policy = make_policy(method, **params)
    ref, *_ = run_both(tiny32, policy, ids(), 12)
    monkeypatch.setattr(fast.FastEngine, "kernel_backend", "triton", raising=False)
    _, kernels, decoder, _ = run_both(tiny32, policy, ids(), 12)
    assert decoder.store.backend == "triton"
    assert torch.equal(ref, kernels)


@pytest.mark.parametrize("method,params", [SETTINGS[0], SETTINGS[3]], ids=["kivi", "quest"])
def test_a_store_that_cannot_go_back_gives_no_checkpoint(tiny32, method, params):
    """Quality items teacher-force the gold after the greedy reply by going back to a checkpoint; the
    KIVI ring and Quest's page bounds follow every token written, so their decoders give no mark and
    the item rebuilds the prefilled state instead (a dense store can go back)."""
    _, _, decoder, _ = run_both(tiny32, make_policy(method, **params), ids(), 8)
    assert decoder.checkpoint() is None
    _, _, dense, _ = run_both(tiny32, make_policy("full"), ids(), 8)
    assert dense.checkpoint() == dense.fed


def fed(loaded, engine_name, policy, prompt, chunk, one_by_one=False):
    """Logits of ``chunk`` teacher-forced after ``prompt`` through ``engine_name``'s decoder."""
    from kvlab.engine.engines import make_engine

    engine = make_engine(engine_name, loaded)
    cache = engine.storage_policy(policy).make_cache(loaded.model)
    prefill(loaded.model, prompt, cache)
    decoder = engine.decoder_for_cache(policy, cache, chunk.shape[1])
    n = prompt.shape[1]
    with torch.no_grad():
        if one_by_one:
            return torch.cat([decoder.feed(chunk[:, j:j + 1], n + j) for j in range(chunk.shape[1])], dim=1)
        return decoder.feed(chunk, n)


@pytest.mark.parametrize("method,params", SETTINGS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(SETTINGS)])
def test_a_fed_chunk_reads_as_its_tokens_fed_one_by_one(tiny32, method, params):
    """A question or a teacher-forced answer goes through hf as one chunk: each of its tokens must read
    the cache as it would decoded alone (Quest: its own pages; KIVI: the groups quantized by then),
    else teacher-forced KL measures another read. The fast engine feeds token by token: the same."""
    policy = make_policy(method, **params)
    prompt, chunk = ids(batch=1, n=100), ids(batch=1, n=40, seed=2)
    with policy.attach(tiny32, warm=False):
        whole = fed(tiny32, "hf", policy, prompt, chunk)
        alone = fed(tiny32, "hf", policy, prompt, chunk, one_by_one=True)
        fast = fed(tiny32, "fast", policy, prompt, chunk)
    exact = fed(tiny32, "hf", make_policy("full"), prompt, chunk)
    torch.testing.assert_close(whole, alone, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fast, alone, atol=1e-3, rtol=1e-3)
    assert (whole - exact).abs().max() > 1e-2  # the read is not the exact cache's


def test_a_chunked_prefill_under_quest_attends_densely(tiny32):
    """Quest's prefill is dense (its own code, and the fast engine's prefill cache): prompt chunks are
    not read sparsely, only what comes after the prompt."""
    prompt = ids(batch=1, n=100)
    policy = make_policy("quest", page=4, budget=8, dense_layers=0, prefill_chunk=32)
    with policy.attach(tiny32, warm=False):
        got = prefill(tiny32.model, prompt, policy.make_cache(tiny32.model), 32, logits_to_keep=0)
    want = prefill(tiny32.model, prompt, make_policy("full").make_cache(tiny32.model), 32, logits_to_keep=0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["int4-g32", "fp8"])
def test_quest_over_a_kvq_format_fast_equals_hf_token_for_token(tiny32, fmt):
    """Quest beside a quantized store: the bounds come from the exact keys, the selected pages are read
    from the codes (fast: only those pages' codes; hf: the dequantized store), on both engines alike."""
    from kvlab.storage.quest import QuantizedQuestStore

    policy = make_policy("quest", page=4, budget=32, dense_layers=1, format=fmt)
    ref, fast, decoder, cache = run_both(tiny32, policy, ids(), 24)
    assert torch.equal(ref, fast), f"first difference at step {(ref != fast).nonzero()[0].tolist()}"
    assert isinstance(decoder.store, QuantizedQuestStore)
    assert decoder.stats(24)["bytes"] == cache_stats(cache)["bytes"]
    assert decoder.columns()["kv_format"] == policy.storage().kv_format == f"{fmt}, keys - prompt-mean, quest p4-b32-max-d1"
    dense, *_ = run_both(tiny32, make_policy("quest", page=4, budget=32, dense_layers=1), ids(), 24)
    kvq, *_ = run_both(tiny32, make_policy("kvq-int4" if fmt.startswith("int4") else "kvq-fp8",
                                           **({"q_group_size": 32} if fmt.startswith("int4") else {})), ids(), 24)
    assert not torch.equal(ref, dense) and not torch.equal(ref, kvq)  # both the codes and the sparse read count


def test_quest_over_a_kvq_format_is_refused_on_cuda_and_keeps_run_ids():
    from kvlab.models import get_spec
    from kvlab.storage.base import model_shape

    with pytest.raises(PolicyError, match="format=model-dtype on a GPU"):
        make_policy("quest", format="int4-g64").storage().check(model_shape(get_spec("llama-3.1-8b")), True)
    assert "format" not in make_policy("quest").params()  # the runs before the parameter keep their ids
    assert make_policy("quest", format="fp8").params()["format"] == "fp8"
    assert make_policy("quest", budget=512, format="fp8").label == "quest 512 fp8"
