"""Decode-time compression (method ``decoding``) on a tiny random Llama: the cache stays bounded over
a long generation, kept rows are inspectable, and the masks stay right after every compression."""

import pytest
import torch

from kvlab.engine.engines import generate_text, make_engine
from kvlab.engine.generation import cache_kwarg, greedy_decode, prefill
from kvlab.models import load_model
from kvlab.policies import PolicyError, cache_stats, kept_positions, make_policy

P = 40  # prompt tokens
NEW = 100


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama", weights="synthetic", seed=0)


def prompt(n=P, seed=1):
    return torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def decoding(score="snapkv", target=32, interval=16, **score_params):
    if score == "snapkv":
        score_params.setdefault("window_size", 4)
    return make_policy("decoding", score=score, target=target, interval=interval, score_params=score_params)


@pytest.mark.parametrize("score", ["snapkv", "tova", "knorm", "streamingllm", "random"])
def test_the_cache_stays_bounded_over_a_long_generation(lm, score):
    policy = decoding(score)
    rows = []
    with policy.attach(lm, warm=False):
        cache = policy.make_cache(lm.model)
        first = prefill(lm.model, prompt(), cache)[:, -1].argmax(-1)
        greedy_decode(lm.model, cache, first, NEW, P, on_step=lambda i: rows.append(cache_stats(cache)))
    physical = [r["physical_tokens"] for r in rows]
    assert max(physical) <= max(P, 32) + 16
    assert physical[-1] < P + NEW - 1  # it did evict
    assert rows[-1]["logical_tokens"] == P + NEW - 1
    assert all(layer.compressions == (NEW - 1) // 16 - (1 if (NEW - 1) % 16 == 0 else 0)
               for layer in cache.layers)
    for layer_kept in kept_positions(cache):
        assert layer_kept.shape[-1] == cache.layers[0].keys.shape[-2]
        assert (layer_kept.diff(dim=-1) > 0).all() and layer_kept.max() == P + NEW - 2


def test_a_target_above_the_generation_is_the_full_cache(lm):
    full = generate_text(lm, prompt(), make_policy("full"), 40).tokens
    assert torch.equal(generate_text(lm, prompt(), decoding(target=P + 40), 40).tokens, full)
    assert not torch.equal(generate_text(lm, prompt(), decoding(target=16, interval=8), 40).tokens, full)


def test_streamingllm_scoring_rolls_a_window_of_sinks_and_recent_tokens(lm):
    policy = decoding("streamingllm", target=24, interval=8, n_sink=4)
    with policy.attach(lm, warm=False):
        gen = generate_text(lm, prompt(), policy, 57)  # 56 appended: 7 intervals, the last one not yet evicted
    for layer_kept in kept_positions(gen.cache):
        last = P + 55
        expected = list(range(4)) + list(range(last - 8 - 20 + 1, last - 8 + 1)) + list(range(last - 7, last + 1))
        assert layer_kept[0, 0].tolist() == expected


def test_snapkv_scoring_keeps_the_newest_window(lm):
    policy = decoding("snapkv", target=20, interval=10, window_size=6)
    with policy.attach(lm, warm=False):
        gen = generate_text(lm, prompt(), policy, 11)  # 10 appended: compression runs at the next step
        cache = gen.cache
        greedy_decode(lm.model, cache, gen.tokens[:, -1], 2, P + 10)
    for layer in cache.layers:
        assert layer.compressions == 1
        kept = layer.kept_positions[0, 0].tolist()
        assert kept[19 - 5:20] == list(range(P + 10 - 6, P + 10))  # the 6 queried tokens, then the new one


def test_transformers_generate_and_kvlab_decode_agree_across_compressions(lm):
    """Positions and masks after eviction: model.generate (cache positions from the logical length)
    and kvlab's loop (explicit positions) make the same tokens."""
    policy = decoding("snapkv")
    with policy.attach(lm, warm=False):
        ours = generate_text(lm, prompt(), policy, 60).tokens
        out = lm.model.generate(prompt(), **{cache_kwarg(lm.model): policy.make_cache(lm.model)}, max_new_tokens=60,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out[:, P:], ours)


def test_a_chunked_prompt_stays_whole(lm):
    policy = make_policy("decoding", score="knorm", target=8, interval=4, prefill_chunk=16)
    with policy.attach(lm, warm=False):
        gen = generate_text(lm, prompt(), policy, 2)
    assert gen.cache_after_prefill["physical_tokens"] == P


@pytest.mark.parametrize("kwargs,message", [
    ({"score": "pyramidkv"}, "cannot drive decode-time compression"),
    ({"score": "h2o"}, "cannot drive"),
    ({"interval": 32, "score_params": {"window_size": 64}}, "longer than interval=32"),
    ({"score_params": {"keep": 0.5}}, "score_params.keep does not apply"),
    ({"score_params": {"windw": 4}}, "unknown parameter(s) windw"),
    ({"target": 0}, "target must be >= 1"),
    ({"interval": 0}, "interval must be >= 1"),
])
def test_bad_decoding_params_name_the_fix(kwargs, message):
    with pytest.raises(PolicyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_policy("decoding", **kwargs)


def test_the_fast_engine_refuses_it_in_one_line():
    with pytest.raises(PolicyError, match="use engine hf"):
        make_policy("decoding").storage()


def test_params_and_label():
    policy = make_policy("decoding", score="tova", target=1024, interval=256)
    assert policy.label == "decoding tova 1024/256"
    assert policy.params() == {"method": "decoding", "score": "tova", "target": 1024, "interval": 256,
                               "score_params": {}, "keep": 1.0, "bits": None}


def test_measured_runs_record_the_cache_after_decoding(lm):
    from kvlab.measure import measure_generation

    def measured(policy):
        with policy.attach(lm, warm=False):
            return measure_generation(lm, policy, ctx=P, new_tokens=60, engine=make_engine("hf", lm)).record

    full, bounded = measured(make_policy("full")), measured(decoding("knorm", target=32, interval=16))
    assert full["cache_final_physical_tokens"] == P + 59
    assert bounded["cache_physical_tokens"] == P  # the prompt stays whole
    assert bounded["cache_final_physical_tokens"] <= 32 + 16
    assert bounded["cache_final_bytes"] < full["cache_final_bytes"]


def test_long_continuation_fidelity_sees_the_compressions(lm):
    from kvlab.long_continuation import continuation_fidelity

    context = prompt(n=24)[0].tolist()
    continuation = prompt(n=81, seed=7)[0].tolist()
    rows = continuation_fidelity(lm, [decoding("snapkv", target=200), decoding("knorm", target=16, interval=8)],
                                 context, continuation)
    roomy, tight = rows
    assert roomy["compressions"] == 0 and roomy["kl"] == pytest.approx(0.0, abs=1e-6) and roomy["top1_agree"] == 1.0
    assert tight["compressions"] == 80 // 8 - 1 and tight["final_physical_tokens"] <= 16 + 8
    assert tight["kl"] > 1e-4 and len(tight["kl_by_stretch"]) == 4


def test_evictions_run_at_decode_steps_that_are_multiples_of_the_interval(lm):
    """kvlab.capacity.compression_step_cost reads the ITLs of these steps."""
    policy = decoding("knorm", target=8, interval=16)
    seen, steps = [0], []
    with policy.attach(lm, warm=False):
        cache = policy.make_cache(lm.model)
        first = prefill(lm.model, prompt(n=20), cache)[:, -1].argmax(-1)

        def on_step(i):
            if cache.layers[0].compressions != seen[0]:
                seen[0] = cache.layers[0].compressions
                steps.append(i)

        greedy_decode(lm.model, cache, first, 70, 20, on_step=on_step)
    assert steps == [16, 32, 48, 64]
