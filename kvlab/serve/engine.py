"""The serving engine's contract: requests in, token events out, one scheduler iteration per step.

The HTTP server and the traffic driver both speak only this: ``add`` a :class:`Request`, call
``step`` until ``has_work`` is false, read :class:`TokenEvent` s (each with its time on the engine's
clock, ``time.perf_counter`` based), ``abort`` a request to free its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.errors import UserError


class ServeError(UserError):
    """A serving request or configuration that can never run (too long for the pool, bad method)."""


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float  # on the engine's clock (time.perf_counter based)
    ignore_eos: bool = True


@dataclass
class TokenEvent:
    request_id: str
    token_id: int
    time_s: float
    finished: bool
    finish_reason: str | None  # "length" | "stop" | "abort" | None


class ServingEngine:
    """Continuous batching over a block pool (filled in below the contract)."""

    tokenizer = None
    model_name: str = ""
    max_model_len: int = 0

    def add(self, request: Request) -> None:
        """Queue a request; raises :class:`ServeError` if it can never fit the pool."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Free the request's blocks; no more events for it."""
        raise NotImplementedError

    def step(self) -> list[TokenEvent]:
        """One scheduler iteration: prefill chunk(s) and/or one decode step."""
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def stats(self) -> dict:
        """running, waiting, blocks_used, blocks_free, blocks_total, preemptions_total."""
        raise NotImplementedError


def make_serving_engine(model, method: str, *, pool_gb=None, block_size=16, device="cpu",
                        **policy_params) -> ServingEngine:
    raise NotImplementedError
