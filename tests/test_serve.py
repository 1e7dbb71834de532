"""The serving engine's parts on a tiny random model and known answers: metrics, traffic, blocks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from kvlab.models import get_spec
from kvlab.serve import metrics
from kvlab.serve.engine import Request, ServeError, make_serving_engine
from kvlab.serve.layout import BlockLayout
from kvlab.serve.traffic import MOONCAKE, TrafficError, arrival_times, lognormal_from_mean_p99, parse_traffic
from kvlab.serve.workload import build_workload, read_trace

FIXED = {"kind": "fixed", "input": 20, "output": 4}


# -- metrics: hand-computed answers -----------------------------------------------------------------
def rec(arrival, times):
    return {"arrival_s": arrival, "token_times": times, "input_tokens": 10}


def test_request_metrics_follow_vllms_formulas():
    r = rec(1.0, [1.5, 1.7, 2.0, 2.5])
    assert metrics.ttft(r) == pytest.approx(0.5)
    assert metrics.e2e(r) == pytest.approx(1.5)
    assert metrics.tpot(r) == pytest.approx(1.0 / 3)  # (1.5 - 0.5) / (4 - 1)
    assert metrics.tpot(rec(0.0, [0.3])) == 0.0  # one token: 0, as vLLM's goodput counts it
    assert metrics.itls([r, rec(0, [1.0, 1.25])]) == pytest.approx([0.2, 0.3, 0.5, 0.25])


def test_run_metrics_throughput_goodput_percentiles_and_concurrency():
    recs = [rec(0.0, [1.0, 2.0]), rec(0.5, [1.5, 1.6, 1.7]), rec(3.0, [3.2])]
    m = metrics.run_metrics(recs, duration_s=4.0, slo={"ttft": 0.5, "tpot": 0.5})
    assert m["completed"] == 3 and m["output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(0.75) and m["output_throughput"] == pytest.approx(1.5)
    # ttfts 1.0, 1.0, 0.2; tpots 1.0, 0.1, 0: only the last meets both SLOs
    assert m["goodput"] == pytest.approx(0.25)
    assert m["ttft_p50_s"] == pytest.approx(1.0) and m["ttft_mean_s"] == pytest.approx(2.2 / 3)
    assert m["ttft_p90_s"] == pytest.approx(np.percentile([1.0, 1.0, 0.2], 90))
    assert m["peak_concurrency"] == 2  # [0, 2) and [0.5, 1.7) overlap; [3, 3.2) alone


def test_steady_window_and_energy_per_token():
    recs = [rec(0.0, [float(i + 1), float(i + 1.5)]) for i in range(6)]  # first tokens at 1..6
    assert metrics.steady_window(recs, 2) == (2.0, 4.0)  # 2nd first token to the (6-2)th
    assert metrics.steady_window(recs, 3) is None
    counter = [(0.0, 0.0), (10.0, 10.0)]  # one unit per second
    per_token, per_request = metrics.energy_per_work(recs, (2.0, 4.0), counter)
    # tokens in (2, 4]: 2.5, 3.0, 3.5, 4.0 -> 4 tokens for 2 units; 2 tokens a request
    assert per_token == pytest.approx(2.0 / 4) and per_request == pytest.approx(2 * 2.0 / 4)


# -- traffic: validation and draws ------------------------------------------------------------------
@pytest.mark.parametrize("block, words", [
    ({"arrival": "poisson", "requests": 4, "lengths": FIXED}, "needs rate"),
    ({"arrival": "poisson", "rate": -1, "requests": 4, "lengths": FIXED}, "rate must be > 0"),
    ({"arrival": "gamma", "rate": 1, "burstiness": 0, "requests": 4, "lengths": FIXED}, "burstiness"),
    ({"arrival": "closed", "requests": 4, "lengths": FIXED}, "needs users"),
    ({"arrival": "poisson", "rate": 1, "lengths": FIXED}, "requests"),
    ({"arrival": "often", "rate": 1, "requests": 4, "lengths": FIXED}, "arrival"),
    ({"arrival": "poisson", "rate": 1, "requests": 4, "lengths": {"kind": "fixed", "input": 8}}, "needs output"),
    ({"arrival": "poisson", "rate": 1, "requests": 4, "lengths": {"kind": "trace", "path": "/nope.csv"}}, "not a file"),
    ({"arrival": "poisson", "rate": 1, "requests": 4, "lengths": FIXED, "speed": 3}, "speed"),
    ("fast", "expected a mapping"),
])
def test_bad_traffic_is_one_error_naming_the_key(block, words):
    with pytest.raises(TrafficError, match=words) as err:
        parse_traffic(block)
    assert "\n" not in str(err.value)


def test_gamma_arrivals_rescale_to_n_over_rate_and_burstiness_sets_the_spread():
    spec = parse_traffic({"arrival": "gamma", "rate": 4, "burstiness": 0.25, "requests": 2000, "lengths": FIXED})
    times = np.array(arrival_times(spec, 4.0))
    assert times[0] > 0 and times[-1] == pytest.approx(2000 / 4)
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(0.25), rel=0.1)  # CV of Gamma(b) = 1/sqrt(b)
    const = arrival_times(parse_traffic({"arrival": "constant", "rate": 2, "requests": 5, "lengths": FIXED}), 2.0)
    assert np.diff(const) == pytest.approx([0.5] * 4)
    burst = parse_traffic({"arrival": "burst", "requests": 3, "lengths": FIXED})
    assert arrival_times(burst, None) == [0.0, 0.0, 0.0]


def test_mooncake_fit_reproduces_its_mean_and_p99():
    mu, sigma = lognormal_from_mean_p99(MOONCAKE["input_mean"], MOONCAKE["input_p99"])
    assert math.exp(mu + sigma ** 2 / 2) == pytest.approx(12035)
    assert math.exp(mu + 2.3263478740408408 * sigma) == pytest.approx(85400)
    assert 6000 < math.exp(mu) < 7500  # the trace's median is 6,909: not fitted, a check


def test_trace_file_gives_arrivals_and_lengths(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n10.0,30,5\n10.5,12,3\n")
    assert read_trace(str(path)) == [(0.0, 30, 5), (0.5, 12, 3)]
    spec = parse_traffic({"arrival": "trace", "rate_scale": 2, "lengths": {"kind": "trace", "path": str(path)}})
    wl = build_workload(spec, None, None, vocab=100)
    assert [(len(i.prompt_ids), i.output_len, i.arrival_s) for i in wl.items] == [(30, 5, 0.0), (12, 3, 0.25)]


# -- layouts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, params, token_bytes", [
    ("full", {}, 131072),  # 2 x 32 x 8 x 128 x 2 B: kvlab.budget's element count at bf16
    ("snapkv", {"keep": 0.25}, 131072),
    ("kvq-fp8", {}, 2 * 32 * 8 * (128 + 4)),  # the format's codes and float32 scale per token
    ("kvq-int4", {}, 2 * 32 * 8 * (64 + 2 * 2 * 2)),  # int4-g64: codes, a bf16 scale and zero per 64
])
def test_block_bytes_come_from_the_storage_protocol_as_before(method, params, token_bytes):
    from kvlab.budget import kv_elements_per_token
    from kvlab.kernels.formats import parse_format
    from kvlab.policies import make_policy
    from kvlab.serve.methods import layout_for

    spec = get_spec("llama-3.1-8b")
    policy = make_policy(method, **params)
    layout = layout_for(policy, spec, torch.bfloat16, 16)
    storage = policy.storage()
    if storage.kv_format == "model dtype":  # the serving layout's formulas before the storage protocol backed it
        before = kv_elements_per_token(spec) * 16 // 8
    else:
        before = 2 * spec.num_layers * spec.num_kv_heads * parse_format(storage.format).token_bytes(spec.head_dim)
    assert before == token_bytes and layout.bytes_per_block == 16 * before
    assert layout.keep == params.get("keep", 1.0) and layout.window == (64 if method == "snapkv" else 0)


def test_quest_and_kivi_blocks_weigh_what_their_storage_says():
    from kvlab.policies import make_policy
    from kvlab.serve.methods import layout_for

    spec = get_spec("llama-3.1-8b")
    layout = layout_for(make_policy("quest", budget=2048), spec, torch.bfloat16, 16)
    assert layout.bytes_per_block == 16 * 131072 + 32 * 2 * 8 * 128 * 2  # K/V, then a key min and max per layer
    assert layout.resident_tokens(1000) == 1000 and layout.sequence_bytes == 0  # every block kept
    kivi = layout_for(make_policy("kivi", q_group_size=16), spec, torch.bfloat16, 16)
    # per token and KV head: 2-bit K and V codes (2 x 32 B), K's scale and zero per channel per group of
    # 16 (2 x 128 x 2 B / 16), V's per 32 elements (2 x 4 x 2 B)
    assert kivi.bytes_per_block == 32 * 8 * 16 * (64 + 32 + 16)
    assert kivi.sequence_bytes == 32 * 2 * 8 * 128 * 2 * (128 + 16 - 1)  # the bf16 tail, outside the blocks
    with pytest.raises(ServeError, match="kivi key groups of 32 tokens.*block_size=32"):
        layout_for(make_policy("kivi"), spec, torch.bfloat16, 16)
    with pytest.raises(ServeError, match="'tova' is not served yet.*supports full, snapkv, kvq-fp8.*quest, kivi"):
        make_serving_engine("tiny-llama", "tova")


def test_block_bytes_and_blocks_per_method():
    snap = BlockLayout("snapkv", 16, 1, "dense", keep=0.25, window=64)
    assert snap.prefill_blocks(1000) == 63 and snap.resident_tokens(1000) == 250
    assert snap.peak_blocks(1000, 300) == max(63, math.ceil(550 / 16))
    assert BlockLayout("full", 16, 1, "dense").peak_blocks(1000, 300) == math.ceil(1300 / 16)


# -- the engine on a tiny random model --------------------------------------------------------------
def drain(engine):
    out = {}
    while engine.has_work():
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev)
    return out


@pytest.mark.parametrize("method, params", [("full", {}), ("snapkv", {"keep": 0.25, "window_size": 4}),
                                            ("kvq-fp8", {})])
def test_every_request_gets_exactly_its_tokens_and_all_blocks_come_back(tiny, method, params):
    engine = make_serving_engine(tiny, method, num_blocks=12, max_num_batched_tokens=24, **params)
    rng = np.random.default_rng(0)
    for i in range(6):
        engine.add(Request(f"q{i}", rng.integers(0, 100, 20 + 7 * i).tolist(), 3 + i, 0.0))
    out = drain(engine)
    assert {k: len(v) for k, v in out.items()} == {f"q{i}": 3 + i for i in range(6)}
    assert all(v[-1].finished and v[-1].finish_reason == "length" for v in out.values())
    stats = engine.stats()
    assert stats["blocks_used"] == 0 and stats["blocks_free"] == stats["blocks_total"] == 12


@pytest.mark.parametrize("method, params", [("full", {}), ("snapkv", {"keep": 0.25, "window_size": 4})])
def test_a_warm_up_leaves_no_trace_and_changes_no_token(tiny, method, params):
    def tokens(warm: bool):
        engine = make_serving_engine(tiny, method, num_blocks=12, max_num_batched_tokens=24, **params)
        if warm:
            engine.warm_up()
            assert engine.stats()["blocks_used"] == 0 and engine.timeline == [] and engine.finished == {}
            assert engine.seqs == {} and not engine.has_work()
        engine.add(Request("q", list(range(30, 60)), 5, 0.0))
        return [e.token_id for e in drain(engine)["q"]], len(engine.timeline)

    assert tokens(True) == tokens(False)


def test_eviction_compacts_survivors_into_fewer_blocks(tiny):
    engine = make_serving_engine(tiny, "snapkv", num_blocks=20, block_size=4, keep=0.25, window_size=4)
    engine.add(Request("a", list(range(40)), 5, 0.0))
    engine.step()  # the whole prompt in one chunk, then the eviction
    seq = engine.scheduler.running[0]
    assert seq.stored == 10 and len(seq.blocks) == 3  # 10 kept of 40: 3 blocks of 4 instead of 10
    assert engine.stats()["blocks_used"] == 3


def test_too_small_a_pool_preempts_and_still_finishes(tiny):
    engine = make_serving_engine(tiny, "full", num_blocks=8, block_size=4, max_num_batched_tokens=64)
    for i in range(4):
        engine.add(Request(f"q{i}", list(range(10, 20)), 12, 0.0))  # 22 tokens = 6 blocks each at the end
    out = drain(engine)
    assert engine.stats()["preemptions_total"] > 0
    assert {k: len(v) for k, v in out.items()} == {f"q{i}": 12 for i in range(4)}
    assert sum(engine.finished[k]["preemptions"] for k in out) == engine.stats()["preemptions_total"]
    # recompute keeps greedy tokens: every copy of the same prompt generates the same tokens
    assert len({tuple(e.token_id for e in v) for v in out.values()}) == 1


def test_abort_frees_blocks_and_stops_events(tiny):
    engine = make_serving_engine(tiny, "full", num_blocks=10, block_size=4)
    engine.add(Request("a", list(range(12)), 20, 0.0))
    engine.add(Request("b", list(range(12)), 3, 0.0))
    engine.step()
    engine.abort("a")
    out = drain(engine)
    assert set(out) == {"b"} and engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("method, params, words", [
    ("tova", {}, "supports full, snapkv"),
    ("quest", {"num_blocks": 4, "page": 32}, "block_size=32"),
    ("full", {"num_blocks": 0}, "pool holds 0 blocks"),
    ("full", {}, "pass pool_gb"),
    ("full", {"num_blocks": 4, "attention": "flash"}, "attention='flash'"),
    ("quest", {"num_blocks": 4, "attention": "triton"}, "the paged kernels"),  # its sparse read has none here
])
def test_engine_refuses_with_one_clear_error(tiny, method, params, words):
    with pytest.raises(ServeError, match=words):
        make_serving_engine(tiny, method, **params)


def test_a_request_that_can_never_fit_is_refused_at_add(tiny):
    engine = make_serving_engine(tiny, "full", num_blocks=4, block_size=4)
    with pytest.raises(ServeError, match="pool holds 4"):
        engine.add(Request("big", list(range(15)), 4, 0.0))


def test_predicted_concurrency_is_the_pool_over_a_mean_requests_blocks():
    from kvlab.serve.layout import predicted_concurrency
    full = BlockLayout("full", 16, 1, "dense")
    snap = BlockLayout("snapkv", 16, 1, "dense", keep=0.25)
    lengths = [(96, 8)] * 40
    assert predicted_concurrency(full, 28, lengths) == pytest.approx(28 / 7)  # ceil(104/16) = 7 blocks
    assert predicted_concurrency(snap, 28, lengths) == pytest.approx(28 / 2)  # ceil((24+8)/16) = 2
    assert predicted_concurrency(snap, 1000, lengths) == 40  # never more than the requests


@pytest.mark.parametrize("traffic, method, words", [
    ({"arrival": "gamma", "burstiness": -1, "rate": 1, "requests": 2, "lengths": FIXED}, "full", "burstiness"),
    ({"arrival": "burst", "requests": 2, "lengths": FIXED, "server": {"block_size": 0}}, "full", "block_size"),
    ({"arrival": "burst", "requests": 2, "lengths": FIXED, "slo": {"ttft": -1}}, "full", "slo.ttft"),
    ({"arrival": "burst", "requests": 2, "lengths": FIXED}, "tova", "not served yet"),
    ({"arrival": "burst", "requests": 2, "lengths": FIXED, "server": {"block_size": 8}}, "quest", "block_size=16"),
    ({"arrival": "burst", "requests": 2, "lengths": FIXED}, {"method": "kivi", "value_group": 16},
     "kivi key groups of 32 tokens"),
])
def test_the_serving_sweep_refuses_bad_params_before_any_model_loads(tmp_path, traffic, method, words):
    from kvlab.errors import UserError
    from kvlab.serve.sweep import run_serving_sweep
    from kvlab.sweep.params import parse_params

    def refuse(*args, **kwargs):
        pytest.fail("a model was loaded for bad input")

    with pytest.raises(UserError, match=words):
        params = parse_params({"models": "tiny-llama", "weights": "synthetic", "methods": [method], "ctx": [32],
                               "traffic": traffic})
        run_serving_sweep(params, tmp_path / "out", loader=refuse)


def test_the_serving_sweep_runs_every_method_and_rate_and_records_them(tmp_path, tiny):
    from kvlab.serve.sweep import run_serving_sweep
    from kvlab.sweep.params import parse_params

    params = parse_params({"models": "tiny-llama", "weights": "synthetic", "methods": ["full", "snapkv"], "keep": 0.5,
                           "ctx": [32], "repeats": 2,
                           "traffic": {"arrival": "poisson", "rate": [50, 100], "requests": 4,
                                       "lengths": {"kind": "fixed", "input": 12, "output": 3},
                                       "server": {"num_blocks": 16, "block_size": 4}, "slo": {"ttft": 10}}})
    rows = run_serving_sweep(params, tmp_path, loader=lambda *a, **k: tiny, log=lambda s: None)
    assert [(r["method"], r["rate"], r["repeat"]) for r in rows] == [
        (m, rate, rep) for rep in (0, 1) for rate in (50.0, 100.0) for m in ("full", "snapkv")]
    assert all(r["status"] == "complete" and r["completed"] == 4 and r["goodput"] is not None for r in rows)
    assert all(0 < r["bookkeeping_share"] < 1 for r in rows)
    assert len((tmp_path / "serve_runs.jsonl").read_text().splitlines()) == 8
    assert all(r["card"] == "cpu" and r["gpu_uuid"] is None for r in rows)  # the card of every artifact
    run = json.loads((tmp_path / rows[0]["run"] / "run.json").read_text())
    assert run["card"] == "cpu" and "power_limit_w" in run
    lines = (tmp_path / rows[0]["run"] / "requests.jsonl").read_text().splitlines()
    assert lines and all(json.loads(line)["card"] == "cpu" for line in lines)
    from kvlab.serve import figures
    df = figures.load_sweep(tmp_path)
    assert len(df) == 8 and set(df["label"]) == {"full ", 'snapkv {"keep":0.5}'}
    for fig in (figures.latency_throughput(df), figures.goodput_vs_rate(df),
                figures.blocks_timeline(tmp_path / rows[-1]["run"])):
        assert fig.data and all(len(trace.x) for trace in fig.data)
    # ML.ENERGY's steady window needs more than twice the peak batch: with 4 requests, energy exists
    # exactly in the runs whose peak was 1 (how the arrivals overlapped depends on the machine's speed)
    windowed = df["peak_running"] == 1
    assert (df["energy_per_request"].notna() == windowed).all()
    assert bool(figures.energy_vs_rate(df).data) == bool(windowed.any())


def test_a_rerun_of_the_serving_sweep_measures_only_what_is_not_complete(tmp_path, tiny):
    from kvlab.serve.sweep import run_serving_sweep
    from kvlab.sweep.params import parse_params

    params = parse_params({"models": "tiny-llama", "weights": "synthetic", "methods": ["full"], "ctx": [32],
                           "traffic": {"arrival": "burst", "requests": 2,
                                       "lengths": {"kind": "fixed", "input": 8, "output": 2},
                                       "server": {"num_blocks": 8, "block_size": 4}}, "repeats": 2})
    sweep = lambda: run_serving_sweep(params, tmp_path, loader=lambda *a, **k: tiny, log=lambda s: None)  # noqa: E731
    first = sweep()
    assert [r["status"] for r in first] == ["complete", "complete"]
    log = tmp_path / "serve_runs.jsonl"
    assert sweep() == first and len(log.read_text().splitlines()) == 2  # nothing measured again
    # the second run cut short: its row says incomplete (a torn line after it); a rerun measures it again
    cut = {**first[1], "status": "incomplete"}
    log.write_text(json.dumps(first[0]) + "\n" + json.dumps(cut) + "\n{torn")
    again = sweep()
    assert [(r["run"], r["status"]) for r in again] == [(first[0]["run"], "complete"), (first[1]["run"], "complete")]
    assert (tmp_path / f"{first[1]['run']}.unfinished-1" / "run.json").exists()  # the cut run's files kept


def test_crossover_is_the_lowest_rate_from_which_a_method_stays_at_or_below_full():
    import pandas as pd

    from kvlab.serve.figures import crossover_rates
    df = pd.DataFrame({"label": ["full "] * 3 + ["snapkv x"] * 3, "rate": [1, 2, 4] * 2,
                       "energy_per_request": [1.0, 1.0, 1.0, 1.5, 0.9, 0.8]})
    assert crossover_rates(df) == {"snapkv x": 2}


def test_the_crossover_interval_brackets_the_rate_with_three_repeats_a_side():
    """Rate 1: snapkv costs ~1.5x (interval above 1); rate 2: ~1.0x, its interval straddles 1; rate 4:
    ~0.5x (interval below 1). The ratio pays from 2, may pay from 2, surely pays from 4. With 2
    repeats a side: the point and n=2, no bounds."""
    import pandas as pd

    from kvlab.serve.figures import crossover_interval
    method = {1: [1.5, 1.5, 1.6], 2: [0.95, 1.0, 1.05], 4: [0.5, 0.52, 0.48]}
    base = {1: [1.0, 1.0, 1.1], 2: [1.0, 1.02, 0.98], 4: [1.0, 1.02, 0.98]}
    rows = [{"label": lab, "rate": r, "energy_per_request": v} for lab, d in (("snapkv x", method), ("full ", base))
            for r, vs in d.items() for v in vs]
    got = crossover_interval(pd.DataFrame(rows))["snapkv x"]
    assert (got["rate"], got["lo"], got["hi"], got["n"], got["method"]) == (2, 2, 4, 3, "welch-log")
    r2 = got["ratios"][2]
    assert r2["lo"] < 1 < r2["hi"] and r2["value"] == pytest.approx(1.0)
    two = crossover_interval(pd.DataFrame([r for r in rows if r["energy_per_request"] not in (1.6, 1.05, 0.48, 1.1, 0.98)]))
    assert (two["snapkv x"]["rate"], two["snapkv x"]["lo"], two["snapkv x"]["hi"]) == (2, None, None)
    assert two["snapkv x"]["n"] == 2 and two["snapkv x"]["method"] == "none"


def test_closed_loop_keeps_at_most_users_requests_in_flight(tiny, tmp_path):
    from kvlab.serve.run import load_run, run_workload

    spec = parse_traffic({"arrival": "closed", "users": 2, "requests": 5, "lengths": FIXED})
    wl = build_workload(spec, None, None, vocab=100)
    engine = make_serving_engine(tiny, "full", num_blocks=32, block_size=4)
    res = run_workload(engine, wl, tmp_path)
    assert res["status"] == "complete" and len(res["records"]) == 5
    assert res["metrics"]["peak_concurrency"] == 2 and res["metrics"]["peak_running"] <= 2
    assert load_run(tmp_path)["status"] == "complete" and len(load_run(tmp_path)["records"]) == 5


def test_a_kvq_pool_subtracts_each_requests_key_offset_fitted_on_its_first_chunk():
    """Keys with a large constant channel (Qwen's k_proj bias): the pool stores k - m per request, m fitted on
    the request's first chunk and kept; attention over the stored keys equals attention over the exact keys
    far more closely than without the offset."""
    from kvlab.kernels.formats import parse_format
    from kvlab.storage.kvq import KVQPool
    from kvlab.storage.paged import PoolShape

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(24, 2, 64, generator=gen)
    k[..., 5] += 300.0  # one loud, nearly constant channel
    v = torch.randn(24, 2, 64, generator=gen)
    q = torch.randn(2, 1, 64, generator=gen)
    errors = {}
    for rule in ("none", "prompt-mean"):
        pool = KVQPool(parse_format("int4-g64"), PoolShape(1, 4, 8, 2, 64), torch.float32, "cpu", key_offset=rule)
        pool.write(0, torch.arange(16), k[:16], v[:16], owner=0, first=True)  # the prompt's chunk
        pool.write(0, torch.arange(16, 24), k[16:], v[16:], owner=0)  # later tokens: the same offset
        keys, values = pool.read(0, torch.arange(24))
        if rule == "prompt-mean":
            assert torch.allclose(pool.key_offsets[0][0][0], k[:16].mean(0))
        got = torch.softmax(q @ keys.transpose(1, 2) / 8, -1) @ values
        ref = torch.softmax(q @ k.transpose(0, 1).transpose(1, 2) / 8, -1) @ v.transpose(0, 1)
        errors[rule] = float((got - ref).norm() / ref.norm())
    assert errors["prompt-mean"] < 0.2 < 0.5 < errors["none"]  # measured: 0.13 and 0.89
