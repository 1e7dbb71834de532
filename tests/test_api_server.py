"""`kvlab serve`'s HTTP side over a fake engine (loopback only, bounded loops): the OpenAI routes,
streaming, bad requests, two clients at once, a client that leaves mid-stream, 200 requests with
nothing lost, and the load generator's records against the server's own counts."""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest
from fake_serving_engine import FakeServingEngine

from kvlab.api.server import BackgroundServer, make_app
from kvlab.loadgen.client import CHAT, replay
from kvlab.loadgen.meter import cpu_time_reader
from kvlab.loadgen.run import run_load
from kvlab.loadgen.trace import fixed_items
from kvlab.serve.run import load_run


def served(engine=None, **app_kwargs):
    engine = engine or FakeServingEngine()
    return engine, BackgroundServer(make_app(engine, method="full", **app_kwargs))


async def _post(url, path, body, raw=None):
    async with aiohttp.ClientSession() as s, s.post(url + path, data=raw if raw is not None else json.dumps(body),
                                                    headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


async def _get(url, path):
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return r.status, await r.text()


def metrics_values(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_completion_chat_models_health_metrics():
    engine, server = served()
    with server as url:
        status, body = asyncio.run(_post(url, "/v1/completions", {"model": "fake-model", "prompt": "the cat",
                                                                   "max_tokens": 5}))
        assert status == 200 and body["object"] == "text_completion"
        assert body["choices"][0]["text"] == "abcde" and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}  # "the" is one token
        status, body = asyncio.run(_post(url, "/v1/chat/completions", {
            "model": "fake-model", "max_completion_tokens": 3,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}))
        assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
        assert body["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}])))
        status, text = asyncio.run(_get(url, "/v1/models"))
        assert status == 200 and json.loads(text)["data"][0]["id"] == "fake-model"
        assert asyncio.run(_get(url, "/health"))[0] == 200
        status, text = asyncio.run(_get(url, "/metrics"))
        values = metrics_values(text)
        assert values["kvlab_num_requests_running"] == 0 and values["kvlab_kv_blocks_total"] == 64
        assert values['kvlab_requests_total{outcome="ok"}'] == 2
        assert "process_cpu_seconds_total" in values and "kvlab_num_preemptions_total" in values


@pytest.mark.parametrize("body,raw,status,param", [
    (None, b"{not json", 400, None),
    (None, b"[1, 2]", 400, None),
    ({"model": "gpt-4", "prompt": "hi"}, None, 404, "model"),
    ({"model": "fake-model", "prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens"),
    ({"model": "fake-model", "prompt": "hi", "max_tokens": -3}, None, 400, "max_tokens"),
    ({"model": "fake-model", "prompt": "hi", "max_tokens": "8"}, None, 400, "max_tokens"),
    ({"model": "fake-model", "prompt": "x" * 300, "max_tokens": 1}, None, 400, "prompt"),
    ({"model": "fake-model", "prompt": "x" * 200, "max_tokens": 100}, None, 400, "max_tokens"),
    ({"model": "fake-model", "prompt": [1, 2, 100000]}, None, 400, "prompt"),
    ({"model": "fake-model", "prompt": ["a", "b"]}, None, 400, "prompt"),
    ({"model": "fake-model", "prompt": ""}, None, 400, "prompt"),
    ({"model": "fake-model", "prompt": "hi", "n": 2}, None, 400, "n"),
    ({"model": "fake-model", "prompt": "hi", "stream": "yes"}, None, 400, "stream"),
])
def test_bad_requests_get_the_error_object_and_a_4xx(body, raw, status, param):
    _, server = served()
    with server as url:
        got, answer = asyncio.run(_post(url, "/v1/completions", body, raw))
        assert got == status and answer["error"]["message"] and answer["error"]["param"] == param
        ok, _ = asyncio.run(_post(url, "/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 2}))
        assert ok == 200  # the server lives on


def test_refusals_from_the_engine_routes_and_chat_shape():
    _, server = served(FakeServingEngine(blocks_total=2, max_model_len=256))  # 32 tokens fit the pool
    with server as url:
        got, answer = asyncio.run(_post(url, "/v1/completions", {"prompt": "x" * 40, "max_tokens": 8}))
        assert got == 400 and "pool" in answer["error"]["message"]
        got, answer = asyncio.run(_post(url, "/v1/chat/completions", {"messages": []}))
        assert got == 400 and answer["error"]["param"] == "messages"
        got, answer = asyncio.run(_post(url, "/v1/nothing", {}))
        assert got == 404 and "error" in answer
        status, text = asyncio.run(_get(url, "/metrics"))
        assert metrics_values(text)['kvlab_requests_total{outcome="refused"}'] == 2


def test_an_engine_failure_ends_its_requests_with_500_and_serving_goes_on():
    engine, server = served()
    engine.fail_steps = 1
    with server as url:
        got, answer = asyncio.run(_post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4}))
        assert got == 500 and "injected engine failure" in answer["error"]["message"]
        got, answer = asyncio.run(_post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4}))
        assert got == 200 and answer["usage"]["completion_tokens"] == 4
    assert engine.blocks_used == 0


def test_load_generator_against_the_server_records_match_usage_and_metrics(tmp_path):
    engine, server = served(FakeServingEngine(step_s=0.002))
    trace = fixed_items(24, 200.0, input_tokens=12, output_tokens=6, seed=1, vocab_size=256)
    with server as url:
        result = run_load(url, trace, tmp_path, counter=cpu_time_reader(os.getpid()))
        _, text = asyncio.run(_get(url, "/metrics"))
    m = result.metrics
    assert result.status == "complete" and m["requests"] == m["completed"] == 24 and m["failed"] == m["refused"] == 0
    for rec, item in zip(result.records, trace, strict=True):
        assert rec["status"] == "ok" and rec["input_tokens"] == 12 and rec["output_tokens"] == 6
        assert len(rec["token_times"]) == 6 and rec["finish_reason"] == "length"
        assert item.arrival_s <= rec["arrival_s"] < rec["token_times"][0] <= rec["token_times"][-1] <= rec["finish_s"]
    assert m["output_tokens"] == m["chunks"] == 24 * 6
    assert 0 < m["ttft_p50_s"] <= m["e2el_p50_s"] and m["tpot_p99_s"] >= m["tpot_p50_s"] > 0
    assert m["energy_source"].startswith("cpu-time") and m["peak_concurrency"] >= 1
    assert metrics_values(text)['kvlab_requests_total{outcome="ok"}'] == 24
    assert load_run(tmp_path)["status"] == "complete" and len(load_run(tmp_path)["records"]) == 24
    assert json.loads((tmp_path / "run.json").read_text())["metrics"]["completed"] == 24


def test_two_clients_at_once_share_the_batch():
    engine, server = served(FakeServingEngine(step_s=0.005))
    a = fixed_items(6, None, 8, 10, seed=2, vocab_size=256)
    b = [type(x)(f"b{x.request_id}", x.arrival_s, "the quick brown fox", x.max_tokens) for x in a]

    async def both(url):
        return await asyncio.gather(replay(url, a), replay(url, b, endpoint=CHAT))

    with server as url:
        (recs_a, _), (recs_b, _) = asyncio.run(both(url))
    assert all(r["status"] == "ok" and r["output_tokens"] == 10 for r in recs_a + recs_b)
    assert all(r["input_tokens"] == 8 for r in recs_a)
    assert engine.peak_running == 8  # both clients' requests ran in one batch (max_batch 8)


def test_a_client_leaving_mid_stream_cancels_its_request_and_frees_its_blocks():
    engine, server = served(FakeServingEngine(step_s=0.01))

    async def leave(url):
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 200, "stream": True})
            chunks = 0
            async for line in r.content:
                chunks += line.startswith(b"data:")
                if chunks == 3:
                    break
            r.close()  # drop the connection mid-stream
        for _ in range(200):  # bounded: 2 s
            _, text = await _get(url, "/metrics")
            values = metrics_values(text)
            if values["kvlab_kv_blocks_used"] == 0 and values['kvlab_requests_total{outcome="aborted"}'] == 1:
                return values
            await asyncio.sleep(0.01)
        return values

    with server as url:
        values = asyncio.run(leave(url))
        ok, _ = asyncio.run(_post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}))
    assert values["kvlab_kv_blocks_used"] == 0 and values["kvlab_num_requests_running"] == 0
    assert values['kvlab_requests_total{outcome="aborted"}'] == 1
    assert len(engine.aborted) == 1 and ok == 200


def test_200_requests_nothing_lost_each_answered_or_refused_with_a_reason():
    engine, server = served(FakeServingEngine(blocks_total=16, max_batch=8, step_s=0.001), max_in_flight=60)
    trace = fixed_items(200, None, 16, 8, seed=3, vocab_size=256)  # all at once: more than the server holds
    too_long = {i: type(t)(t.request_id, t.arrival_s, t.prompt * 20, t.max_tokens) for i, t in enumerate(trace)
                if i % 25 == 0}  # 320-token prompts: over the model's 256
    trace = [too_long.get(i, t) for i, t in enumerate(trace)]
    with server as url:
        records, _ = asyncio.run(replay(url, trace, timeout_s=60))
        _, text = asyncio.run(_get(url, "/metrics"))
    statuses = [r["status"] for r in records]
    assert len(records) == 200 and set(statuses) <= {"ok", "refused"}
    refused = [r for r in records if r["status"] == "refused"]
    assert all(r["error"] and r["http_status"] in (400, 503) for r in refused)
    assert sum(r["http_status"] == 400 for r in refused) == len(too_long)
    assert all(r["output_tokens"] == 8 for r in records if r["status"] == "ok")
    values = metrics_values(text)
    assert values['kvlab_requests_total{outcome="ok"}'] == statuses.count("ok") >= 60
    assert values['kvlab_requests_total{outcome="refused"}'] == len(refused)
    assert values["kvlab_kv_blocks_used"] == 0 and engine.peak_running <= 8


def test_server_survives_a_burst_of_disconnects():
    engine, server = served(FakeServingEngine(step_s=0.002))

    async def burst(url):
        async with aiohttp.ClientSession() as s:
            pending = [asyncio.create_task(s.post(url + "/v1/completions",
                                                  json={"prompt": "hi", "max_tokens": 50, "stream": True}))
                       for _ in range(20)]
            await asyncio.sleep(0.05)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            values = metrics_values((await _get(url, "/metrics"))[1])
            if values["kvlab_kv_blocks_used"] == 0 and values["kvlab_num_requests_waiting"] == 0:
                break
            await asyncio.sleep(0.02)
        return values

    with server as url:
        values = asyncio.run(burst(url))
        ok, _ = asyncio.run(_post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}))
    assert values["kvlab_kv_blocks_used"] == 0 and ok == 200


def test_gpu_energy_over_the_steady_state_from_an_nvml_counter():
    """The load generator's J/token with a (fake) local GPU at a constant 200 W: the window's
    energy is 200 W x its length, shared by the tokens generated in it."""
    from fake_nvml import FakeNvml

    from kvlab.loadgen.meter import nvml_reader

    counter = nvml_reader("cuda:0", nvml=FakeNvml(segments=[(0.0, 200.0)]), uuid="aaaa-0000")
    _, server = served(FakeServingEngine(step_s=0.004))
    with server as url:
        result = run_load(url, fixed_items(30, 40.0, 8, 4, seed=4, vocab_size=256), counter=counter)
    m = result.metrics
    assert m["energy_unit"] == "J" and m["energy_source"].startswith("nvml-counter")
    t0, t1 = m["steady_window_s"]
    tokens = sum(t0 < t <= t1 for r in result.records for t in r["token_times"])
    assert m["energy_per_output_token"] * tokens == pytest.approx(200.0 * (t1 - t0), rel=0.02)
    assert m["energy_per_request"] == pytest.approx(m["energy_per_output_token"] * 4)
    assert result.card["gpu_uuid"] == "GPU-aaaa-0000" and result.card["card"] == result.card["gpu_name"]
    assert m["energy_source"] == f"nvml-counter {result.card['gpu_name']}"  # the counter names its card


def test_incremental_text_waits_for_whole_characters():
    from kvlab.api.server import Detokenizer

    tok = FakeServingEngine().tokenizer  # byte-level: a multi-byte character spans tokens
    ids = tok.encode("the café 🎉 naïve")
    d = Detokenizer(tok)
    deltas = [d.push(i) for i in ids]
    assert "".join(deltas) == d.text == tok.decode(ids) and all("\ufffd" not in x for x in deltas)
    assert "" in deltas  # the first bytes of é and 🎉 gave no text yet


def test_serve_config_from_a_params_file_and_flags(tmp_path):
    import argparse

    from kvlab.cli.serve_cmd import register
    from kvlab.cli.serve_run import config_from_args

    (tmp_path / "s.yaml").write_text("model: smollm2-135m\nmethod: snapkv\npolicy: {keep: 0.5, window_size: 8}\n"
                                     "port: 8100\nmax_num_seqs: 4\n")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--params", str(tmp_path / "s.yaml"), "--keep", "0.25", "--port", "8200"])
    config = config_from_args(args)
    assert (config.model, config.method, config.port, config.host) == ("smollm2-135m", "snapkv", 8200, "127.0.0.1")
    assert config.policy == {"keep": 0.25, "window_size": 8}
    assert config.engine_options() == {"pool_gb": 1.0, "block_size": 16, "device": "cpu", "max_num_seqs": 4}


def test_a_traffic_block_with_target_runs_through_the_load_generator(tmp_path):
    """Sweep params' traffic: block with target: URL replays every rate x repeat against the server."""
    from kvlab.loadgen.sweep import run_target_sweep
    from kvlab.sweep.params import parse_params

    _, server = served(FakeServingEngine(step_s=0.002))
    with server as url:
        params = parse_params({"models": "tiny-llama", "weights": "synthetic", "methods": "full", "ctx": 16,
                               "repeats": 2, "traffic": {
            "arrival": "poisson", "rate": [50, 100], "requests": 6, "target": url, "slo": {"ttft": 5.0},
            "lengths": {"kind": "fixed", "input": 8, "output": 3}}})
        rows = run_target_sweep(params, tmp_path, log=lambda _: None)
    assert [(r["rate"], r["repeat"], r["status"], r["completed"]) for r in rows] == [
        (50, 0, "complete", 6), (100, 0, "complete", 6), (50, 1, "complete", 6), (100, 1, "complete", 6)]
    assert all(r["goodput"] > 0 and r["method"] == "external" for r in rows)
    assert len((tmp_path / "serve_runs.jsonl").read_text().splitlines()) == 4
    assert load_run(tmp_path / rows[0]["run"])["status"] == "complete"
