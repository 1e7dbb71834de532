"""How many requests per second kvlab's load generator sustains against a server that answers
instantly, so that the client never bounds a measurement (goal: >= 2,000 requests/s on 2 cores).

The instant server runs in its own process: a bare asyncio protocol that answers every POST with a
canned stream (``--tokens`` chunks, a usage chunk, ``[DONE]``) over keep-alive HTTP/1.1. The load
generator sends ``--requests`` streamed requests, all at once behind ``--max-concurrency``, and
the rate is completed requests / the replay's duration. The client's CPU time per request is printed
beside it: on a shared machine the wall rate falls with others' load, the CPU time much less.
Each repeat prints its rate; with >= 3 repeats the mean and a 95% t-interval.

    python benchmarks/loadgen_overhead.py --requests 10000 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import time

from kvlab.intervals import mean_interval
from kvlab.loadgen.client import replay
from kvlab.loadgen.trace import fixed_items


def canned_stream(tokens: int) -> bytes:
    events = [{"id": "x", "object": "text_completion", "model": "instant",
               "choices": [{"index": 0, "text": "a", "finish_reason": "length" if i == tokens - 1 else None}]}
              for i in range(tokens)]
    events.append({"id": "x", "object": "text_completion", "model": "instant", "choices": [],
                   "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}})
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


MODELS = json.dumps({"object": "list", "data": [{"id": "instant", "object": "model"}]}).encode()
MODELS_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(MODELS), MODELS)


class Instant(asyncio.Protocol):
    """Keep-alive HTTP/1.1: reads a head and its Content-Length body, answers at once."""

    def __init__(self, answer: bytes):
        self.answer, self.buf = answer, b""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].lower()
            length = 0
            i = head.find(b"content-length:")
            if i >= 0:
                length = int(head[i + 15:].split(b"\r\n", 1)[0])
            if len(self.buf) < head_end + 4 + length:
                return
            self.buf = self.buf[head_end + 4 + length:]
            self.transport.write(MODELS_RESPONSE if head.startswith(b"get /v1/models") else self.answer)


def serve_instant(sock: socket.socket, tokens: int) -> None:
    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Instant(canned_stream(tokens)), sock=sock)
        await server.serve_forever()

    asyncio.run(main())


def one_run(url: str, requests: int, max_concurrency: int) -> tuple[float, float, dict]:
    """(requests/s over the replay, the client's CPU seconds per request, requests ok)."""
    items = fixed_items(requests, None, 8, 1, seed=0)
    cpu0 = time.process_time()
    records, _ = asyncio.run(replay(url, items, max_concurrency=max_concurrency))
    cpu = time.process_time() - cpu0
    ends = [r["finish_s"] for r in records if r["finish_s"] is not None]
    ok = sum(r["status"] == "ok" for r in records)
    return ok / max(ends), cpu / requests, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--tokens", type=int, default=4, help="token chunks per answer")
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sock = socket.create_server(("127.0.0.1", 0))
    server = mp.get_context("spawn").Process(target=serve_instant, args=(sock, args.tokens), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    rates = []
    try:
        for i in range(args.repeats):
            rate, cpu, ok = one_run(url, args.requests, args.max_concurrency)
            rates.append(rate)
            print(f"repeat {i}: {rate:,.0f} requests/s, client CPU {cpu * 1e6:,.0f} us/request "
                  f"({ok}/{args.requests} ok, "
                  f"{args.tokens} chunks each, concurrency {args.max_concurrency}, {time.strftime('%H:%M:%S')})")
    finally:
        server.terminate()
    mean = mean_interval(rates)  # a 95% t-interval; none below 3 repeats
    if mean.has_bounds:
        print(f"mean {mean.value:,.0f} requests/s, 95% t-interval [{mean.lo:,.0f}, {mean.hi:,.0f}] ({mean.n_text()}); "
              f"goal >= 2,000: {'met' if mean.lo >= 2000 else 'not met'}")
    else:
        print(f"n={len(rates)}: {', '.join(f'{r:,.0f}' for r in rates)} requests/s (no interval below 3 repeats)")


if __name__ == "__main__":
    main()
