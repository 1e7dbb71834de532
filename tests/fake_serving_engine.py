"""A serving engine that keeps the contract of ``kvlab.serve.engine`` without a model: a block pool,
a waiting queue, a running batch of at most ``max_batch``, one letter token per running request per
step. The HTTP tests drive it; it records what it saw (peak batch, aborts) for them to check."""

from __future__ import annotations

import math
import time

from toy_tokenizer import ToyTokenizer

from kvlab.serve.engine import Request, ServeError, ServingEngine, TokenEvent


class SizedToyTokenizer(ToyTokenizer):
    def __len__(self) -> int:
        return 512


class FakeServingEngine(ServingEngine):
    model_name = "fake-model"

    def __init__(self, *, blocks_total: int = 64, block_size: int = 16, max_model_len: int = 256,
                 max_batch: int = 8, step_s: float = 0.0):
        self.tokenizer = SizedToyTokenizer()
        self.max_model_len = max_model_len
        self.blocks_total, self.block_size, self.max_batch, self.step_s = blocks_total, block_size, max_batch, step_s
        self.waiting: list[Request] = []
        self.running: dict[str, tuple[Request, int, int]] = {}  # id -> (request, blocks, tokens out)
        self.aborted: list[str] = []
        self.peak_running = 0
        self.fail_steps = 0  # the next N steps raise (an engine bug)

    def _blocks(self, request: Request) -> int:
        return math.ceil((len(request.prompt_ids) + request.max_new_tokens) / self.block_size)

    @property
    def blocks_used(self) -> int:
        return sum(blocks for _, blocks, _ in self.running.values())

    def add(self, request: Request) -> None:
        if self._blocks(request) > self.blocks_total:
            raise ServeError(f"needs {self._blocks(request)} blocks; the pool has {self.blocks_total}")
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        self.running.pop(request_id, None)

    def step(self) -> list[TokenEvent]:
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected engine failure")
        while (self.waiting and len(self.running) < self.max_batch
               and self.blocks_used + self._blocks(self.waiting[0]) <= self.blocks_total):
            request = self.waiting.pop(0)
            self.running[request.request_id] = (request, self._blocks(request), 0)
        self.peak_running = max(self.peak_running, len(self.running))
        if self.step_s:
            time.sleep(self.step_s)
        now, events = time.perf_counter(), []
        for rid, (request, blocks, out) in list(self.running.items()):
            out += 1
            done = out >= request.max_new_tokens
            events.append(TokenEvent(rid, ord("a") + (out - 1) % 26, now, done, "length" if done else None))
            if done:
                del self.running[rid]
            else:
                self.running[rid] = (request, blocks, out)
        return events

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        used = self.blocks_used
        return {"running": len(self.running), "waiting": len(self.waiting), "blocks_used": used,
                "blocks_free": self.blocks_total - used, "blocks_total": self.blocks_total, "preemptions_total": 0}
