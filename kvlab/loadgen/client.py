"""Replay a trace against any OpenAI-compatible URL and time every streamed chunk.

Each request is sent at its trace offset (open loop: a slow server does not slow the arrivals)
over one keep-alive connection pool, streamed, and timed the way vLLM's serving benchmark times it:
a chunk that carries ``choices`` is a token arrival (the first is TTFT); ``usage`` in the last
chunk gives the token counts. The record has the in-process serving run's keys (``arrival_s``,
here the send time as vLLM's client takes it; ``token_times``; ``finish_s``; token counts: seconds
since the replay began, ``time.perf_counter``), so :mod:`kvlab.serve.metrics` reads both alike.
Every request ends in a record with a ``status``: ``ok``, ``refused`` (an HTTP error with the
server's reason) or ``failed`` (no answer: connection lost, timeout, a stream that ended early).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvlab.errors import UserError

COMPLETIONS = "completions"
CHAT = "chat"
PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class TimedRequest:
    """One trace row: when to send it (seconds after the replay starts) and what to ask for.
    ``prompt`` is token ids (exact input lengths on any server) or text (chat needs text)."""

    request_id: str
    arrival_s: float
    prompt: list[int] | str
    max_tokens: int


def request_body(item: TimedRequest, model: str, endpoint: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": item.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
    if endpoint == CHAT:
        if not isinstance(item.prompt, str):
            raise ValueError(f"{item.request_id}: chat needs a text prompt, not token ids")
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    return body


def _error_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:300].decode(errors="replace")


async def send_one(session: aiohttp.ClientSession, url: str, model: str, item: TimedRequest, *,
                   endpoint: str, t0: float, gate: asyncio.Semaphore | None = None) -> dict[str, Any]:
    """Send ``item`` at its offset after ``t0``; return its raw record (never raises)."""
    sent_ids = len(item.prompt) if isinstance(item.prompt, list) else None
    rec: dict[str, Any] = {"request_id": item.request_id, "scheduled_s": item.arrival_s, "arrival_s": None,
                           "input_tokens": sent_ids, "max_new_tokens": item.max_tokens, "token_times": [],
                           "finish_s": None, "output_tokens": None, "finish_reason": None,
                           "status": "failed", "http_status": None, "error": None}
    body = json.dumps(request_body(item, model, endpoint)).encode()
    delay = t0 + item.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    try:
        if gate is not None:
            await gate.acquire()
        rec["arrival_s"] = time.perf_counter() - t0
        async with session.post(url + PATHS[endpoint], data=body, headers=JSON_HEADERS) as resp:
            rec["http_status"] = resp.status
            if resp.status != 200:
                rec["status"], rec["error"] = "refused", _error_message(await resp.read())
                return rec
            done = await _read_stream(resp, rec, t0)
        rec["finish_s"] = time.perf_counter() - t0
        if rec["output_tokens"] is None:  # a server without usage in streams: one token per chunk
            rec["output_tokens"] = len(rec["token_times"])
        if done:
            rec["status"] = "ok"
        elif rec["error"] is None:
            rec["error"] = "the stream ended before [DONE]"
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as err:  # ValueError: a chunk not JSON
        rec["error"] = f"{type(err).__name__}: {err}"
    finally:
        if gate is not None and rec["arrival_s"] is not None:
            gate.release()
    return rec


async def _read_stream(resp: aiohttp.ClientResponse, rec: dict[str, Any], t0: float) -> bool:
    """Read SSE events into ``rec`` (each read's events stamped with its arrival); True once
    ``[DONE]`` arrived."""
    buf = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter() - t0
        buf += data.replace(b"\r\n", b"\n") if b"\r" in data else data
        *events, buf = buf.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and _take(line[5:].strip(), rec, now):
                    return True
                if rec["error"] is not None:
                    return False
    return False


def _take(data: bytes, rec: dict[str, Any], now: float) -> bool:
    """One event's data into ``rec``; True for ``[DONE]``."""
    if data == b"[DONE]":
        return True
    chunk = json.loads(data)
    if chunk.get("error"):
        rec["error"] = str(chunk["error"].get("message", chunk["error"]) if isinstance(chunk["error"], dict)
                           else chunk["error"])
        return False
    choices = chunk.get("choices")
    if choices:
        rec["token_times"].append(now)
        reason = choices[0].get("finish_reason")
        if reason:
            rec["finish_reason"] = reason
    usage = chunk.get("usage")
    if usage:
        rec["input_tokens"] = usage.get("prompt_tokens", rec["input_tokens"])
        rec["output_tokens"] = usage.get("completion_tokens")
    return False


class TargetError(UserError):
    """A target URL where no OpenAI-compatible server answers."""


async def first_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model ``/v1/models`` lists (a server that serves one)."""
    try:
        async with session.get(url + "/v1/models") as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, IndexError) as err:
        raise TargetError(f"{url}/v1/models: no OpenAI-compatible server answers there "
                          f"({type(err).__name__}: {err}); start one or fix --target") from None


async def replay(url: str, items: Sequence[TimedRequest], *, model: str | None = None,
                 endpoint: str = COMPLETIONS, max_concurrency: int | None = None, timeout_s: float = 3600.0,
                 on_record: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Send every item at its offset; return the records (in trace order) and the replay's start
    on ``time.perf_counter`` (the zero of every time field). ``on_record`` gets each record as its
    request ends (a run's log appends it at once)."""
    if endpoint not in PATHS:
        raise ValueError(f"endpoint {endpoint!r}: choose {' or '.join(PATHS)}")
    url = url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = model or await first_model(session, url)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        t0 = time.perf_counter()

        async def one(item: TimedRequest) -> dict[str, Any]:
            rec = await send_one(session, url, model, item, endpoint=endpoint, t0=t0, gate=gate)
            rec["model"], rec["endpoint"] = model, endpoint
            if on_record is not None:
                on_record(rec)
            return rec

        records = await asyncio.gather(*(one(item) for item in items))
    return list(records), t0
