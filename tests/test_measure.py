"""The run harness on the tiny random Llama: exact tokens, timings, cache size, energy fields."""

import statistics
import time
from types import SimpleNamespace

import pytest
import torch
from fake_nvml import FakeNvml

from kvlab.energy import make_sampler
from kvlab.engine.engines import make_engine
from kvlab.measure import haystack_ids, itl_stats, make_prompt, measure_generation
from kvlab.policies import make_policy


def ready(policy, loaded):
    policy.check(loaded.model)
    policy.prepare(loaded.model)
    policy.warmup(loaded.model)
    return policy


def test_prompts_are_exact_seeded_and_distinct(tiny):
    a = make_prompt(tiny, ctx=100, batch=3, prompt_id=0, seed=0)
    assert a.shape == (3, 100) and a.dtype == torch.long
    assert int(a.max()) < tiny.spec.vocab_size
    assert torch.equal(a, make_prompt(tiny, ctx=100, batch=3, prompt_id=0, seed=0))
    assert not torch.equal(a[0], a[1])  # rows differ
    assert not torch.equal(a, make_prompt(tiny, ctx=100, batch=3, prompt_id=1, seed=0))
    assert not torch.equal(a, make_prompt(tiny, ctx=100, batch=3, prompt_id=0, seed=1))


class WordTokenizer:
    """One token per word plus one per '.', and a BOS: enough to test exact-length haystacks."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        ids = []
        for word in text.split():
            ids.append(2 + sum(map(ord, word.strip("."))) % 400)
            if word.endswith("."):
                ids.append(0)
        return {"input_ids": ids}


def test_haystack_prompts_from_a_tokenizer_have_exact_length():
    tok = WordTokenizer()
    for ctx in (1, 7, 300):
        ids = haystack_ids(tok, ctx, seed=3)
        assert len(ids) == ctx and ids[0] == 1
    assert haystack_ids(tok, 50, seed=3) == haystack_ids(tok, 50, seed=3)
    assert haystack_ids(tok, 50, seed=3) != haystack_ids(tok, 50, seed=4)
    loaded = SimpleNamespace(tokenizer=tok, device="cpu", spec=None)
    assert make_prompt(loaded, ctx=64, batch=2).shape == (2, 64)


def test_itl_stats():
    assert itl_stats([]) == {"itl_mean_ms": None, "itl_median_ms": None, "itl_p90_ms": None, "itl_max_ms": None}
    values = [float(v) for v in range(1, 11)]
    s = itl_stats(values)
    assert s["itl_mean_ms"] == 5.5 and s["itl_median_ms"] == 5.5 and s["itl_max_ms"] == 10.0
    assert s["itl_p90_ms"] == pytest.approx(9.1)


def test_full_cache_run_generates_exactly_n_tokens_and_times_each(tiny):
    steps = []
    m = measure_generation(tiny, ready(make_policy("full"), tiny), ctx=64, batch=2, new_tokens=6,
                           on_step=steps.append, engine=make_engine("hf", tiny))
    r = m.record
    assert m.tokens.shape == (2, 6)
    assert steps == [0, 1, 2, 3, 4]
    assert len(r["itl_ms"]) == 5 and all(v > 0 for v in r["itl_ms"])
    assert r["itl_mean_ms"] == pytest.approx(statistics.fmean(r["itl_ms"]))
    assert r["itl_median_ms"] <= r["itl_p90_ms"] <= r["itl_max_ms"]
    assert 0 < r["prefill_s"] <= r["ttft_s"] <= r["window_s"]
    assert r["decode_s"] == pytest.approx(sum(r["itl_ms"]) / 1000, rel=0.5)
    assert r["tokens_per_s"] == pytest.approx(2 * 5 / r["decode_s"])
    assert r["cache_logical_tokens"] == 64 and r["cache_physical_tokens"] == 64
    spec = tiny.spec
    assert r["cache_bytes"] == 2 * spec.num_layers * 2 * spec.num_kv_heads * 64 * spec.head_dim * 4  # K+V fp32
    assert r["attn_implementation"] and r["sdpa_backend"] == "auto"
    # CPU: peak memory is the process's peak RSS over the run (it holds the cache); no GPU time;
    # the energy fields say why they are empty
    assert r["peak_mem_source"] == "process peak RSS (VmHWM)" and r["peak_mem_bytes"] > r["cache_bytes"]
    assert r["gpu_busy_ms"] is None
    assert r["threads"] >= 1 and r["contended"] in (True, False)
    assert r["energy_j"] is None and r["energy_source"].startswith("none")
    # host counters over decode (Linux) read; os.times() ticks every 10 ms, and five tiny decode
    # steps can take less, so the process CPU time may read 0 here
    assert r["decode_host_process_cpu_ms"] >= 0 and r["decode_host_process_cpu_share"] >= 0
    assert r["prefill_host_process_cpu_ms"] >= 0  # the CPU cost of a CPU run, split as energy (issue 30)
    assert r["decode_host_steal_ms"] >= 0 and r["decode_host_nonvoluntary_switches"] >= 0


def test_greedy_tokens_match_transformers_generate(tiny):
    ids = make_prompt(tiny, ctx=32, batch=1, prompt_id=2)
    m = measure_generation(tiny, ready(make_policy("full"), tiny), ctx=32, batch=1, new_tokens=5, input_ids=ids, engine=make_engine("hf", tiny))
    ref = tiny.model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert torch.equal(m.tokens, ref[:, 32:])


def test_cache_size_is_taken_after_prefill_eviction(tiny):
    m = measure_generation(tiny, ready(make_policy("snapkv", keep=0.25), tiny), ctx=128, batch=1, new_tokens=4, engine=make_engine("hf", tiny))
    assert m.record["cache_logical_tokens"] == 128
    assert m.record["cache_physical_tokens"] == 32


def test_one_new_token_is_prefill_only(tiny):
    m = measure_generation(tiny, ready(make_policy("full"), tiny), ctx=16, batch=1, new_tokens=1, engine=make_engine("hf", tiny))
    assert m.tokens.shape == (1, 1)
    assert m.record["itl_ms"] == [] and m.record["tokens_per_s"] is None
    with pytest.raises(ValueError, match="at least 1"):
        measure_generation(tiny, make_policy("full"), ctx=16, new_tokens=0, engine=make_engine("hf", tiny))


@pytest.mark.parametrize("backend, kernel", [("math", "math"), ("flash", "flash_cpu")])
def test_pinned_sdpa_backend_is_what_the_probe_sees(tiny, backend, kernel):
    m = measure_generation(tiny, ready(make_policy("full"), tiny), ctx=32, batch=1, new_tokens=6,
                           sdpa_backend=backend, probe=True, engine=make_engine("hf", tiny))
    assert m.record["sdpa_backend"] == backend
    assert m.record["sdpa_kernel"] == kernel
    with pytest.raises(ValueError, match="sdpa_backend"):
        measure_generation(tiny, make_policy("full"), ctx=8, new_tokens=2, sdpa_backend="fastest", engine=make_engine("hf", tiny))


def test_energy_fields_from_a_fake_nvml(tiny):
    fake = FakeNvml(segments=[(0.0, 250.0)], history_s=2.0)  # steady: the 1 s average is 250 W too
    sampler = make_sampler("cuda:0", nvml=fake, uuid="aaaa-0000", sync=lambda: None)
    policy = ready(make_policy("full"), tiny)

    def slow_step(i):
        time.sleep(0.01)  # long enough for the poller to see each phase

    m = measure_generation(tiny, policy, ctx=64, batch=2, new_tokens=5, sampler=sampler, idle_w=50.0,
                           on_step=slow_step, engine=make_engine("hf", tiny))
    r = m.record
    window = r["window_s"]
    assert r["energy_source"] == "nvml-counter"
    assert r["energy_j"] == pytest.approx(250 * window, rel=0.02)
    assert r["prefill_j"] + r["decode_j"] == pytest.approx(r["energy_j"])
    assert r["net_energy_j"] == pytest.approx(r["energy_j"] - 50.0 * window)
    assert r["j_per_token"] == pytest.approx(r["energy_j"] / 10)
    assert r["net_j_per_token"] == pytest.approx(r["net_energy_j"] / 10)
    assert r["energy_10hz_j"] == pytest.approx(250 * window, rel=0.05)
    assert r["j_per_token_10hz"] == pytest.approx(r["energy_10hz_j"] / 10)
    assert r["decode_j_per_token"] == pytest.approx(r["decode_j"] / 8)
    assert r["peak_mem_nvml_bytes"] == fake.memory_used
    sampler.close()


@pytest.mark.slow(reason="loads SmolLM2's tokenizer and weights")
def test_real_model_gets_an_exact_length_haystack_through_its_tokenizer(smollm2):
    ids = make_prompt(smollm2, ctx=300, batch=2, prompt_id=0)
    assert ids.shape == (2, 300)
    assert int(ids[0, 0]) == smollm2.tokenizer.bos_token_id
    text = smollm2.tokenizer.decode(ids[0, 1:50])
    assert len(text.split()) > 10  # words, not random ids
    m = measure_generation(smollm2, ready(make_policy("tova", keep=0.5), smollm2), ctx=300, batch=2,
                           new_tokens=4, input_ids=ids, engine=make_engine("hf", smollm2))
    assert m.tokens.shape == (2, 4)
    assert m.record["cache_physical_tokens"] == 150


def test_kernel_ms_sums_the_kernels_of_cpu_ops_once():
    """The decode probe's GPU time: every kernel under a CPU op counted once, async/annotation rows skipped."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from kvlab.measure import kernel_ms

    def op(name, kernel_us, parent=None, **kw):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, is_async=False, is_user_annotation=False,
                               kernels=[SimpleNamespace(duration=us) for us in kernel_us], cpu_parent=parent, **kw)

    step = op("aten::linear", [])
    events = [step, op("aten::mm", [3000.0, 1000.0], parent=step), op("aten::add", [500.0]),
              op("kvlab::attention", [9999.0]), op("ProfilerStep#1", [9999.0])]
    events.append(SimpleNamespace(name="ncclKernel", device_type=DeviceType.CUDA, is_async=False,
                                  is_user_annotation=False, kernels=[SimpleNamespace(duration=9999.0)],
                                  cpu_parent=None))
    assert kernel_ms(events) == 4.5


@pytest.mark.parametrize("phase", ["prefill", "greedy_decode"])
def test_a_probed_run_that_raises_leaves_no_profiler_running(tiny, monkeypatch, phase):
    """A failed warm-up (the probed run) used to leave torch's profiler on for the rest of the
    process: every later run was measured under it."""
    import kvlab.engine.hf as hf

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(hf, phase, oom)
    with pytest.raises(torch.OutOfMemoryError):
        measure_generation(tiny, make_policy("full"), ctx=16, new_tokens=4, probe=True, engine=make_engine("hf", tiny))
    assert not torch._C._autograd._profiler_enabled()


def test_an_anatomy_loop_that_raises_leaves_no_profiler_running():
    from kvlab.anatomy import profile_loop

    steps = iter(range(100))

    def step():
        if next(steps) == 4:  # inside the profiled steps
            raise RuntimeError("simulated")

    with pytest.raises(RuntimeError, match="simulated"):
        profile_loop(step, "x", steps=4, warmup=2)
    assert not torch._C._autograd._profiler_enabled()


def test_a_runs_peak_window_opens_after_the_engine_swaps_its_decoder(tiny, monkeypatch):
    """The fast engine frees the previous run's decoder when it builds this run's: the peak is
    reset after that, or a run after a larger store inherits its size as a peak (on the H200, fast
    int4 at batch 32 after the full cache: 85.4 GB, its own 52.2 GB)."""
    import kvlab.measure as measure
    from kvlab.engine.fast import FastEngine

    events = []
    engine = FastEngine(tiny, max_decoders=1, compile="none")
    build = engine.decoder
    monkeypatch.setattr(engine, "decoder", lambda *a, **kw: events.append("decoder") or build(*a, **kw))
    monkeypatch.setattr(measure, "reset_peak_rss", lambda: events.append("peak reset") or True)
    m = measure_generation(tiny, ready(make_policy("full"), tiny), ctx=32, batch=1, new_tokens=3, engine=engine)
    assert events == ["decoder", "peak reset"]
    assert m.record["engine"] == "fast" and m.record["peak_mem_bytes"] is not None
