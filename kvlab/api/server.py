"""The aiohttp app: OpenAI's routes over an :class:`~kvlab.api.bridge.EngineLoop`.

aiohttp (not FastAPI/Starlette + uvicorn) because one small package gives both the server and the
load generator's client (:mod:`kvlab.loadgen`), its client is the fastest pure-asyncio one we can
install (the load generator must not bound a measurement), and it cancels a handler whose client
left (``handler_cancellation``), which is how a disconnect mid-stream frees the request's blocks.

Every request ends in an answer or in the API's error object with a 4xx/5xx; no request can stop
the server (a failing engine step ends the requests it ran with a 500 and the loop goes on).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from kvlab.api.bridge import EngineFailure, EngineLoop
from kvlab.api.prometheus import metrics_text
from kvlab.api.protocol import (
    CHAT,
    COMPLETIONS,
    APIError,
    Job,
    full_response,
    parse_job,
    parse_json,
    sse,
    stream_chunk,
    usage_chunk,
)
from kvlab.errors import UserError
from kvlab.serve.engine import Request

log = logging.getLogger("kvlab.api")
DEFAULT_HOST = "127.0.0.1"


@dataclass
class ServerState:
    engine: object
    method: str
    energy_j: Callable[[], float | None]
    max_in_flight: int | None
    vocab_size: int
    outcomes: Counter = field(default_factory=Counter)
    loop: EngineLoop | None = None


STATE = web.AppKey("state", ServerState)


class Detokenizer:
    """A request's text, token by token, decoding only a short window (vLLM's incremental rule):
    the new text is what ``ids[prefix:]`` adds to ``ids[prefix:read]``; a half character (a
    replacement mark at the end) waits for the next token. ``text`` is the whole answer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta


def error_response(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


def _is_token(event) -> bool:
    return event.token_id >= 0 and event.finish_reason != "abort"


async def _next_events(events: asyncio.Queue) -> list:
    """Every event waiting on the queue (at least one): a slow client gets them in one write."""
    batch = [await events.get()]
    while not events.empty():
        batch.append(events.get_nowait())
    return batch


async def _stream(request: web.Request, job: Job, events: asyncio.Queue, detok: Detokenizer) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    tokens, done = 0, False
    while not done:
        out = bytearray()
        for event in await _next_events(events):
            if isinstance(event, EngineFailure):
                out += sse(APIError(500, event.message, type="server_error").body())
                done = True
                break
            text = detok.push(event.token_id) if _is_token(event) else ""
            tokens += _is_token(event)
            done = event.finished
            out += sse(stream_chunk(job, text, event.finish_reason if done else None, first=tokens <= 1))
            if done:
                break
        if done and job.include_usage:
            out += sse(usage_chunk(job, tokens))
        if done:
            out += sse("[DONE]")
        await resp.write(bytes(out))
    await resp.write_eof()
    return resp


async def _collect(job: Job, events: asyncio.Queue, detok: Detokenizer) -> web.Response:
    tokens = 0
    while True:
        event = await events.get()
        if isinstance(event, EngineFailure):
            raise APIError(500, event.message, type="server_error")
        if _is_token(event):
            detok.push(event.token_id)
            tokens += 1
        if event.finished:
            return web.json_response(full_response(job, detok.text, event.finish_reason, tokens))


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    engine = state.engine
    try:
        job = parse_job(kind, parse_json(await request.read()), served_model=engine.model_name,
                        tokenizer=engine.tokenizer, vocab_size=state.vocab_size, max_model_len=engine.max_model_len)
        if state.max_in_flight is not None and state.loop.in_flight >= state.max_in_flight:
            raise APIError(503, f"the server holds {state.loop.in_flight} requests (its limit): retry later",
                           type="server_overloaded")
    except APIError as err:
        state.outcomes["refused"] += 1
        return error_response(err)
    job.request_id = f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex}"
    engine_request = Request(job.request_id, job.prompt_ids, job.max_tokens, arrival_s=time.perf_counter(),
                             ignore_eos=job.ignore_eos)
    try:
        events = await state.loop.submit(engine_request)
    except UserError as err:  # the engine says it can never run (too long for the pool)
        state.outcomes["refused"] += 1
        return error_response(APIError(400, str(err), code="request_too_large"))
    except asyncio.CancelledError:
        state.outcomes["aborted"] += 1
        raise
    except Exception as err:
        state.outcomes["failed"] += 1
        log.exception("engine.add failed")
        return error_response(APIError(500, f"the engine failed: {type(err).__name__}: {err}", type="server_error"))
    finished = False
    try:
        detok = Detokenizer(engine.tokenizer)
        resp = await (_stream(request, job, events, detok) if job.stream else _collect(job, events, detok))
        finished = True
        state.outcomes["ok"] += 1
        return resp
    except APIError as err:
        finished = True
        state.outcomes["failed"] += 1
        return error_response(err)
    except (asyncio.CancelledError, ConnectionResetError):  # the client left: free its blocks
        state.outcomes["aborted"] += 1
        raise
    finally:
        if not finished:
            state.loop.abort(job.request_id)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CHAT)


async def models(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    card = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "kvlab",
            "max_model_len": engine.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    text = metrics_text(state.loop.stats, state.outcomes, energy_j=state.energy_j(), cpu_s=time.process_time(),
                        method=state.method)
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Format": "0.0.4"})


async def _not_found(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:  # aiohttp's own 404/405: the API's error object instead
        if exc.status >= 400:
            return error_response(APIError(exc.status, f"{request.method} {request.path}: {exc.reason}"))
        raise


def _vocab_size(engine) -> int:
    """The largest token id + 1 a prompt may hold (added tokens included)."""
    tokenizer = engine.tokenizer
    sized = len(tokenizer) if hasattr(tokenizer, "__len__") else 0
    return max(sized, getattr(tokenizer, "vocab_size", 0) or 0)


def make_app(engine, *, method: str, energy_j: Callable[[], float | None] = lambda: None,
             max_in_flight: int | None = None) -> web.Application:
    """The app over ``engine`` (a :class:`kvlab.serve.engine.ServingEngine`); its loop thread starts
    with the app and stops with it."""
    app = web.Application(middlewares=[web.middleware(_not_found)], client_max_size=64 * 2**20)
    state = ServerState(engine, method, energy_j, max_in_flight, _vocab_size(engine))
    app[STATE] = state

    async def start_loop(app: web.Application):
        state.loop = EngineLoop(engine, asyncio.get_running_loop())
        state.loop.start()
        yield
        state.loop.stop()

    app.cleanup_ctx.append(start_loop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


class ListenError(UserError):
    """The address cannot be listened on (taken, not this machine's)."""


def run_server(app: web.Application, host: str = DEFAULT_HOST, port: int = 8000) -> None:
    """Serve until interrupted (``kvlab serve``)."""
    try:
        web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None,
                    print=lambda msg: log.info("%s", msg))
    except OSError as err:
        raise ListenError(f"cannot listen on {host}:{port} ({err.strerror or err}): pick another --port or --host") \
            from None


class BackgroundServer:
    """The app served from a thread of its own (tests, notebooks, benchmarks):
    ``with BackgroundServer(app) as url: ...`` (port 0 picks a free port)."""

    def __init__(self, app: web.Application, host: str = DEFAULT_HOST, port: int = 0):
        self.app, self.host, self.port = app, host, port
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvlab-api", daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, self.host, self.port)
        self._loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    def __enter__(self) -> str:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the server did not start in 30 s")
        return self.url

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
