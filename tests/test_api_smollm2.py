"""`kvlab serve` over the real serving engine and SmolLM2 (real weights), driven by kvlab's load
generator on loopback: every request answered with its usage, the blocks freed after a client
leaves mid-stream, and the records agreeing with the server's own /metrics."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvlab.api.server import BackgroundServer, make_app
from kvlab.loadgen.external import scrape
from kvlab.loadgen.run import run_load
from kvlab.loadgen.trace import fixed_items
from kvlab.serve.engine import make_serving_engine

pytestmark = pytest.mark.slow(reason="SmolLM2 through the serving engine behind HTTP (about 1 min on 2 cores)")


@pytest.fixture(scope="module")
def server(smollm2):
    engine = make_serving_engine(smollm2, "full", pool_gb=0.1)
    with BackgroundServer(make_app(engine, method="full")) as url:
        yield url, engine


def test_loadgen_against_kvlab_serve_with_smollm2(server, tmp_path):
    url, engine = server
    before = scrape(url)
    items = fixed_items(6, 8.0, 24, 6, seed=0, vocab_size=len(engine.tokenizer))
    result = run_load(url, items, tmp_path)
    after = scrape(url)
    m = result.metrics
    assert result.status == "complete" and m["completed"] == 6, [r["error"] for r in result.records]
    assert all(r["input_tokens"] == 24 and r["output_tokens"] == 6 and len(r["token_times"]) == 6
               for r in result.records)
    assert after['kvlab_requests_total{outcome="ok"}'] - before.get('kvlab_requests_total{outcome="ok"}', 0) == 6
    assert after["kvlab_kv_blocks_used"] == 0 and after["kvlab_num_requests_running"] == 0


def test_text_and_chat_answers_and_a_client_leaving_frees_its_blocks(server):
    url, engine = server

    async def talk():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": "The capital of France is",
                                                             "max_tokens": 4}) as r:
                text = await r.json()
            async with s.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3}) as r:
                chat = await r.json()
            r = await s.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 400,
                                                            "stream": True})
            seen = 0
            async for line in r.content:
                seen += line.startswith(b"data:")
                if seen == 3:
                    break
            r.close()
        for _ in range(300):  # bounded: 30 s
            values = scrape(url)
            if values["kvlab_kv_blocks_used"] == 0 and values['kvlab_requests_total{outcome="aborted"}'] >= 1:
                break
            await asyncio.sleep(0.1)
        return text, chat, values

    text, chat, values = asyncio.run(talk())
    assert text["choices"][0]["text"].strip().startswith("Paris") and text["usage"]["completion_tokens"] == 4
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] == 3
    assert values["kvlab_kv_blocks_used"] == 0 and values["kvlab_num_requests_running"] == 0
    assert values['kvlab_requests_total{outcome="aborted"}'] >= 1
